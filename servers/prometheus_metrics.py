"""Prometheus metrics of one swarm server (`GET /metrics`): a `MetricsReading` of its live state, in text format.

The server takes a reading at scrape time and `render` turns it into Prometheus text with a registry of its own
(not prometheus-client's global one), so several servers can run in one process (tests) without sharing numbers.
Counters are the server's own counts since the process started (Prometheus handles the reset on restart); gauges
are read at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from marl.protocol import DEFAULT_POLICY, EngineState, PoolInfo
from servers.telemetry import Counters

#: lease outcomes counted by the server: counter key -> `event` label
LEASE_EVENTS = {"leases_begun": "begun", "episodes_ended": "ended", "leases_aborted": "aborted",
                "leases_requeued": "requeued", "leases_discarded": "discarded", "leases_expired": "expired",
                "episodes_prepared": "prepared", "prepared_aborted": "prepared_aborted"}


@dataclass
class MetricsReading:
    """What one scrape shows of a server, or of one policy of a server of several."""

    model: str  # the served model name (the `model` label)
    state: EngineState
    policy_version: int
    running_leases: int
    tokens_per_s: float
    counters: Counters
    engine_stats: Any = None  # the torch engine's `EngineStats` (prefix-cache counts); None for other engines
    pool: PoolInfo | None = None  # None on a static server
    last_step: dict[str, float] = field(default_factory=dict)  # metrics of the latest training step
    policy: str = DEFAULT_POLICY  # the `policy` label: a LoRA policy's name, else DEFAULT_POLICY


def render(reading: MetricsReading) -> bytes:
    return render_all([reading], model=reading.model)


def render_all(readings: list[MetricsReading], *, model: str) -> bytes:
    """One scrape of a server of several policies: each reading's series labelled with its policy, and `model`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ReadingsCollector([replace(r, model=model) for r in readings]))
    return generate_latest(registry)


_LABELS = ["model", "policy"]


class _ReadingsCollector(Collector):
    def __init__(self, readings: list[MetricsReading]):
        self.readings = readings

    def collect(self) -> Iterator[Metric]:
        for family, value_of in _counter_families() + _gauge_families():
            rows = [(r, value_of(r)) for r in self.readings]
            rows = [(r, v) for r, v in rows if v is not None]
            if not rows:
                continue
            for reading, values in rows:
                for extra, value in (values if isinstance(values, list) else [([], values)]):
                    family.add_metric([reading.model, reading.policy, *extra], value)
            yield family


def _counter_families() -> list[tuple[Metric, Any]]:
    def engine(kind: str):
        return lambda r: (getattr(r.engine_stats, f"{kind}_tokens") if hasattr(r.engine_stats, "cached_tokens")
                          else None)

    count = lambda key: lambda r: getattr(r.counters, key)  # noqa: E731
    return [
        (CounterMetricFamily("marl_leases", "Episode leases by event (ended: committed with a reward).",
                             labels=[*_LABELS, "event"]),
         lambda r: [([event], getattr(r.counters, key)) for key, event in LEASE_EVENTS.items()]),
        (_counter("marl_calls", "Chat completion calls served."), count("calls")),
        (_counter("marl_calls_discarded", "Calls whose lease died before they finished."), count("calls_discarded")),
        (CounterMetricFamily("marl_tokens", "Tokens processed by the data plane.", labels=[*_LABELS, "kind"]),
         lambda r: [(["prompt"], r.counters.tokens_prompt), (["generated"], r.counters.tokens_generated)]),
        (CounterMetricFamily("marl_engine_prompt_tokens", "Prompt tokens run through the model (prefilled) or"
                             " reused from the prefix cache (cached).", labels=[*_LABELS, "kind"]),
         lambda r: [(["prefilled"], engine("prefilled")(r)), (["cached"], engine("cached")(r))]
         if engine("cached")(r) is not None else None),
        (_counter("marl_samples_recorded", "Training samples written to the ledger."), count("samples_recorded")),
        (_counter("marl_samples_dropped_stale", "Samples too stale to train on."), count("samples_dropped_stale")),
        (_counter("marl_train_steps", "Training steps taken by this process."), count("train_steps")),
    ]


def _gauge_families() -> list[tuple[Metric, Any]]:
    pool = lambda key: lambda r: getattr(r.pool, key) if r.pool is not None else None  # noqa: E731
    last = lambda key: lambda r: r.last_step.get(key)  # noqa: E731
    return [
        (GaugeMetricFamily("marl_engine_state", "1 for the engine's current state.", labels=[*_LABELS, "state"]),
         lambda r: [([value.value], float(r.state == value)) for value in EngineState]),
        (_gauge("marl_policy_version", "Training steps behind the served weights."), lambda r: r.policy_version),
        (_gauge("marl_running_leases", "Leases currently open."), lambda r: r.running_leases),
        (_gauge("marl_generated_tokens_per_second", "Generated tokens/s over the last 10 s."),
         lambda r: r.tokens_per_s),
        (_gauge("marl_pool_pending_episodes", "Ended episodes not yet trained on."), pool("pending_episodes")),
        (_gauge("marl_pool_complete_groups", "Groups with num_repeat episodes, ready to train."),
         pool("complete_groups")),
        (_gauge("marl_pool_target_groups", "Groups per training step (batch_size)."), pool("batch_size")),
        (_gauge("marl_last_step_reward_mean", "reward_mean of the latest training step."), last("reward_mean")),
        (_gauge("marl_last_step_loss", "loss of the latest training step."), last("loss")),
    ]


def _counter(name: str, doc: str) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=_LABELS)


def _gauge(name: str, doc: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=_LABELS)
