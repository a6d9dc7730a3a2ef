"""`LeaseBroker`: the proxy's side of the swarm server's episode API (begin, end, abort, renew, status).

Leases are begun all at once or not at all: a begin the server refuses for now ("wait": it drains, trains, boots, is
OFFLINE, or has no free slot) gives back the leases granted alongside it, because a draining server waits for every
lease to go before it trains; the proxy never holds a lease while it waits. `acquire` retries for at most
`max_wait_s`, then answers 503 with `Retry-After`.

`SwarmClient` is synchronous; its calls run on a thread pool of their own so the proxy's event loop never blocks.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from marl.client import EpisodeOutput, SwarmClient, SwarmError, SwarmRefused, SwarmTimeout
from marl.protocol import EngineState, EpisodeLease, ErrorCode, ServerStatus
from marl.proxy.errors import ProxyError
from marl.proxy.metrics import ProxyMetrics

log = logging.getLogger("marl.proxy")

_UNREACHABLE_PAUSE_S = 0.5  # the server did not answer: it may be restarting
_OFFLINE_PAUSE_S = 1.0  # the engine is OFFLINE: an operator (or `marl run`) may start it again
_JITTER = 0.25  # waiting requests do not retry in lockstep

_T = TypeVar("_T")


@dataclass(frozen=True)
class Wait:
    """The server granted no lease for now: how long it asked to wait, and why."""

    pause_s: float
    state: EngineState | None
    reason: str


class LeaseBroker:
    def __init__(self, client: SwarmClient, *, max_wait_s: float, metrics: ProxyMetrics, threads: int = 32) -> None:
        self.client = client
        self.max_wait_s = max_wait_s
        self._metrics = metrics
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="marl-proxy-swarm")
        # One acquisition at a time: two requests never each hold part of the free slots and wait for the rest.
        self._acquiring = asyncio.Lock()

    async def call(self, method: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run a blocking `SwarmClient` method on the broker's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(method, *args, **kwargs))

    async def acquire(self, n: int, *, before_waiting: Callable[[], None]) -> list[EpisodeLease]:
        """`n` leases, waiting while the server says wait (calling `before_waiting` each time), for at most
        `max_wait_s`; then `ProxyError` 503 with the server's reason and a Retry-After."""
        deadline = time.monotonic() + self.max_wait_s
        while True:
            outcome = await self.try_acquire(n)
            if not isinstance(outcome, Wait):
                return outcome
            before_waiting()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _unavailable(outcome, self.max_wait_s)
            self._metrics.waiting.inc()
            try:
                await asyncio.sleep(min(outcome.pause_s * (1 + _JITTER * random.random()), remaining))
            finally:
                self._metrics.waiting.dec()

    async def try_acquire(self, n: int) -> list[EpisodeLease] | Wait:
        """`n` leases if the server grants them all now; else none are kept and the server's `Wait` is returned."""
        if n == 0:
            return []
        async with self._acquiring:
            outcomes = await asyncio.gather(*(self._begin() for _ in range(n)), return_exceptions=True)
        leases = [o for o in outcomes if isinstance(o, EpisodeLease)]
        if len(leases) == n:
            return leases
        await self.abort(leases)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return next(o for o in outcomes if isinstance(o, Wait))

    async def _begin(self) -> EpisodeLease | Wait:
        try:
            _, lease = await self.call(self.client.begin_episode, timeout=0.0)  # one try: the broker does the waiting
            return lease
        except SwarmTimeout as exc:  # told to wait (retry_after_s), or the server did not answer
            info = exc.error
            pause = info.retry_after_s if info and info.retry_after_s else _UNREACHABLE_PAUSE_S
            return Wait(pause, exc.last_state, info.message if info else f"the swarm server did not answer ({exc})")
        except SwarmRefused as exc:
            if exc.code is ErrorCode.ENGINE_NOT_ROLLING:  # OFFLINE
                return Wait(_OFFLINE_PAUSE_S, exc.state, exc.error.message if exc.error else str(exc))
            raise _refused(exc) from exc
        except SwarmError as exc:
            raise _refused(exc) from exc

    async def abort(self, leases: list[EpisodeLease]) -> None:
        """Abort `leases` (nothing of theirs is recorded); one the server no longer knows counts as aborted too."""
        results = await asyncio.gather(*(self.call(self.client.abort_episode, lease.episode_id) for lease in leases),
                                       return_exceptions=True)
        for lease, result in zip(leases, results):
            if isinstance(result, BaseException):
                log.warning("abort of episode %s failed (%s); its lease expires on the server", lease.episode_id,
                            result)

    async def end(self, lease: EpisodeLease, task_id: str, output: EpisodeOutput) -> bool:
        """End the episode with its rewards; False (logged) if the server no longer had it."""
        try:
            await self.call(self.client.end_episode, task_id, lease.episode_id, output)
            return True
        except SwarmError as exc:
            log.warning("episode %s (task %s) could not be ended, its calls are not recorded: %s", lease.episode_id,
                        task_id, exc)
            return False

    async def renew(self, lease: EpisodeLease) -> bool:
        """Is the lease still alive? (Resets its idle timer.)"""
        try:
            return (await self.call(self.client.renew_episode, lease.episode_id)).can_continue
        except SwarmError:
            return False

    async def status(self) -> ServerStatus:
        return await self.call(self.client.status)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.client.close()


def _unavailable(wait: Wait, max_wait_s: float) -> ProxyError:
    state = f"engine {wait.state.value}" if wait.state else "swarm server"
    return ProxyError(503, ErrorCode.ENGINE_UNAVAILABLE,
                      f"no lease from the swarm server within {max_wait_s:g}s (--max-wait-s): {state}: {wait.reason}",
                      retry_after_s=float(max(1, math.ceil(wait.pause_s))), state=wait.state)


def _refused(exc: SwarmError) -> ProxyError:
    return ProxyError(502, ErrorCode.INTERNAL_ERROR, f"the swarm server refused the proxy a lease: {exc}",
                      state=exc.state)
