"""Prometheus metrics of one swarm server (`GET /metrics`): a `MetricsReading` of its live state, in text format.

The server takes a reading at scrape time and `render` turns it into Prometheus text with a registry of its own
(not prometheus-client's global one), so several servers can run in one process (tests) without sharing numbers.
Counters are the server's own counts since the process started (Prometheus handles the reset on restart); gauges
are read at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from marl.protocol import EngineState, PoolInfo
from servers.telemetry import Counters

#: lease outcomes counted by the server: counter key -> `event` label
LEASE_EVENTS = {"leases_begun": "begun", "episodes_ended": "ended", "leases_aborted": "aborted",
                "leases_requeued": "requeued", "leases_discarded": "discarded", "leases_expired": "expired",
                "episodes_prepared": "prepared", "prepared_aborted": "prepared_aborted"}


@dataclass
class MetricsReading:
    """What one scrape shows of a server."""

    model: str  # the served model name (the `model` label)
    state: EngineState
    policy_version: int
    running_leases: int
    tokens_per_s: float
    counters: Counters
    engine_stats: Any = None  # the torch engine's `EngineStats` (prefix-cache counts); None for other engines
    pool: PoolInfo | None = None  # None on a static server
    last_step: dict[str, float] = field(default_factory=dict)  # metrics of the latest training step


def render(reading: MetricsReading) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ReadingCollector(reading))
    return generate_latest(registry)


class _ReadingCollector(Collector):
    def __init__(self, reading: MetricsReading):
        self.reading = reading

    def collect(self) -> Iterator[Metric]:
        yield from self._counters()
        yield from self._gauges()

    def _counters(self) -> Iterator[Metric]:
        r, counts = self.reading, self.reading.counters
        model = [r.model]
        leases = CounterMetricFamily("marl_leases", "Episode leases by event (ended: committed with a reward).",
                                     labels=["model", "event"])
        for key, event in LEASE_EVENTS.items():
            leases.add_metric([*model, event], getattr(counts, key))
        yield leases
        yield _counter("marl_calls", "Chat completion calls served.", model, counts.calls)
        yield _counter("marl_calls_discarded", "Calls whose lease died before they finished.", model,
                       counts.calls_discarded)
        tokens = CounterMetricFamily("marl_tokens", "Tokens processed by the data plane.", labels=["model", "kind"])
        tokens.add_metric([*model, "prompt"], counts.tokens_prompt)
        tokens.add_metric([*model, "generated"], counts.tokens_generated)
        yield tokens
        stats = r.engine_stats
        if stats is not None and hasattr(stats, "cached_tokens"):
            prompt = CounterMetricFamily("marl_engine_prompt_tokens", "Prompt tokens run through the model (prefilled)"
                                         " or reused from the prefix cache (cached).", labels=["model", "kind"])
            prompt.add_metric([*model, "prefilled"], stats.prefilled_tokens)
            prompt.add_metric([*model, "cached"], stats.cached_tokens)
            yield prompt
        yield _counter("marl_samples_recorded", "Training samples written to the ledger.", model,
                       counts.samples_recorded)
        yield _counter("marl_samples_dropped_stale", "Samples too stale to train on.", model,
                       counts.samples_dropped_stale)
        yield _counter("marl_train_steps", "Training steps taken by this process.", model, counts.train_steps)

    def _gauges(self) -> Iterator[Metric]:
        r = self.reading
        model = [r.model]
        state = GaugeMetricFamily("marl_engine_state", "1 for the engine's current state.", labels=["model", "state"])
        for value in EngineState:
            state.add_metric([*model, value.value], float(r.state == value))
        yield state
        yield _gauge("marl_policy_version", "Training steps behind the served weights.", model, r.policy_version)
        yield _gauge("marl_running_leases", "Leases currently open.", model, r.running_leases)
        yield _gauge("marl_generated_tokens_per_second", "Generated tokens/s over the last 10 s.", model,
                     r.tokens_per_s)
        if r.pool is not None:
            yield _gauge("marl_pool_pending_episodes", "Ended episodes not yet trained on.", model,
                         r.pool.pending_episodes)
            yield _gauge("marl_pool_complete_groups", "Groups with num_repeat episodes, ready to train.", model,
                         r.pool.complete_groups)
            yield _gauge("marl_pool_target_groups", "Groups per training step (batch_size).", model,
                         r.pool.batch_size)
        for key, name in (("reward_mean", "marl_last_step_reward_mean"), ("loss", "marl_last_step_loss")):
            if key in r.last_step:
                yield _gauge(name, f"{key} of the latest training step.", model, r.last_step[key])


def _counter(name: str, doc: str, labels: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model"])
    family.add_metric(labels, value)
    return family


def _gauge(name: str, doc: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model"])
    family.add_metric(labels, value)
    return family
