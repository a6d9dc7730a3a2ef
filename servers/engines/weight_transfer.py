"""Weight sync through vLLM's weight-transfer engine: the trainer's side, written without vLLM.

vLLM (0.32 CPU / 0.33 CUDA) started with `--weight-transfer-config '{"backend": "ipc"|"nccl"}'` (CUDA only) takes new
weights over its RL routes (`vllm/entrypoints/rl/online/api_router.py`, mounted with `VLLM_SERVER_DEV_MODE=1`):
`/init_weight_transfer_engine` once per vLLM process, then per sync `/start_weight_update`, one `/update_weights` per
bucket of tensors (names, dtype names, shapes: the parameters' metadata) and `/finish_weight_update`. Its worker-side
engines are `vllm/distributed/weight_transfer/ipc_engine.py` and `nccl_engine.py`; their trainer-side halves import
vLLM, which marl's base environment cannot (its pins conflict: docs/backends.md). What they need from a trainer is
small, so it is rewritten here with torch alone, wire-compatible:

- **ipc** (vLLM on the trainer's GPU): each tensor is shared with `torch.multiprocessing.reductions.reduce_tensor`;
  the update carries `ipc_handles_pickled`, base64 of the pickled list of `{gpu uuid: rebuild_cuda_tensor args}`
  (as vLLM's `HTTPVLLMWeightSyncClient` sends it; vLLM unpickles it only with VLLM_ALLOW_INSECURE_SERIALIZATION=1),
  and vLLM's worker rebuilds the tensors in place, zero-copy.
- **nccl** (vLLM on GPUs of its own): vLLM's worker joins an NCCL group from a unique id minted by the trainer
  (`nccl_unique_id_b64`, the rendezvous vLLM offers to trainers that cannot import it: `nccl_common.py`) at ranks
  1..N; the trainer is rank 0 through torch's own NCCL bindings (`torch.cuda.nccl`), answers the one-element float32
  all-reduce vLLM's communicator runs after `ncclCommInitRank` (`PyNcclCommunicator._init_comm`), then broadcasts
  each tensor of a bucket while its `/update_weights` runs (the worker allocates each from the metadata and
  receives it, in order). Unpacked (`packed: false`): vLLM's packed wire format is not reimplemented.

Buckets hold whole decoder layers (`layer_buckets`): vLLM's layerwise reload keeps the tensors it received until
every weight of their layer arrived, so a bucket's tensors (for ipc, views of the trainer's memory) may be dropped
once its update answered. Gathered tensors are cast to vLLM's dtype as they come; the trainer never holds more than
a bucket (and a layer) of full tensors.

None of this has run on a GPU (no GPU was available to the project): the CPU tests check the routes and their bodies,
the buckets against the model's state dict, the broadcast over gloo into a receiving process, and the fallback.
"""

from __future__ import annotations

import base64
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import httpx
import torch

__all__ = ["TRANSFER_BACKENDS", "TransferRoutes", "TransferTarget", "WeightPusher", "WeightTransferError",
           "layer_buckets", "unique_tensors", "update_metadata"]

log = logging.getLogger(__name__)

#: The weight-transfer backends marl drives (vLLM has more: sparse_nccl, sharded_rdt, nccl_m2n).
TRANSFER_BACKENDS = ("ipc", "nccl")
#: Bytes of full tensors per `/update_weights` (a decoder layer larger than this travels alone).
DEFAULT_BUCKET_BYTES = 512 * 2**20

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightTransferError(RuntimeError):
    """The transfer failed; the weights go through the disk instead."""


@dataclass(frozen=True)
class TransferTarget:
    """Where and how to push weights: plain data, handed to the trainer (an FSDP trainer's rank 0 process)."""

    backend: str  # "ipc" or "nccl"
    url: str  # the vLLM server (127.0.0.1: the trainer's rank 0 runs on the server's machine)
    session: str  # one per vLLM process: a restarted vLLM needs the init again
    workers: int = 1  # vLLM's workers (tensor x data parallel): NCCL ranks 1..workers
    dtype: str | None = "bfloat16"  # what the weights travel as (vLLM's dtype); None: as the trainer holds them
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 600.0
    version: str | None = None  # vLLM's weight version after the sync (`/finish_weight_update`)
    channel: str = "nccl"  # nccl; "gloo" runs the same broadcast over gloo for the CPU tests (vLLM only speaks NCCL)

    def travel_dtype(self) -> torch.dtype | None:
        return None if self.dtype in (None, "auto") else getattr(torch, {"float": "float32", "half": "float16"}.get(
            self.dtype, self.dtype))


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


class WeightPusher:
    """Pushes a trainer's weights into vLLM (see the module docstring); lives as long as the trainer, one per
    process that holds the full tensors (the one-process trainer, an FSDP trainer's rank 0).

    `device`: the trainer's GPU (nccl). `share` turns a tensor into an IPC handle (default: `share_cuda_tensor`);
    the CPU tests pass their own.
    """

    def __init__(self, device: torch.device | str | None = None,
                 share: Callable[[torch.Tensor], dict[str, tuple]] | None = None) -> None:
        self._device = None if device is None else torch.device(device)
        self._share = share or share_cuda_tensor
        self._opened: tuple[str, ...] | None = None  # the vLLM process (and backend) the init was done with
        self._channel: Channel | None = None
        self._routes: TransferRoutes | None = None

    def begin(self, target: TransferTarget) -> None:
        """The init (once per vLLM process) and `/start_weight_update`: what can fail before anything is gathered."""
        if target.backend not in TRANSFER_BACKENDS:
            raise WeightTransferError(f"unknown weight-transfer backend {target.backend!r}")
        if self._opened != (target.url, target.session, target.backend, target.channel):
            self._open(target)
        self._routes.start()

    def send(self, target: TransferTarget, named: NamedTensors) -> None:
        """Every tensor of `named`, bucket by bucket, then `/finish_weight_update`. `begin` came first."""
        send_bucket = self._send_ipc if target.backend == "ipc" else self._send_nccl
        for bucket in layer_buckets(travelling(named, target.travel_dtype()), target.bucket_bytes):
            send_bucket(bucket)
            del bucket  # the update answered: vLLM has every layer of it
        self._routes.finish(target.version)

    def push(self, target: TransferTarget, named: NamedTensors) -> None:
        """`begin` then `send`: the one-process trainer's whole sync."""
        self.begin(target)
        self.send(target, named)

    def _open(self, target: TransferTarget) -> None:
        self._opened = None  # until the init succeeds
        if self._routes is not None:
            self._routes.close()
        self._routes = TransferRoutes(target.url, target.timeout_s)
        if target.backend == "ipc":
            self._routes.init({"packed": False})
        else:
            self._channel = self._join(target)
        self._opened = (target.url, target.session, target.backend, target.channel)

    def _join(self, target: TransferTarget) -> Channel:
        """Open the NCCL group: vLLM's workers join inside `/init_weight_transfer_engine` while this rank does."""
        channel: Channel = GlooChannel(target.timeout_s) if target.channel == "gloo" else NcclChannel(self._device)
        world_size = 1 + target.workers
        init_info = {"rank_offset": 1, "world_size": world_size, "packed": False, **channel.rendezvous()}
        failed: list[BaseException] = []
        joined = threading.Thread(target=_connect, args=(channel, world_size, failed), daemon=True,
                                  name="marl-weight-transfer-join")
        joined.start()
        self._routes.init(init_info)  # answers once the workers joined; an error here leaves the join thread
        joined.join(target.timeout_s)  # waiting for peers that never come (daemon: it cannot keep the server up)
        if joined.is_alive() or failed:
            raise WeightTransferError(f"the trainer could not join vLLM's NCCL group: {failed or 'timed out'}")
        return channel

    def _send_ipc(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        handles = [self._share(tensor) for _, tensor in bucket]
        pickled = base64.b64encode(pickle.dumps(handles)).decode()
        self._routes.update({**update_metadata(bucket), "ipc_handles_pickled": pickled})
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # the handles of earlier buckets vLLM has let go of

    def _send_nccl(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """`/update_weights` (the workers receive) runs while this rank broadcasts: both meet in each broadcast."""
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="marl-weight-update")
        try:
            answered = pool.submit(self._routes.update, update_metadata(bucket))

            def check() -> None:  # vLLM refused (before receiving): stop instead of broadcasting to nobody
                if answered.done():
                    answered.result()

            for _, tensor in bucket:
                check()
                self._channel.broadcast(tensor)
            self._channel.wait(check)
            answered.result()
        finally:
            pool.shutdown(wait=False)  # after a failed broadcast the update may never answer: do not wait for it


def _connect(channel: Channel, world_size: int, failed: list[BaseException]) -> None:
    try:
        channel.connect(world_size)
    except BaseException as exc:  # noqa: BLE001 - reported by the thread that waits
        failed.append(exc)
