"""Prometheus metrics of one swarm server (`GET /metrics`), read from the server's live state at scrape time.

A collector per server and a registry per app (not prometheus-client's global registry): several servers can run
in one process (tests) without sharing numbers. Counters are the server's own counts since the process started
(Prometheus handles the reset on restart); gauges are read at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from marl.protocol import EngineState, PoolInfo

if TYPE_CHECKING:
    from servers.swarm import SwarmServer

#: lease outcomes counted by the server: counter key -> `event` label
LEASE_EVENTS = {"leases_begun": "begun", "episodes_ended": "ended", "leases_aborted": "aborted",
                "leases_requeued": "requeued", "leases_discarded": "discarded", "leases_expired": "expired"}


class SwarmCollector(Collector):
    def __init__(self, server: SwarmServer):
        self.server = server
        self.pool: PoolInfo | None = None  # read from the ledger by the route just before a scrape (async)

    def collect(self) -> Iterator[Metric]:
        s, counts = self.server, self.server.counters
        model = [s.served_name]

        leases = CounterMetricFamily("marl_leases", "Episode leases by event (ended: committed with a reward).",
                                     labels=["model", "event"])
        for key, event in LEASE_EVENTS.items():
            leases.add_metric([*model, event], counts[key])
        yield leases
        yield _counter("marl_calls", "Chat completion calls served.", model, counts["calls"])
        yield _counter("marl_calls_discarded", "Calls whose lease died before they finished.", model,
                       counts["calls_discarded"])
        tokens = CounterMetricFamily("marl_tokens", "Tokens processed by the data plane.", labels=["model", "kind"])
        tokens.add_metric([*model, "prompt"], counts["tokens_prompt"])
        tokens.add_metric([*model, "generated"], counts["tokens_generated"])
        yield tokens
        stats = getattr(s.engine, "stats", None)  # the torch engine's prefill counters (see its prefix cache)
        if stats is not None and hasattr(stats, "cached_tokens"):
            prompt = CounterMetricFamily("marl_engine_prompt_tokens", "Prompt tokens run through the model (prefilled)"
                                         " or reused from the prefix cache (cached).", labels=["model", "kind"])
            prompt.add_metric([*model, "prefilled"], stats.prefilled_tokens)
            prompt.add_metric([*model, "cached"], stats.cached_tokens)
            yield prompt
        yield _counter("marl_samples_recorded", "Training samples written to the ledger.", model,
                       counts["samples_recorded"])
        yield _counter("marl_samples_dropped_stale", "Samples too stale to train on.", model,
                       counts["samples_dropped_stale"])
        yield _counter("marl_train_steps", "Training steps taken by this process.", model, counts["train_steps"])

        state = GaugeMetricFamily("marl_engine_state", "1 for the engine's current state.", labels=["model", "state"])
        for value in EngineState:
            state.add_metric([*model, value.value], float(s.state == value))
        yield state
        yield _gauge("marl_policy_version", "Training steps behind the served weights.", model, s.step)
        yield _gauge("marl_running_leases", "Leases currently open.", model, len(s.leases))
        yield _gauge("marl_generated_tokens_per_second", "Generated tokens/s over the last 10 s.", model,
                     s.tokens_per_s())
        if self.pool is not None:
            yield _gauge("marl_pool_pending_episodes", "Ended episodes not yet trained on.", model,
                         self.pool.pending_episodes)
            yield _gauge("marl_pool_complete_groups", "Groups with num_repeat episodes, ready to train.", model,
                         self.pool.complete_groups)
            yield _gauge("marl_pool_target_groups", "Groups per training step (batch_size).", model,
                         self.pool.batch_size)
        if s.record and s.record.recent:
            last = s.record.recent[-1].metrics
            for key, name in (("reward_mean", "marl_last_step_reward_mean"), ("loss", "marl_last_step_loss")):
                if key in last:
                    yield _gauge(name, f"{key} of the latest training step.", model, last[key])


def _counter(name: str, doc: str, labels: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model"])
    family.add_metric(labels, value)
    return family


def _gauge(name: str, doc: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model"])
    family.add_metric(labels, value)
    return family


class ServerMetrics:
    """The `/metrics` page of one server."""

    def __init__(self, server: SwarmServer):
        self.server = server
        self.collector = SwarmCollector(server)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)

    async def render(self) -> bytes:
        self.collector.pool = None if self.server.static else await self.server.pool_info()
        return generate_latest(self.registry)
