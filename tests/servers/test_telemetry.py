"""A server's telemetry keeps nothing per call beyond its window, and its generation clock adds up busy time."""

from __future__ import annotations

import servers.metrics.telemetry as telemetry
from servers.metrics.telemetry import GenerationClock, TokenRate


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_token_rate_forgets_calls_outside_its_window_even_when_nobody_reads_it(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(telemetry.time, "monotonic", clock)
    rate = TokenRate()
    for _ in range(10_000):  # 10,000 calls, one every 0.01 s: only the last RATE_WINDOW_S are kept
        rate.add(5)
        clock.now += 0.01
    assert len(rate._finished) <= telemetry.RATE_WINDOW_S / 0.01 + 1
    assert abs(rate.per_s() - 500.0) < 1.0


def test_the_generation_clock_counts_time_with_any_generation_running(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(telemetry.time, "monotonic", clock)
    gen = GenerationClock()
    assert gen.idle_fraction() is None  # nothing generated yet
    with gen.generating():  # 0-2 s: one generation
        clock.now += 1.0
        with gen.generating():  # 1-2 s: two overlapping ones count once
            clock.now += 1.0
    mark = gen.mark()
    clock.now += 2.0  # 2-4 s: idle
    assert gen.busy_s() == 2.0 and gen.idle_fraction() == 0.5
    assert gen.idle_fraction(since=mark) == 1.0
