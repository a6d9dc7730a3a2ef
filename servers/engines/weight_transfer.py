"""Weight sync through vLLM's weight-transfer engine: the trainer's side, written without vLLM.

vLLM (0.32 CPU / 0.33 CUDA) started with `--weight-transfer-config '{"backend": "ipc"|"nccl"}'` (CUDA only) takes new
weights over its RL routes (`vllm/entrypoints/rl/online/api_router.py`, mounted with `VLLM_SERVER_DEV_MODE=1`):
`/init_weight_transfer_engine` once per vLLM process, then per sync `/start_weight_update`, one `/update_weights` per
bucket of tensors (names, dtype names, shapes: the parameters' metadata) and `/finish_weight_update`. Its worker-side
engines are `vllm/distributed/weight_transfer/ipc_engine.py` and `nccl_engine.py`; their trainer-side halves import
vLLM, which marl's base environment cannot (its pins conflict: docs/backends.md). What they need from a trainer is
small, so it is rewritten here with torch alone, wire-compatible. vLLM may run as several data-parallel replicas
(one process each, `Replica`); one `TransferTarget` describes them all, and `replica_posts` says which trainer rank
sends which replica its bodies:

- **ipc** (every vLLM worker on a trainer GPU: colocated, any tensor x data parallel size): each rank on a worker's
  GPU shares *its own* gathered copy of each tensor (`torch.multiprocessing.reductions.reduce_tensor`); the
  handles are exchanged between ranks (small metadata), and the rank on a replica's first worker GPU posts the
  update: `ipc_handles_pickled`, base64 of the pickled list of `{gpu uuid: rebuild_cuda_tensor args}` holding every
  worker GPU's handle (as vLLM's `HTTPVLLMWeightSyncClient` sends it; vLLM unpickles it only with
  VLLM_ALLOW_INSECURE_SERIALIZATION=1), and each worker rebuilds its GPU's tensors in place, zero-copy. The buckets
  are allocated with expandable segments off (`ordinary_allocations`).
- **nccl** (vLLM on GPUs of its own): every replica's workers join one NCCL group from a unique id minted by the
  trainer (`nccl_unique_id_b64`, the rendezvous vLLM offers to trainers that cannot import it: `nccl_common.py`),
  replica r at ranks `rank_offset(r)`..; the trainer is rank 0 through torch's own NCCL bindings
  (`torch.cuda.nccl`), answers the one-element float32 all-reduce vLLM's communicator runs after `ncclCommInitRank`
  (`PyNcclCommunicator._init_comm`), then broadcasts each tensor of a bucket while every replica's
  `/update_weights` runs (the workers allocate each from the metadata and receive it, in order). Unpacked
  (`packed: false`): vLLM's packed wire format is not reimplemented. vLLM must load the trainer's NCCL library
  (`VLLM_NCCL_SO_PATH`: servers.engines.vllm_process).

Buckets hold whole decoder layers (`layer_buckets`): vLLM's layerwise reload keeps the tensors it received until
every weight of their layer arrived, so a bucket's tensors (for ipc, views of the trainer's memory) may be dropped
once its update answered. Gathered tensors are cast to vLLM's dtype as they come; the trainer never holds more than
a bucket (and a layer) of full tensors.

None of this has run on a GPU (no GPU was available to the project): the CPU tests check the routes and their bodies,
`replica_posts` for several layouts, the buckets against the model's state dict, two gloo FSDP ranks posting
stand-in handles to two recording replicas, the broadcast over gloo into one and two receiving processes, the
allocator switch (recorded, not run), and the fallback.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import httpx
import torch

__all__ = ["TRANSFER_BACKENDS", "Replica", "ReplicaPost", "TransferRoutes", "TransferTarget", "WeightPusher",
           "WeightTransferError", "allocator_conf", "attempt", "conf_options", "first_failure", "layer_buckets",
           "ordinary_allocations", "release_shared", "replica_posts", "unique_tensors", "update_metadata",
           "with_expandable_segments"]

log = logging.getLogger(__name__)

#: The weight-transfer backends marl drives (vLLM has more: sparse_nccl, sharded_rdt, nccl_m2n).
TRANSFER_BACKENDS = ("ipc", "nccl")
#: Bytes of full tensors per `/update_weights` (a decoder layer larger than this travels alone).
DEFAULT_BUCKET_BYTES = 512 * 2**20

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightTransferError(RuntimeError):
    """The transfer failed; the weights go through the disk instead."""


@dataclass(frozen=True)
class Replica:
    """One vLLM process the weights go to: its server, its session (a restarted vLLM is a new one and needs the init
    again) and its GPUs as `marl serve` numbers them, one per worker in worker order (tensor-parallel rank)."""

    url: str  # 127.0.0.1: every rank that posts runs on the server's machine
    session: str
    gpus: tuple[int, ...] = (0,)

    @property
    def workers(self) -> int:
        return len(self.gpus)


@dataclass(frozen=True)
class TransferTarget:
    """Where and how to push weights: plain data, handed to the trainer (every FSDP rank gets it).

    `replicas` are vLLM's data-parallel replicas, in replica order. `trainer_gpus` are the trainer's GPUs on the
    server's machine (node 0), numbered as the replicas' `gpus`: rank i of the trainer runs on `trainer_gpus[i]`
    (the one-process trainer is rank 0), which is how an ipc push finds the rank on each worker's GPU."""

    backend: str  # "ipc" or "nccl"
    replicas: tuple[Replica, ...]
    trainer_gpus: tuple[int, ...] = (0,)
    dtype: str | None = "bfloat16"  # what the weights travel as (vLLM's dtype); None: as the trainer holds them
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 600.0
    version: str | None = None  # vLLM's weight version after the sync (`/finish_weight_update`)
    channel: str = "nccl"  # nccl; "gloo" runs the same broadcast over gloo for the CPU tests (vLLM only speaks NCCL)

    def __post_init__(self) -> None:
        object.__setattr__(self, "replicas", tuple(self.replicas))
        object.__setattr__(self, "trainer_gpus", tuple(self.trainer_gpus))

    def travel_dtype(self) -> torch.dtype | None:
        return None if self.dtype in (None, "auto") else getattr(torch, {"float": "float32", "half": "float16"}.get(
            self.dtype, self.dtype))

    @property
    def world_size(self) -> int:
        """The nccl group: the trainer's rank 0, then every replica's workers (replica r from `rank_offset(r)`)."""
        return 1 + sum(replica.workers for replica in self.replicas)

    def rank_offset(self, replica: int) -> int:
        """Where replica `replica`'s workers start in the nccl group: vLLM's worker joins at rank_offset + its rank
        in its own process (`vllm/distributed/weight_transfer/nccl_common.py`, `worker_init_process_group`)."""
        return 1 + sum(r.workers for r in self.replicas[:replica])


@dataclass(frozen=True)
class ReplicaPost:
    """Who sends one replica its `/update_weights` bodies: `poster` (a trainer rank) posts to `url`; for ipc the
    body holds, per tensor, the handles of `ranks` (one per worker, in worker order), each its own GPU's copy."""

    replica: int
    url: str
    poster: int
    ranks: tuple[int, ...] = ()


def replica_posts(target: TransferTarget, world_size: int) -> tuple[ReplicaPost, ...]:
    """Which rank posts which body to which replica (pure: every rank computes the same).

    nccl: rank 0 posts to every replica and broadcasts each tensor to all of their workers at once. ipc: each
    worker's GPU must be a trainer GPU of the server's machine (vLLM colocated with the trainer); the rank on that
    GPU shares its own gathered copy, and the rank on the replica's first worker GPU posts. WeightTransferError when
    a worker's GPU has no trainer rank (the same on every rank)."""
    if target.backend == "nccl":
        return tuple(ReplicaPost(i, r.url, 0) for i, r in enumerate(target.replicas))
    rank_of = {gpu: rank for rank, gpu in enumerate(target.trainer_gpus) if rank < world_size}
    posts = []
    for index, replica in enumerate(target.replicas):
        if missing := [gpu for gpu in replica.gpus if gpu not in rank_of]:
            raise WeightTransferError(
                f"ipc: replica {index}'s GPUs {list(missing)} host no trainer rank (trainer GPUs"
                f" {list(target.trainer_gpus)}, {world_size} ranks): each vLLM worker needs a rank on its GPU")
        ranks = tuple(rank_of[gpu] for gpu in replica.gpus)
        posts.append(ReplicaPost(index, replica.url, ranks[0], ranks))
    return tuple(posts)


class TransferRoutes:
    """vLLM's weight-transfer routes with the bodies vLLM's own HTTP client sends
    (`vllm/distributed/weight_transfer/clients.py`, `HTTPVLLMWeightSyncClient`)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self._http = httpx.Client(base_url=url, timeout=httpx.Timeout(timeout_s, connect=10.0))

    def init(self, init_info: dict[str, Any]) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start(self) -> None:
        self._post("/start_weight_update")

    def update(self, update_info: dict[str, Any]) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish(self, version: str | None) -> None:
        self._post("/finish_weight_update", None if version is None else {"weight_version": version})

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, body: dict[str, Any] | None = None) -> None:
        try:
            response = self._http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise WeightTransferError(f"vLLM {path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise WeightTransferError(f"vLLM {path} answered {response.status_code}: {response.text[:500]}")


def layer_key(name: str) -> str:
    """The decoder layer a parameter belongs to: its name up to the first integer segment (`model.layers.3`), as
    vLLM's `layerwise_groups` (weight_transfer/base.py) groups them; a name without one is its own group."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def layer_buckets(named: NamedTensors, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`named` in order, cut at the first layer boundary once a bucket holds `bucket_bytes`: whole layers only, each
    bucket under `bucket_bytes` plus one layer. Lazy: the tensors are gathered as the buckets fill (a layer's size is
    known only once it has been gathered)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        if bucket and size >= bucket_bytes and layer_key(name) != layer_key(bucket[-1][0]):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    if bucket:
        yield bucket


def update_metadata(bucket: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The part of an `/update_weights` body both backends share: names, dtype names (`bfloat16`), shapes."""
    return {"names": [name for name, _ in bucket],
            "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in bucket],
            "shapes": [list(tensor.shape) for _, tensor in bucket]}


def unique_tensors(named: NamedTensors) -> NamedTensors:
    """Each tensor once: a tied head is the embedding's storage under a second name, which vLLM ties itself (as the
    exported safetensors hold it once)."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, tensor in named:
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            yield name, tensor


def travelling(named: NamedTensors, dtype: torch.dtype | None) -> NamedTensors:
    """Each tensor detached, contiguous and, if floating point, in `dtype` (the engine's), as it comes."""
    for name, tensor in named:
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield name, tensor.contiguous()


class Channel(Protocol):
    """The trainer's end (rank 0) of the group vLLM's workers join for the nccl backend."""

    def rendezvous(self) -> dict[str, Any]:
        """The init_info fields that tell vLLM's workers how to join."""

    def connect(self, world_size: int) -> None:
        """Join the group (blocks until every worker has)."""

    def broadcast(self, tensor: torch.Tensor) -> None: ...

    def wait(self, check: Callable[[], None]) -> None:
        """Until the broadcasts sent are done, calling `check` (which raises when the receivers gave up) meanwhile."""


class NcclChannel:
    """Rank 0 of vLLM's NCCL group through `torch.cuda.nccl` (a communicator from `ncclCommInitRank`, no process
    group). NCCL refuses peers of another NCCL version ("Mismatched NCCL version"): vLLM's PyNccl loads the library
    `VLLM_NCCL_SO_PATH` names, which can be the one the trainer's torch uses.

    The broadcasts run on a stream of their own: if the receivers give up, the broadcast that waits for them blocks
    that stream only, not the one the trainer computes on."""

    def __init__(self, device: torch.device | None = None) -> None:
        import torch.cuda.nccl as nccl

        self._nccl = nccl
        self._uid = nccl.unique_id()
        self._device = torch.device("cuda", torch.cuda.current_device() if device is None or device.index is None
                                    else device.index)
        self._stream = torch.cuda.Stream(device=self._device)
        self._comm: Any = None

    def rendezvous(self) -> dict[str, Any]:
        return {"nccl_unique_id_b64": base64.b64encode(self._uid).decode()}  # standard base64, as vLLM checks

    def connect(self, world_size: int) -> None:
        with torch.cuda.device(self._device):
            self._comm = self._nccl.init_rank(world_size, self._uid, 0)
            warmup = torch.zeros(1, device=self._device)  # vLLM's communicator opens with this all-reduce
            self._nccl.all_reduce([warmup], comms=[self._comm])
            torch.cuda.current_stream().synchronize()

    def broadcast(self, tensor: torch.Tensor) -> None:
        self._stream.wait_stream(torch.cuda.current_stream(self._device))  # the gather that made `tensor` first
        self._nccl.broadcast([tensor], root=0, streams=[self._stream], comms=[self._comm])

    def wait(self, check: Callable[[], None]) -> None:
        done = torch.cuda.Event()
        done.record(self._stream)
        while not done.query():
            check()
            time.sleep(0.001)


class GlooChannel:
    """The same broadcast over gloo and a TCPStore (vLLM's other rendezvous: master_address/master_port), for the
    CPU tests' receiving process; vLLM's own workers only speak NCCL."""

    def __init__(self, timeout_s: float = 120.0) -> None:
        self._timeout = timedelta(seconds=timeout_s)
        self._store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                                 timeout=self._timeout)
        self._group: Any = None

    def rendezvous(self) -> dict[str, Any]:
        return {"master_address": "127.0.0.1", "master_port": self._store.port}

    def connect(self, world_size: int) -> None:
        self._group = torch.distributed.ProcessGroupGloo(self._store, 0, world_size, self._timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self._group.broadcast(tensor, 0).wait()

    def wait(self, check: Callable[[], None]) -> None:
        check()  # each broadcast waited for itself


def share_cuda_tensor(tensor: torch.Tensor) -> dict[str, tuple]:
    """An IPC handle vLLM's ipc engine rebuilds: `{gpu uuid: rebuild_cuda_tensor's args}` (it looks its own GPU up
    and puts its device index at args[6])."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    return {str(torch.cuda.get_device_properties(tensor.device).uuid): args}


def set_allocator_settings(settings: str) -> None:
    """The CUDA caching allocator's settings, changed at run time (`PYTORCH_CUDA_ALLOC_CONF`'s syntax). It replaces
    the whole configuration (vLLM says the same, `vllm/device_allocator/alloc_conf.py`): pass every option. torch
    2.13's `torch.cuda.memory._set_allocator_settings` is a deprecated wrapper of this call."""
    torch._C._accelerator_setAllocatorSettings(settings)


def allocator_conf() -> str:
    """The allocator configuration this process started with: `PYTORCH_CUDA_ALLOC_CONF`, then the newer
    `PYTORCH_ALLOC_CONF` (torch reads both; the later wins an option both name)."""
    return ",".join(conf for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
                    if (conf := os.environ.get(name, "").strip()))


def conf_options(conf: str) -> list[tuple[str, str]]:
    """`key:value` options in order, split at the commas outside brackets (`roundup_power2_divisions:[256:1,512:2]`
    is one option); a key named twice keeps its last value, where it first appeared."""
    options: dict[str, str] = {}
    depth, start = 0, 0
    for i, char in enumerate(conf + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            if part := conf[start:i].strip():
                key, _, value = part.partition(":")
                options[key.strip()] = value.strip()
            start = i + 1
    return list(options.items())


def with_expandable_segments(conf: str, on: bool) -> str:
    """`conf` with `expandable_segments` set to `on` and every other option as it was."""
    options = dict(conf_options(conf))
    options["expandable_segments"] = "True" if on else "False"
    return ",".join(f"{key}:{value}" for key, value in options.items())


def _expandable_segments(conf: str) -> bool:
    return dict(conf_options(conf)).get("expandable_segments", "").lower() == "true"


@contextlib.contextmanager
def ordinary_allocations() -> Iterator[None]:
    """Expandable segments off while the buckets shared over CUDA IPC are allocated, back on after, every other
    allocator option kept (the call replaces the whole configuration); a no-op without CUDA or when they are off
    already. FSDP ranks run with them on (servers.trainers.fsdp_worker, RANK_ALLOCATOR), and a tensor in an
    expandable segment crosses CUDA IPC through PyTorch's expandable-segment sharing path, which vLLM's torch would
    have to rebuild: buckets in ordinary (cudaMalloc) segments take the plain cudaIpc path. The cache is emptied
    first, so that no bucket reuses a free block of an expandable segment, and after, so that the buckets' segments
    are not kept."""
    conf = allocator_conf()
    if not torch.cuda.is_available() or not _expandable_segments(conf):
        yield
        return
    torch.cuda.empty_cache()
    set_allocator_settings(with_expandable_segments(conf, False))
    try:
        yield
    finally:
        torch.cuda.empty_cache()
        set_allocator_settings(with_expandable_segments(conf, True))


def release_shared() -> None:
    """After the last bucket's update answered: the blocks vLLM's workers held through IPC handles go back to this
    process's cache (`ipc_collect`) and to the driver (`empty_cache`), before vLLM's KV cache wakes into that memory.
    (Between buckets `ipc_collect` alone runs: the next bucket reuses the blocks.)"""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


#: Every rank's value, in rank order: a collective under FSDP (`dist.all_gather_object`), [value] in one process.
Exchange = Callable[[Any], list[Any]]


def _alone(value: Any) -> list[Any]:
    return [value]


def first_failure(failures: Iterable[str | None]) -> str | None:
    """The first rank's failure: what every rank reports when any failed."""
    return next((failure for failure in failures if failure is not None), None)


def attempt(call: Callable[..., Any], *args: Any) -> str | None:
    """`call(*args)`'s failure as a string (`Type: message`), or None: a failure that crosses ranks as data."""
    try:
        call(*args)
    except Exception as exc:  # noqa: BLE001 - reported, and the push falls back to the disk
        return f"{type(exc).__name__}: {exc}"
    return None


def merged_handles(shared: list[list[dict[str, tuple]] | None], ranks: tuple[int, ...]) -> list[dict[str, tuple]]:
    """One replica's handles, per tensor: the union of `ranks`' `{gpu uuid: args}` (each its own GPU's copy), so
    that each of the replica's workers finds its GPU's."""
    return [{uuid: args for rank in ranks for uuid, args in shared[rank][i].items()}
            for i in range(len(shared[ranks[0]]))]  # fmt: skip


class WeightPusher:
    """Pushes a trainer's weights into vLLM's replicas (see the module docstring); lives as long as the trainer, one
    per process that gathers the full tensors (the one-process trainer, every FSDP rank).

    `device`: the trainer's GPU (nccl). `share` turns a tensor into an IPC handle (default: `share_cuda_tensor`);
    the CPU tests pass their own.
    """

    def __init__(self, device: torch.device | str | None = None,
                 share: Callable[[torch.Tensor], dict[str, tuple]] | None = None) -> None:
        self._device = None if device is None else torch.device(device)
        self._share = share or share_cuda_tensor
        self._opened: dict[str, tuple[Any, ...]] = {}  # replica url -> the vLLM process (and backend) of its init
        self._routes: dict[str, TransferRoutes] = {}  # by replica url
        self._channel: Channel | None = None

    def push(self, target: TransferTarget, named: NamedTensors) -> None:
        """The one-process trainer's whole sync (rank 0 of 1): `begin`, then `send_ipc` or `send_nccl`."""
        posts = replica_posts(target, 1)
        self.begin(target, posts)
        if target.backend == "ipc":
            self.send_ipc(target, posts, named)
        else:
            self.send_nccl(target, posts, named)

    def begin(self, target: TransferTarget, mine: Sequence[ReplicaPost]) -> None:
        """The init (once per vLLM process; nccl: one group for every replica) and `/start_weight_update` of the
        replicas this process posts to: what can fail before anything is gathered."""
        if target.backend not in TRANSFER_BACKENDS:
            raise WeightTransferError(f"unknown weight-transfer backend {target.backend!r}")
        stale = [post for post in mine if self._opened.get(post.url) != _session(target, post.replica)]
        if stale and target.backend == "nccl":
            self._open_group(target, mine)  # one group: a restarted replica means a new one for all
        elif stale:
            for post in stale:
                self._open(target, post.url).init({"packed": False})
                self._opened[post.url] = _session(target, post.replica)
        for post in mine:
            self._routes[post.url].start()

    def send_ipc(self, target: TransferTarget, posts: Sequence[ReplicaPost], named: NamedTensors,
                 exchange: Exchange = _alone, rank: int = 0) -> None:
        """Every tensor of `named`, bucket by bucket, each replica's body posted by its poster with the handles of
        the ranks on its workers' GPUs, then `/finish_weight_update`. Under FSDP every rank calls it (`exchange` is
        its collective): each bucket's handles are exchanged, posted, and the posts' outcomes exchanged, so the
        buckets live until every replica answered, and a failure stops the sharing on every rank at the same bucket
        while the iteration (the gathers) goes on. WeightTransferError, the same on every rank, when any failed."""
        sharing = rank in {r for post in posts for r in post.ranks}
        mine = [post for post in posts if post.poster == rank]
        failure: str | None = None
        with ordinary_allocations():
            for bucket in layer_buckets(travelling(named, target.travel_dtype()), target.bucket_bytes):
                if failure is None:
                    failure = self._ipc_bucket(bucket, posts, mine, exchange, sharing)
                del bucket  # every replica answered: vLLM has every layer of it
        if failure is None:
            failure = first_failure(exchange(attempt(self._finish, target, mine)))
        release_shared()  # vLLM has every layer: what it held of the last bucket is freed (failed or not)
        if failure is not None:
            raise WeightTransferError(failure)

    def send_nccl(self, target: TransferTarget, mine: Sequence[ReplicaPost], named: NamedTensors) -> None:
        """Rank 0: every tensor broadcast to all replicas' workers at once, each bucket's `/update_weights` posted to
        every replica meanwhile, then `/finish_weight_update`."""
        for bucket in layer_buckets(travelling(named, target.travel_dtype()), target.bucket_bytes):
            self._nccl_bucket(bucket, mine)
            del bucket
        self._finish(target, mine)

    def _ipc_bucket(self, bucket: list[tuple[str, torch.Tensor]], posts: Sequence[ReplicaPost],
                    mine: list[ReplicaPost], exchange: Exchange, sharing: bool) -> str | None:
        handles: list[dict[str, tuple]] | None = None
        failure = None
        if sharing:
            try:
                handles = [self._share(tensor) for _, tensor in bucket]
            except Exception as exc:  # noqa: BLE001 - exchanged below: every rank stops sharing
                failure = f"{type(exc).__name__}: {exc}"
        shared = exchange((handles, failure))
        if failure := first_failure(failed for _, failed in shared):
            return failure
        handles_of = [rank_handles for rank_handles, _ in shared]
        metadata = update_metadata(bucket)

        def post() -> None:
            for each in mine:
                pickled = base64.b64encode(pickle.dumps(merged_handles(handles_of, each.ranks))).decode()
                self._routes[each.url].update({**metadata, "ipc_handles_pickled": pickled})

        failure = first_failure(exchange(attempt(post)))  # also the barrier: the bucket lives until all answered
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # the handles of earlier buckets vLLM has let go of
        return failure

    def _nccl_bucket(self, bucket: list[tuple[str, torch.Tensor]], mine: Sequence[ReplicaPost]) -> None:
        """Every replica's `/update_weights` (its workers receive) runs while this rank broadcasts: all meet in each
        broadcast."""
        pool = ThreadPoolExecutor(max_workers=max(1, len(mine)), thread_name_prefix="marl-weight-update")
        try:
            metadata = update_metadata(bucket)
            answers = [pool.submit(self._routes[post.url].update, metadata) for post in mine]

            def check() -> None:  # a replica refused (before receiving): stop instead of broadcasting to nobody
                for answered in answers:
                    if answered.done():
                        answered.result()

            for _, tensor in bucket:
                check()
                self._channel.broadcast(tensor)
            self._channel.wait(check)
            for answered in answers:
                answered.result()
        finally:
            pool.shutdown(wait=False)  # after a failed broadcast an update may never answer: do not wait for it

    def _finish(self, target: TransferTarget, mine: Sequence[ReplicaPost]) -> None:
        for post in mine:
            self._routes[post.url].finish(target.version)

    def _open(self, target: TransferTarget, url: str) -> TransferRoutes:
        self._opened.pop(url, None)  # until its init succeeds
        if (old := self._routes.pop(url, None)) is not None:
            old.close()
        self._routes[url] = TransferRoutes(url, target.timeout_s)
        return self._routes[url]

    def _open_group(self, target: TransferTarget, mine: Sequence[ReplicaPost]) -> None:
        """Open one NCCL group with every replica's workers: each replica's init (its workers join inside it) runs
        concurrently with this rank's join; NCCL forms the group only once all world_size ranks are in."""
        channel: Channel = GlooChannel(target.timeout_s) if target.channel == "gloo" else NcclChannel(self._device)
        routes = {post.replica: self._open(target, post.url) for post in mine}
        failed: list[BaseException] = []
        joined = threading.Thread(target=_connect, args=(channel, target.world_size, failed), daemon=True,
                                  name="marl-weight-transfer-join")
        joined.start()
        with ThreadPoolExecutor(max_workers=len(mine), thread_name_prefix="marl-weight-init") as pool:
            inits = [pool.submit(routes[post.replica].init, {
                "rank_offset": target.rank_offset(post.replica), "world_size": target.world_size, "packed": False,
                **channel.rendezvous()}) for post in mine]  # fmt: skip
            for init in inits:
                init.result()  # answers once its workers joined; an error leaves the others' threads waiting
        joined.join(target.timeout_s)  # for peers that never come (daemon: it cannot keep the server up)
        if joined.is_alive() or failed:
            raise WeightTransferError(f"the trainer could not join vLLM's NCCL group: {failed or 'timed out'}")
        self._channel = channel
        self._opened.update({post.url: _session(target, post.replica) for post in mine})


def _session(target: TransferTarget, replica: int) -> tuple[Any, ...]:
    """What an init is good for: this vLLM process, backend and channel (nccl: and the whole group's make-up)."""
    key = (target.replicas[replica].url, target.replicas[replica].session, target.backend, target.channel)
    return key + ((tuple((r.url, r.session) for r in target.replicas),) if target.backend == "nccl" else ())


def _connect(channel: Channel, world_size: int, failed: list[BaseException]) -> None:
    try:
        channel.connect(world_size)
    except BaseException as exc:  # noqa: BLE001 - reported by the thread that waits
        failed.append(exc)
