"""The ranks of a sharded trainer as Ray actors in the server's placement group (`run.ray`, docs/ray.md).

`marl run` makes one placement group per local server whose trainer has ranks: bundle 0 is the server's own actor,
bundles 1..N one per rank (marl.runner.ray_cluster). The server (`marl serve --ray-group NAME --ray-address GCS`) joins
the cluster and `RayRankGroup` starts one `_RankActor` per rank bundle, each running the very loop a local rank
process runs (`servers.trainers.fsdp_worker.run_rank`) on a thread, its pipe a pair of queues that the server
reaches through actor calls. The rendezvous is the one `RankGroup` uses: a TCPStore hosted by the server, on the
node of bundle 0, which every rank reaches at that node's address (MASTER_ADDR). Where Ray placed the ranks decides
their torchrun variables (`rank_places`): a node's ranks, in rank order, are its local ranks 0..L-1, and see the
GPUs Ray gave all of them (CUDA_VISIBLE_DEVICES in local-rank order, so `cuda:LOCAL_RANK` is the rank's own and
NCCL sees its peers on the node).

Failures are `RankGroup`'s: a rank actor that dies (killed, its node lost) or raises takes the group down with
`RankFailure` naming the rank, its peers stuck in a collective are killed with it, and the server's next engine
start builds a new group in the same bundles (the server resumes from its checkpoint: servers.training.loop).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch.distributed as dist
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from servers.ray_group import NAMESPACE, bundles_of, join, last_line, place
from servers.trainers.fsdp_ranks import RankFailure
from servers.trainers.fsdp_worker import RankPlace, RankSpec, run_rank

__all__ = ["NAMESPACE", "RankWhere", "RayRankGroup", "rank_bundle", "rank_places"]

log = logging.getLogger(__name__)

#: Ray would set each rank's CUDA_VISIBLE_DEVICES to its own GPU; the rank sets its node's ranks' GPUs itself.
_NOSET_CUDA = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
#: How long `close` waits for the ranks to leave on their own before their actors are killed.
_CLOSE_GRACE_S = 10.0


@dataclass(frozen=True)
class RankWhere:
    """Where Ray placed one rank actor: its node and the GPUs Ray gave it (physical indices on that node)."""

    node_id: str
    node_ip: str
    gpu_ids: tuple[int, ...] = ()


def rank_places(wheres: Sequence[RankWhere], master_addr: str, master_port: int) -> list[RankPlace]:
    """Each rank's torchrun variables from where Ray put it: ranks on one node are that node's local ranks in rank
    order, and see the GPUs of all of them in that order (None: no GPU, the CPU with gloo)."""
    by_node: dict[str, list[int]] = {}
    for rank, where in enumerate(wheres):
        by_node.setdefault(where.node_id, []).append(rank)
    places = []
    for rank, where in enumerate(wheres):
        peers = by_node[where.node_id]
        gpus = [gpu for peer in peers for gpu in wheres[peer].gpu_ids]
        places.append(RankPlace(rank, peers.index(rank), len(peers), master_addr, master_port,
                                ",".join(map(str, gpus)) if gpus else None))
    return places


class _QueuePipe:
    """The rank's end of its pipe (what `run_rank` sends on and receives from), inside its actor."""

    def __init__(self) -> None:
        self.inbox: queue.Queue = queue.Queue()  # commands from the server
        self.outbox: queue.Queue = queue.Queue()  # answers and progress to the server

    def send(self, message: Any) -> None:
        self.outbox.put(message)

    def recv(self) -> Any:
        return self.inbox.get()


@ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=4)
class _RankActor:
    """One rank: `run_rank` on a thread, its pipe served through `send` and `recv` (concurrent actor calls)."""

    def __init__(self) -> None:
        self.pipe = _QueuePipe()
        self.thread: threading.Thread | None = None

    def where(self) -> RankWhere:
        gpus = tuple(int(gpu) for gpu in ray.get_gpu_ids())
        return RankWhere(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), gpus)

    def start(self, place: RankPlace, spec: RankSpec) -> None:
        self.thread = threading.Thread(target=self._run, args=(place, spec), name=f"fsdp-rank-{place.rank}",
                                       daemon=True)  # fmt: skip
        self.thread.start()

    def _run(self, place: RankPlace, spec: RankSpec) -> None:
        try:
            run_rank(place, spec, self.pipe)
        finally:  # whatever ended it (close, or an exit no answer reports): a server still waiting hears of it
            self.pipe.send(("error", f"rank {place.rank}'s thread ended"))

    def leave(self, timeout_s: float) -> None:
        """Tell the rank to close and wait for it (it leaves its process group), at most `timeout_s`."""
        self.pipe.inbox.put(("close", ()))
        if self.thread is not None:
            self.thread.join(timeout_s)

    def send(self, message: Any) -> None:
        self.pipe.inbox.put(message)

    def recv(self) -> Any:
        return self.pipe.outbox.get()


def rank_bundle(group: str, address: str | None = None) -> dict[str, float]:
    """Join the Ray cluster at `address` (None: this node's) if not yet, and read what each rank of placement group
    `group` has (bundle 1: the trainer's ranks have alike bundles)."""
    join(address)
    bundles = bundles_of(group)
    if len(bundles) < 2:
        raise ValueError(f"the placement group {group} has no bundle for a trainer rank (the server's alone): its"
                         " topology server needs train.trainer: fsdp when marl run starts it")
    return dict(bundles[1])


class RayRankGroup:
    """`RankGroup`'s interface (`started`, `call`, `close`, `world_size`) over rank actors in bundles 1..N of the
    placement group named `group` (bundle 0 is the server's), each asking for exactly its bundle."""

    def __init__(self, spec: RankSpec, *, group: str, start_timeout_s: float = 600.0) -> None:
        self.world_size = spec.world_size
        self._failure: str | None = None
        bundles = bundles_of(group)  # Ray joined by `rank_bundle`, or by the caller; vLLM replicas' bundles last
        if len(bundles) < 1 + spec.world_size:
            raise ValueError(f"the placement group {group} has {len(bundles) - 1} bundles after the server's, but the"
                             f" trainer has {spec.world_size} ranks (fsdp.ranks): sync the topology's"
                             " train.fsdp.ranks")
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # binds every interface
        # named (group.rankR.<new id>) so that `ray list actors` or a test finds each rank of this group
        incarnation, self._actors = uuid.uuid4().hex[:8], []
        try:  # whatever fails from here, no rank actor is left holding its bundle
            for rank in range(self.world_size):
                name = f"{group}.rank{rank}.{incarnation}"
                self._actors.append(place(_RankActor, group, 1 + rank, name, _NOSET_CUDA).remote())
            self.started = self._start(spec, time.monotonic() + start_timeout_s)
        except BaseException as exc:
            if self._failure is None:
                raise self._fail(f"the ranks did not start: {exc!r}") from exc
            raise

    def _start(self, spec: RankSpec, deadline: float) -> list[Any]:
        self.wheres = self._get([actor.where.remote() for actor in self._actors], deadline, "being placed")
        if spec.device_type == "cuda" and any(len(where.gpu_ids) != 1 for where in self.wheres):
            raise self._fail(f"each rank needs one GPU of its own bundle; Ray gave them"
                             f" {[list(w.gpu_ids) for w in self.wheres]} (rank_resources: {{GPU: 1}})")
        places = rank_places(self.wheres, ray.util.get_node_ip_address(), self._store.port)
        log.info("FSDP ranks placed by Ray: %s", ", ".join(f"rank {p.rank} on {w.node_ip} (local rank"
                                                           f" {p.local_rank})" for p, w in zip(places, self.wheres)))
        self._get([actor.start.remote(place, spec) for actor, place in zip(self._actors, places)], deadline,
                  "starting")  # fmt: skip
        return self._collect(timeout_s=max(0.0, deadline - time.monotonic()), doing="starting")

    def _get(self, refs: list, deadline: float, doing: str) -> list:
        try:
            return ray.get(refs, timeout=max(0.0, deadline - time.monotonic()))
        except GetTimeoutError:
            raise self._fail(f"the rank actors were not ready in time {doing} (are the bundles' resources"
                             " free? `ray status`)") from None
        except RayError as exc:
            raise self._fail(f"a rank actor failed {doing}: {last_line(exc)}") from None

    def call(self, command: str, *args: Any, per_rank: Sequence[tuple] | None = None,
             on_progress: Callable[[int, int], None] | None = None) -> list[Any]:  # fmt: skip
        """Run `command` on every rank (with `args`, or rank r with `per_rank[r]`); their answers in rank order."""
        if self._failure is not None:
            raise RankFailure(f"the trainer's ranks are gone ({self._failure}); start the engine again")
        for rank, actor in enumerate(self._actors):
            actor.send.remote((command, per_rank[rank] if per_rank is not None else args))
        return self._collect(on_progress=on_progress, doing=command)

    def _collect(self, *, doing: str, timeout_s: float | None = None,
                 on_progress: Callable[[int, int], None] | None = None) -> list[Any]:  # fmt: skip
        """Every rank's answer to the command just sent; RankFailure (after tearing the group down) otherwise."""
        answers: dict[int, Any] = {}
        waiting = {actor.recv.remote(): rank for rank, actor in enumerate(self._actors)}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while waiting:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _ = ray.wait(list(waiting), num_returns=1, timeout=remaining)
                if not ready:
                    raise self._fail(f"no answer from ranks {sorted(waiting.values())} after {timeout_s:.0f}s {doing}")
                rank = waiting.pop(ready[0])
                kind, *payload = self._answer(ready[0], rank, doing)
                if kind == "progress":
                    if on_progress is not None:
                        on_progress(*payload)
                    waiting[self._actors[rank].recv.remote()] = rank
                elif kind == "ok":
                    answers[rank] = payload[0]
                elif kind == "error":
                    raise self._fail(f"rank {rank} failed {doing}:\n{payload[0]}")
        except BaseException as exc:  # a recv left waiting would take the next command's answer: the group goes
            if self._failure is None:
                raise self._fail(f"the server stopped waiting for the ranks {doing}: {exc!r}") from exc
            raise
        return [answers[r] for r in range(self.world_size)]

    def _answer(self, ref: Any, rank: int, doing: str) -> tuple:
        try:
            return ray.get(ref)
        except RayActorError as exc:
            raise self._fail(f"rank {rank} died {doing} (its Ray actor: {last_line(exc)})") from None
        except RayError as exc:
            raise self._fail(f"rank {rank}'s answer {doing} could not be read: {last_line(exc)}") from None

    def _fail(self, reason: str) -> RankFailure:
        log.error("FSDP trainer: %s; stopping all ranks", reason)
        self._failure = reason.splitlines()[0]
        self._kill()
        return RankFailure(reason)

    def close(self) -> None:
        """Let the ranks leave (they destroy their process group), then end their actors. Idempotent."""
        if self._failure is None:
            self._failure = "closed"
            leaving = [actor.leave.remote(_CLOSE_GRACE_S) for actor in self._actors]
            try:
                ray.get(leaving, timeout=_CLOSE_GRACE_S + 5.0)
            except RayError as exc:
                log.info("a rank did not leave its group cleanly: %s", last_line(exc))
        self._kill()

    def _kill(self) -> None:
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
