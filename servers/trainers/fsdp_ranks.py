"""The ranks of a sharded trainer as processes of the server: started once, sent commands, watched, stopped.

`RankGroup` spawns one process per rank of this node (`servers.trainers.fsdp_worker.run_rank`, each told its
`RankPlace`: torchrun's RANK, LOCAL_RANK, ... and the node's trainer GPUs as CUDA_VISIBLE_DEVICES) and hosts the
group's rendezvous (a TCPStore on a free port, so no port is guessed). The ranks of other nodes (`RankLayout.nodes`
> 1) join through `servers.trainers.fsdp_nodes`, and their network connection serves as their pipe. A command goes
to every rank over its own pipe and
the call returns the ranks' answers in rank order. A rank that dies, raises, or does not start in time leaves its
peers stuck in a collective, so any failure takes the whole group down and raises `RankFailure` naming the rank and
why; the group then refuses every further call (the server stops the engine, and its next start builds a new one).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist

from marl.protocol import TRAINER_RENDEZVOUS_PORT
from servers.placement import visible_devices
from servers.trainers.fsdp_nodes import NodeJob, NodeRendezvous
from servers.trainers.fsdp_worker import RankPlace, RankSpec, run_rank

__all__ = ["RankFailure", "RankGroup", "RankLayout"]

log = logging.getLogger(__name__)

#: How long `close` waits for the ranks to leave on their own before it kills them.
_CLOSE_GRACE_S = 10.0


class RankFailure(RuntimeError):
    """A rank died, failed or did not answer in time: the group is gone."""


@dataclass(frozen=True)
class RankLayout:
    """How a group's ranks are laid out: `local_world_size` ranks on this node (ranks 0..L-1), the rest on the
    other nodes (`nodes` of them, L ranks each, let in on `rendezvous_port` with `authkey`, the admin token);
    `trainer_gpus`: each node's GPUs for its ranks (None: local rank r on GPU r, with the parent's
    CUDA_VISIBLE_DEVICES)."""

    local_world_size: int
    nodes: int = 1
    trainer_gpus: tuple[int, ...] | None = None
    rendezvous_port: int = TRAINER_RENDEZVOUS_PORT
    authkey: bytes | None = None


class RankGroup:
    def __init__(self, spec: RankSpec, *, start_timeout_s: float = 600.0, layout: RankLayout | None = None) -> None:
        layout = layout or RankLayout(local_world_size=spec.world_size)
        if layout.local_world_size * layout.nodes != spec.world_size:
            raise ValueError(f"{spec.world_size} ranks cannot run as {layout.nodes} nodes x {layout.local_world_size}")
        if layout.nodes > 1 and not layout.authkey:
            raise ValueError("a trainer on several nodes needs the server's admin token to let them in")
        self.world_size = spec.world_size
        # The rendezvous: the store binds every interface, so other nodes' ranks reach it at this host's address.
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._processes: list[mp.process.BaseProcess | None] = []  # None: a rank on another node
        self._conns: list[Connection] = []
        self._failure: str | None = None
        deadline = time.monotonic() + start_timeout_s
        # open before the local ranks start, so a port in use fails at once; closed once every rank has joined
        door = NodeRendezvous(layout.rendezvous_port, layout.authkey) if layout.nodes > 1 else None
        try:
            self._start_local(spec, layout)
            if door is not None:
                self._join_remote(spec, layout, door, deadline)
        finally:
            if door is not None:
                door.close()
        self.started = self._collect(timeout_s=max(0.0, deadline - time.monotonic()), doing="starting")

    def _start_local(self, spec: RankSpec, layout: RankLayout) -> None:
        context = mp.get_context("spawn")  # a fresh interpreter: no forked CUDA or thread state
        visible = None if layout.trainer_gpus is None else visible_devices(layout.trainer_gpus)
        for rank in range(layout.local_world_size):
            place = RankPlace(rank, rank, layout.local_world_size, "127.0.0.1", self._store.port, visible)
            ours, theirs = context.Pipe()
            process = context.Process(target=run_rank, args=(place, spec, theirs), name=f"fsdp-rank-{rank}",
                                      daemon=True)  # fmt: skip
            process.start()
            theirs.close()
            self._processes.append(process)
            self._conns.append(ours)

    def _join_remote(self, spec: RankSpec, layout: RankLayout, door: NodeRendezvous, deadline: float) -> None:
        """Wait for the other nodes' ranks (servers.trainers.fsdp_nodes); their connections are their pipes."""
        job = NodeJob(spec, 0, layout.local_world_size, self._store.port, layout.trainer_gpus)
        try:
            remote = door.gather(job, layout.nodes, deadline)
        except TimeoutError as exc:
            raise self._fail(str(exc)) from None
        for rank in range(layout.local_world_size, spec.world_size):
            self._processes.append(None)
            self._conns.append(remote[rank])

    @property
    def pids(self) -> list[int]:
        """This node's ranks' process ids."""
        return [p.pid for p in self._processes if p is not None and p.pid is not None]

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
            sentinels = {p.sentinel: rank for rank, p in enumerate(self._processes) if p is not None}
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([*pending, *sentinels], timeout=remaining)
            if not ready:
                raise self._fail(f"no answer from ranks {sorted(pending.values())} after {timeout_s:.0f}s {doing}")
            for conn in (c for c in ready if c in pending):
                try:
                    kind, *payload = conn.recv()
                except (EOFError, OSError):
                    if self._processes[pending[conn]] is None:  # a rank of another node: its connection is all
                        raise self._fail(f"rank {pending[conn]} (on another node) disconnected {doing}") from None
                    continue  # it died: its sentinel says so below
                if kind == "progress" and on_progress is not None:
                    on_progress(*payload)
                elif kind == "ok":
                    answers[pending[conn]] = payload[0]
                elif kind == "error":
                    raise self._fail(f"rank {pending[conn]} failed {doing}:\n{payload[0]}")
            for rank, process in enumerate(self._processes):
                if process is not None and not process.is_alive():
                    raise self._fail(f"rank {rank} died {doing} (exit code {process.exitcode})")
        return [answers[r] for r in range(self.world_size)]

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
        local = [process for process in self._processes if process is not None]  # other nodes' ranks leave at EOF
        for process in local:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in local:
            if process.is_alive():
                process.kill()
                process.join(5.0)
        for conn in self._conns:
            conn.close()
