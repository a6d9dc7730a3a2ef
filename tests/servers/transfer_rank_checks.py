"""What the gloo ranks of test_weight_replicas.py run: build the policy sharded, push it to vLLM replicas (recording
HTTP stand-ins the test started) with `push_sharded`, each rank sharing its own gathered copy through a stand-in
`share`, and save what each push returned and which replica routes this rank posted to. Kept apart from the test
module so that a rank imports only what it needs."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh

from servers.engines.weight_transfer import TransferRoutes, TransferTarget, WeightPusher
from servers.trainers.fsdp_model import build_sharded_model
from servers.trainers.fsdp_push import push_sharded
from tests.servers.fsdp_rank_checks import gloo_group


def digest(tensor: torch.Tensor) -> str:
    """The tensor's exact bytes, hashed: which copy a handle stands for."""
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def stand_in_share(rank: int, tensor: torch.Tensor) -> dict[str, tuple]:
    """What `share_cuda_tensor` returns, with the sharing rank's "GPU" as the uuid and the tensor's bytes' digest in
    place of CUDA's handle (a CPU has no IPC)."""
    return {f"GPU-{rank}": (rank, list(tensor.shape), digest(tensor))}


def push_to_replicas(rank: int, rendezvous: str, world_size: int, model_dir: str, targets: list[TransferTarget],
                     out: str) -> None:
    """Push the sharded policy to each of `targets` in turn (bf16); save each push's result and this rank's posts."""
    posted: list[list[tuple[str, str]]] = []  # per push: (replica url, route) this rank posted
    send = TransferRoutes._post

    def recorded(routes: TransferRoutes, path: str, body: dict | None = None) -> None:
        posted[-1].append((str(routes._http.base_url).rstrip("/"), path))
        send(routes, path, body)

    TransferRoutes._post = recorded  # this rank's process only
    with gloo_group(rank, rendezvous, world_size):
        mesh = init_device_mesh("cpu", (world_size,))
        model, aliases = build_sharded_model(Path(model_dir), mesh, torch.device("cpu"), dtype=torch.float32,
                                             compute=torch.float32)  # fmt: skip
        pusher = WeightPusher(share=functools.partial(stand_in_share, rank))
        results = []
        for target in targets:
            posted.append([])
            results.append(push_sharded(model, aliases, torch.bfloat16, target, pusher))
    torch.save({"results": results, "posted": posted}, f"{out}.{rank}")
