"""What a server reports about itself: counters, recent errors, tokens/s, and the monitor snapshot built from them.

`Telemetry` is written by the rooms as things happen (a lease begins, a call finishes, a step fails) and read by
`/control/status` (its `metrics`), `/control/monitor` and the Prometheus `/metrics` page. Both the trainable and
the static server keep one.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
import uuid
from collections.abc import Iterable

from marl.protocol import ErrorEvent, MonitorSnapshot, PoolInfo, ServerStatus, StepRecord, TrainingProgress

#: tokens/s is measured over this window.
RATE_WINDOW_S = 10.0
#: errors a monitor shows.
ERRORS_KEPT = 20


@dataclasses.dataclass
class Counters:
    """Counts since the process started (status `metrics`, and Prometheus counters)."""

    leases_begun: int = 0
    episodes_ended: int = 0  # into the pool: ended, or prepared and then committed
    episodes_prepared: int = 0
    prepared_aborted: int = 0  # prepared episodes aborted (by their client, or at their deadline)
    leases_aborted: int = 0
    leases_requeued: int = 0  # aborted or expired while ROLLING: the slot went back to the pool
    leases_discarded: int = 0  # aborted or expired after the batch filled, or closed by an engine stop
    leases_expired: int = 0
    calls: int = 0
    calls_discarded: int = 0  # finished after their lease died: not recorded
    tokens_prompt: int = 0
    tokens_generated: int = 0
    samples_recorded: int = 0
    samples_dropped_stale: int = 0
    episodes_silent: int = 0  # in groups whose agent never called the model: dropped, nothing to train on
    train_steps: int = 0
    train_steps_empty: int = 0  # steps that trained no token (every group of zero reward variance, or empty)

    def as_metrics(self) -> dict[str, float]:
        return {name: float(value) for name, value in dataclasses.asdict(self).items()}


class ErrorLog:
    """The error the server is stuck on (`last_error`), and the latest errors, timestamped, for a monitor."""

    def __init__(self) -> None:
        self.last_error: str | None = None
        self.recent: collections.deque[ErrorEvent] = collections.deque(maxlen=ERRORS_KEPT)

    def report(self, message: str) -> None:
        self.last_error = message
        self.recent.append(ErrorEvent(time=time.time(), message=message))

    def clear(self) -> None:
        """The server starts over (engine start): the last error no longer holds; the history stays."""
        self.last_error = None


class TokenRate:
    """Generated tokens per second over the last RATE_WINDOW_S (calls that finished in the window)."""

    def __init__(self) -> None:
        self._finished: collections.deque[tuple[float, int]] = collections.deque()  # (monotonic, tokens)

    def add(self, tokens: int) -> None:
        now = time.monotonic()
        self._finished.append((now, tokens))
        self._forget_before(now - RATE_WINDOW_S)  # here too: a server nobody polls must not keep every call

    def per_s(self) -> float:
        self._forget_before(time.monotonic() - RATE_WINDOW_S)
        return sum(n for _, n in self._finished) / RATE_WINDOW_S

    def _forget_before(self, horizon: float) -> None:
        while self._finished and self._finished[0][0] < horizon:
            self._finished.popleft()


class GenerationClock:
    """How long the engine generated for this server: wall time with at least one generation running.

    The rollout idle fraction over a window is 1 - busy / wall: the share of the time no rollout used the engine
    (drains and drained training steps show as idle; `overlap` removes them). Entered and left on the event loop.
    """

    def __init__(self) -> None:
        self._running = 0
        self._busy_s = 0.0
        self._since = 0.0  # monotonic start of the current busy stretch
        self.first_start: float | None = None  # monotonic time of the first generation: where idle time starts

    @contextlib.contextmanager
    def generating(self):
        """Around one generation."""
        now = time.monotonic()
        if self._running == 0:
            self._since = now
            self.first_start = now if self.first_start is None else self.first_start
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            if self._running == 0:
                self._busy_s += time.monotonic() - self._since

    def busy_s(self) -> float:
        """Seconds with a generation running, up to now."""
        return self._busy_s + (time.monotonic() - self._since if self._running else 0.0)

    def mark(self) -> tuple[float, float]:
        """(now, busy seconds so far): the start of a window for `idle_fraction`."""
        return time.monotonic(), self.busy_s()

    def idle_fraction(self, since: tuple[float, float] | None = None) -> float | None:
        """Share of the wall time since `since` (default: the first generation) with no generation running."""
        if since is None:
            if self.first_start is None:
                return None
            since = (self.first_start, 0.0)
        wall = time.monotonic() - since[0]
        return None if wall <= 0 else min(1.0, max(0.0, 1.0 - (self.busy_s() - since[1]) / wall))


class Telemetry:
    """One server process's counters, errors and token rate, and the instance id that tells a restart apart."""

    def __init__(self) -> None:
        self.counters = Counters()
        self.errors = ErrorLog()
        self.generated = TokenRate()
        self.generation = GenerationClock()
        self.instance_id = uuid.uuid4().hex  # a monitor sees a restart as a new id
        self.started_at = time.time()

    def snapshot(self, status: ServerStatus, *, pool: PoolInfo | None = None, recent_steps: Iterable[StepRecord] = (),
                 training: TrainingProgress | None = None) -> MonitorSnapshot:
        return MonitorSnapshot(
            instance_id=self.instance_id,
            started_at=self.started_at,
            status=status,
            pool=pool,
            recent_steps=list(recent_steps),
            tokens_per_s=self.generated.per_s(),
            rate_window_s=RATE_WINDOW_S,
            errors=list(self.errors.recent),
            training=training,
        )
