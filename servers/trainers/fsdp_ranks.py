"""The ranks of a sharded trainer as processes of the server: started once, sent commands, watched, stopped.

`RankGroup` spawns one process per rank (`servers.trainers.fsdp_worker.run_rank`, each told its `RankPlace`:
torchrun's RANK, LOCAL_RANK, ... and the server's trainer GPUs as CUDA_VISIBLE_DEVICES) and hosts the group's
rendezvous (a TCPStore on a free port, so no port is guessed). A command goes to every rank over its own pipe and
the call returns the ranks' answers in rank order. A rank that dies, raises, or does not start in time leaves its
peers stuck in a collective, so any failure takes the whole group down and raises `RankFailure` naming the rank and
why; the group then refuses every further call (the server stops the engine, and its next start builds a new one).

Ranks on other machines are Ray actors in the server's placement group instead (`run.ray`:
servers.trainers.ray_ranks.RayRankGroup, the same interface and the same rank loop).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from multiprocessing import connection as pipes
from typing import Any

import torch.distributed as dist

from servers.placement import visible_devices
from servers.trainers.fsdp_worker import RankPlace, RankSpec, run_rank

__all__ = ["RankFailure", "RankGroup"]

log = logging.getLogger(__name__)

#: How long `close` waits for the ranks to leave on their own before it kills them.
_CLOSE_GRACE_S = 10.0
#: A peer's death reaches the others as a collective error ("connection reset") a moment before its process is
#: reaped; a rank's error waits this long for a dead peer, so the report names the cause, not the symptom.
_DEATH_GRACE_S = 2.0


class RankFailure(RuntimeError):
    """A rank died, failed or did not answer in time: the group is gone."""


class RankGroup:
    """`spec.world_size` rank processes on this machine; `trainer_gpus`: their GPUs, rank r on the r-th (None: rank r
    on GPU r, with the server's CUDA_VISIBLE_DEVICES)."""

    def __init__(self, spec: RankSpec, *, start_timeout_s: float = 600.0,
                 trainer_gpus: Sequence[int] | None = None) -> None:  # fmt: skip
        self.world_size = spec.world_size
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._processes: list[mp.process.BaseProcess] = []
        self._conns: list[pipes.Connection] = []
        self._failure: str | None = None
        context = mp.get_context("spawn")  # a fresh interpreter: no forked CUDA or thread state
        visible = None if trainer_gpus is None else visible_devices(trainer_gpus)
        for rank in range(self.world_size):
            place = RankPlace(rank, rank, self.world_size, "127.0.0.1", self._store.port, visible)
            ours, theirs = context.Pipe()
            process = context.Process(target=run_rank, args=(place, spec, theirs), name=f"fsdp-rank-{rank}",
                                      daemon=True)  # fmt: skip
            process.start()
            theirs.close()
            self._processes.append(process)
            self._conns.append(ours)
        self.started = self._collect(timeout_s=start_timeout_s, doing="starting")

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids."""
        return [p.pid for p in self._processes if p.pid is not None]

    def call(self, command: str, *args: Any, per_rank: Sequence[tuple] | None = None,
             on_progress: Callable[[int, int], None] | None = None) -> list[Any]:  # fmt: skip
        """Run `command` on every rank (with `args`, or rank r with `per_rank[r]`); their answers in rank order."""
        if self._failure is not None:
            raise RankFailure(f"the trainer's ranks are gone ({self._failure}); start the engine again")
        for rank, conn in enumerate(self._conns):
            try:
                conn.send((command, per_rank[rank] if per_rank is not None else args))
            except OSError:
                break  # that rank is gone: `_collect` names it
        return self._collect(on_progress=on_progress, doing=command)

    def _collect(self, *, doing: str, timeout_s: float | None = None,
                 on_progress: Callable[[int, int], None] | None = None) -> list[Any]:  # fmt: skip
        """Every rank's answer to the command just sent; RankFailure (after tearing the group down) otherwise."""
        answers: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(answers) < self.world_size:
            pending = {self._conns[r]: r for r in range(self.world_size) if r not in answers}
            sentinels = {p.sentinel: rank for rank, p in enumerate(self._processes)}
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = pipes.wait([*pending, *sentinels], timeout=remaining)
            if not ready:
                raise self._fail(f"no answer from ranks {sorted(pending.values())} after {timeout_s:.0f}s {doing}")
            for conn in (c for c in ready if c in pending):
                try:
                    kind, *payload = conn.recv()
                except (EOFError, OSError):
                    continue  # it died: its sentinel says so below
                if kind == "progress" and on_progress is not None:
                    on_progress(*payload)
                elif kind == "ok":
                    answers[pending[conn]] = payload[0]
                elif kind == "error":
                    raise self._fail(self._error_reason(pending[conn], doing, payload[0]))
            dead = self._dead_rank()
            if dead is not None:
                raise self._fail(self._death_reason(dead, doing))
        return [answers[r] for r in range(self.world_size)]

    def _error_reason(self, rank: int, doing: str, error: str) -> str:
        """Why the group fails after `rank` raised: a peer killed meanwhile if any (the error is its echo)."""
        killed = self._killed_peer(rank, within_s=_DEATH_GRACE_S)
        if killed is not None:
            return f"{self._death_reason(killed, doing)}; rank {rank} then failed: {error.strip().splitlines()[-1]}"
        return f"rank {rank} failed {doing}:\n{error}"

    def _death_reason(self, rank: int, doing: str) -> str:
        return f"rank {rank} died {doing} (exit code {self._processes[rank].exitcode})"

    def _dead_rank(self) -> int | None:
        return next((rank for rank, p in enumerate(self._processes) if not p.is_alive()), None)

    def _killed_peer(self, rank: int, *, within_s: float) -> int | None:
        """A rank other than `rank` whose process ends with a non-zero exit code within `within_s` (a rank that
        reported an error leaves with 0, so only a crash or a kill counts); None if none does."""
        deadline = time.monotonic() + within_s
        running = {p.sentinel: r for r, p in enumerate(self._processes) if r != rank}
        while running:
            for sentinel in pipes.wait(list(running), timeout=max(0.0, deadline - time.monotonic())):
                peer = running.pop(sentinel)
                self._processes[peer].join()
                if self._processes[peer].exitcode:
                    return peer
            if time.monotonic() >= deadline:
                return None
        return None

    def _fail(self, reason: str) -> RankFailure:
        log.error("FSDP trainer: %s; stopping all ranks", reason)
        self._failure = reason.splitlines()[0]
        self._stop(grace_s=0.0)
        return RankFailure(reason)

    def close(self) -> None:
        """Let the ranks leave (or kill them after a grace period). Idempotent."""
        if self._failure is None:
            self._failure = "closed"
            for conn in self._conns:
                try:
                    conn.send(("close", ()))
                except OSError:
                    pass  # already gone
        self._stop(grace_s=_CLOSE_GRACE_S)

    def _stop(self, *, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join(5.0)
        for conn in self._conns:
            conn.close()
