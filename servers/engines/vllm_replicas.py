"""The replicas of one vLLM engine, which one serves each call, and the gate that holds calls during a weight sync.

`vllm.data_parallel_size: N` starts N vLLM processes (replicas): each a vLLM of its own (data parallel size 1) on
`tensor_parallel_size` engine GPUs of its own (`VLLMLaunch.replica`), its own port and log, and its own
`VLLMSupervisor`, which restarts it alone. vLLM's own data parallelism would put N engines behind one API server that
routes without regard to prompts, so a game's next call would mostly land on a replica that never cached its
conversation; here marl routes (`AffinityRouter`): every call of one key (a lease's episode id,
`SamplingParams.affinity`) goes to one replica, the first call of a key to the least loaded one. Every change of what
vLLM serves (weights, adapters, sleep) goes to every replica (`VLLMReplicas.each`, concurrently), under every
replica's lock, so no replica restarts with half of it.

Under Ray (`marl run` with `run.ray`) every replica after the first is a Ray actor in a bundle of its own of the
server's placement group, maybe on another machine (servers.engines.vllm_ray); the supervisor and the router treat
it as any other.

`SyncGate`: while a weight sync has vLLM paused (or asleep), new generations wait in marl, on their event loop,
rather than reach a vLLM that may refuse them (docs/backends.md, "vLLM: requests during a weight sync").
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from servers.engines.vllm_http import VLLMPaused
from servers.engines.vllm_process import VLLMLaunch, VLLMProcess
from servers.engines.vllm_supervisor import VLLMSupervisor

__all__ = ["MAX_KEYS", "AffinityRouter", "Replica", "SyncGate", "VLLMReplicas"]

#: Keys the router remembers (the most recently used): a lease's episode id is about 40 bytes.
MAX_KEYS = 65_536
#: How long a generation that vLLM refused as paused waits before it is sent again.
PAUSED_RETRY_S = 0.1

Chunk = TypeVar("Chunk")


class AffinityRouter:
    """Which of `replicas` serves a call: a key's calls go to its home replica while that one serves; a key's first
    call (or one whose home is down: its key moves) goes to the least loaded serving replica, ties to the one home to
    fewer keys, then in turn. Remembers the `max_keys` most recently used keys."""

    def __init__(self, replicas: int, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._homes: OrderedDict[str, int] = OrderedDict()
        self._homed = [0] * replicas  # keys at home on each replica
        self._turn = 0

    def pick(self, key: str | None, load: Sequence[int], serving: Sequence[bool]) -> int:
        """The replica for one call of `key` (None: no affinity), given each replica's running calls and whether it
        serves; LookupError when none serves."""
        home = self._homes.get(key) if key is not None else None
        if home is not None and serving[home]:
            self._homes.move_to_end(key)
            return home
        candidates = [r for r, up in enumerate(serving) if up]
        if not candidates:
            raise LookupError("no vLLM replica serves")
        best = min((load[r], self._homed[r]) for r in candidates)
        tied = [r for r in candidates if (load[r], self._homed[r]) == best]
        self._turn += 1
        choice = tied[self._turn % len(tied)]
        if key is not None:
            self._move(key, home, choice)
        return choice

    def home_of(self, key: str) -> int | None:
        return self._homes.get(key)

    def _move(self, key: str, old: int | None, new: int) -> None:
        if old is not None:
            self._homed[old] -= 1
        self._homes[key] = new
        self._homes.move_to_end(key)
        self._homed[new] += 1
        while len(self._homes) > self.max_keys:
            _, evicted = self._homes.popitem(last=False)
            self._homed[evicted] -= 1


class SyncGate:
    """Closed while vLLM serves no new generation (a weight sync paused it; it sleeps for a training step). A sync
    closes it from a worker thread; a generation waits at it on its own event loop, which keeps running."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = 0
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    @property
    def waiting(self) -> int:
        """Generations waiting at the gate."""
        return len(self._waiters)

    def close(self) -> None:
        with self._lock:
            self._closed += 1

    def open(self) -> None:
        with self._lock:
            self._closed -= 1
            if self._closed:
                return
            waiters, self._waiters = self._waiters, []
        for loop, waiter in waiters:
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                loop.call_soon_threadsafe(_release, waiter)

    @contextlib.contextmanager
    def closed(self) -> Iterator[None]:
        self.close()
        try:
            yield
        finally:
            self.open()

    async def passed(self) -> None:
        """Return once the gate is open (at once when it is)."""
        with self._lock:
            if not self._closed:
                return
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            self._waiters.append((loop, waiter))
        await waiter


def _release(waiter: asyncio.Future) -> None:
    if not waiter.done():  # a waiter cancelled meanwhile is done
        waiter.set_result(None)


@dataclass(eq=False)
class Replica:
    """One vLLM process of the engine and what marl knows of it."""

    index: int
    supervisor: VLLMSupervisor
    running: int = 0  # generations sent to it and not finished
    asleep: bool = False  # put to sleep for a training step (sleep mode); a weight load wakes it

    @property
    def process(self) -> VLLMProcess:
        return self.supervisor.process


class VLLMReplicas:
    """The replicas of one engine (see the module docstring). `replay(process)` gives a (re)started replica what the
    engine serves; `unrestorable()` says why none may restart; `stats` is the engine's `VLLMStats`."""

    def __init__(self, launch: VLLMLaunch, work_dir: Path, *, replay: Callable[[VLLMProcess], None],
                 unrestorable: Callable[[], str | None], stats: Any, start_timeout_s: float,
                 max_restarts: int) -> None:  # fmt: skip
        self.start_timeout_s, self._stats = start_timeout_s, stats
        self.gate = SyncGate()
        self.router = AffinityRouter(launch.replicas)
        self.replicas: list[Replica] = []
        for index in range(launch.replicas):
            replica = Replica(index, supervisor=None)  # type: ignore[arg-type] - set right below
            replica.supervisor = VLLMSupervisor(
                launch.replica(index), work_dir / (f"vllm-{index}.log" if index else "vllm.log"),
                replay=_replaying(replica, replay), unrestorable=unrestorable, stats=stats,
                start_timeout_s=start_timeout_s, max_restarts=max_restarts, replica=index,
                spawn=_spawner(launch, index))
            self.replicas.append(replica)

    def start(self) -> None:
        """Start every replica at once; return once all serve, else raise the first failure (`close` stops the
        rest)."""
        self._on_each(self.replicas, lambda replica: replica.supervisor.start())

    async def send(self, key: str | None,
                   request: Callable[[str], AsyncIterator[Chunk]]) -> AsyncIterator[Chunk]:  # fmt: skip
        """What `request(url)` yields, sent to the replica of `key` once the gate is open. A request that vLLM
        refuses as paused (before it generated anything) is sent again shortly (`stats.paused_retries`); a vLLM that
        fails under it is a RuntimeError saying whether it died."""
        paused_since: float | None = None
        while True:
            await self.gate.passed()  # a weight sync has vLLM paused: wait here, not in a refusal
            replica = await self.acquire(key)
            process = replica.process
            try:
                async for chunk in request(process.url):
                    yield chunk
                return
            except VLLMPaused:
                paused_since = paused_since or time.monotonic()
                if time.monotonic() - paused_since > self.start_timeout_s:
                    raise RuntimeError(f"vLLM stayed paused for {self.start_timeout_s:.0f} s") from None
                self._stats.paused_retries += 1
            except httpx.HTTPError as exc:
                raise RuntimeError(replica.supervisor.lost(process, exc)) from exc
            finally:
                self.release(replica)
            await asyncio.sleep(PAUSED_RETRY_S)

    async def acquire(self, key: str | None) -> Replica:
        """The replica a call of `key` runs on (counted as running until `release`): waits while none serves (they
        restart); RuntimeError once every one is down."""
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            serving = [replica.supervisor.serving for replica in self.replicas]
            if any(serving):
                replica = self.replicas[self.router.pick(key, [r.running for r in self.replicas], serving)]
                replica.running += 1
                return replica
            if (down := self.down) is not None:
                raise RuntimeError(down)
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not come back within {self.start_timeout_s:.0f} s")
            await asyncio.sleep(0.05)

    @staticmethod
    def release(replica: Replica) -> None:
        replica.running -= 1

    @property
    def running(self) -> int:
        return sum(replica.running for replica in self.replicas)

    @property
    def down(self) -> str | None:
        """Why the engine serves no more: every replica is down (the first one's reason); None while one is not."""
        reasons = [replica.supervisor.down for replica in self.replicas]
        return reasons[0] if all(reasons) else None

    @contextlib.contextmanager
    def changing(self) -> Iterator[list[Replica]]:
        """One change of what vLLM serves at a time, with no restart meanwhile (every replica's lock held): the
        replicas that are not down; RuntimeError when none is left."""
        with contextlib.ExitStack() as locks:
            for replica in self.replicas:
                locks.enter_context(replica.supervisor.lock)
            if (down := self.down) is not None:
                raise RuntimeError(down)
            yield [replica for replica in self.replicas if replica.supervisor.down is None]

    def each(self, replicas: Sequence[Replica], change: Callable[[Replica], None],
             errors: tuple[type[Exception], ...] = ()) -> None:  # fmt: skip
        """`change(replica)` on each of `replicas` at once (a weight reload takes seconds); raises the first failure
        once all finished, httpx errors (and `errors`) told as `VLLMSupervisor.lost` tells them."""
        def run(replica: Replica) -> None:
            process = replica.process
            try:
                change(replica)
            except (httpx.HTTPError, *errors) as exc:
                raise RuntimeError(replica.supervisor.lost(process, exc)) from exc

        self._on_each(replicas, run)

    def lost(self, error: Exception) -> str:
        """What a change that failed with `error` on every replica at once tells: about a replica that died, if one
        did."""
        dead = next((r for r in self.replicas if r.process.exit_code() is not None), self.replicas[0])
        return dead.supervisor.lost(dead.process, error)

    def close(self) -> None:
        """Stop every replica (idempotent)."""
        self._on_each(self.replicas, lambda replica: replica.supervisor.close())

    def _on_each(self, replicas: Sequence[Replica], run: Callable[[Replica], None]) -> None:
        if len(replicas) == 1:
            return run(replicas[0])
        with ThreadPoolExecutor(max_workers=len(replicas), thread_name_prefix="marl-vllm-replicas") as pool:
            done = [pool.submit(run, replica) for replica in replicas]
        for future in done:
            future.result()  # the first failure, once every replica finished
        return None


def _spawner(launch: VLLMLaunch, index: int) -> Callable[[VLLMLaunch, Path], VLLMProcess]:
    """How replica `index` starts: a subprocess of this server, or under Ray (all but the first) a Ray actor in its
    bundle of the server's placement group."""
    if not (launch.replicas_elsewhere and index):
        return VLLMProcess
    from servers.engines.vllm_ray import ray_replica_spawner  # ray is imported only here, only under Ray

    return ray_replica_spawner(launch, index)


def _replaying(replica: Replica, replay: Callable[[VLLMProcess], None]) -> Callable[[VLLMProcess], None]:
    def started(process: VLLMProcess) -> None:
        replica.asleep = False  # a fresh vLLM is awake
        replay(process)

    return started
