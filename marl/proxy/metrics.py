"""The proxy's Prometheus metrics (`GET /metrics`), on a registry of its own (several proxies may share a process).

Counts only, as the swarm server's: no prompts, no keys. Rewards are labelled with the policy version that produced
the candidates, so `_sum / _count` per version is the reward curve of the training the app's traffic drives.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest

#: Request outcomes: the best candidate returned / the first returned, unscored (the reward function failed) /
#: an error answered (a candidate failed, a bad request) / 503 after waiting --max-wait-s for leases.
OUTCOMES = ("best", "unscored", "error", "unavailable")
#: What became of an episode: ended with its rewards / aborted (nothing recorded) / lost (its lease died first).
DISPOSITIONS = ("ended", "aborted", "lost")


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("marl_proxy_requests", "App requests answered, by outcome.", ["outcome"], registry=r)
        self.episodes = Counter("marl_proxy_episodes", "Episodes the proxy closed on the swarm server.",
                                ["disposition"], registry=r)
        self.turns = Counter("marl_proxy_turns", "Turns served: continuing a conversation's lease, or fresh.",
                             ["kind"], registry=r)
        self.in_flight = Gauge("marl_proxy_requests_in_flight", "App requests being answered.", registry=r)
        self.waiting = Gauge("marl_proxy_requests_waiting", "Requests waiting for the swarm server to grant leases"
                             " (it drains, trains, or has no free slot).", registry=r)
        self.conversations = Gauge("marl_proxy_conversations_held", "Conversations whose lease is held for the next"
                                   " turn.", registry=r)
        self.policy_version = Gauge("marl_proxy_policy_version", "Policy version of the latest scored turn.",
                                    registry=r)
        self.candidate_reward = Summary("marl_proxy_candidate_reward", "Reward of every scored candidate.",
                                        ["policy_version"], registry=r)
        self.returned_reward = Summary("marl_proxy_returned_reward", "Reward of the candidate returned to the app.",
                                       ["policy_version"], registry=r)
        self.latency = Histogram("marl_proxy_request_seconds", "From the app's request to the proxy's answer.",
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        for disposition in DISPOSITIONS:
            self.episodes.labels(disposition)
        for kind in ("fresh", "continued"):
            self.turns.labels(kind)

    def scored(self, policy_version: int, rewards: list[float], returned: int) -> None:
        version = str(policy_version)
        for reward in rewards:
            self.candidate_reward.labels(version).observe(reward)
        self.returned_reward.labels(version).observe(rewards[returned])
        self.policy_version.set(policy_version)
        self.requests.labels("best").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
