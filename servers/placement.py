"""Which GPUs a server's engine and trainer ranks use (`marl serve --engine-gpus/--trainer-gpus`), and under Ray the
placement group its ranks go into (`--ray-group`).

Indices count the GPUs this server process sees: all of the machine's, or those of its own CUDA_VISIBLE_DEVICES
(under Ray, the GPUs Ray gave its actor). A process the server starts (vLLM, a trainer rank) gets the GPUs it may
use as CUDA_VISIBLE_DEVICES, mapped through the server's own list, so index 1 under CUDA_VISIBLE_DEVICES=4,5 is
physical GPU 5. In this process (the torch engine, the one-process trainer) an index is simply `cuda:<index>`.

Nothing set is the behaviour from before placement existed: the engine on GPU 0, rank r on GPU r, one machine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from marl.protocol import gpu_list_text

__all__ = ["Placement", "visible_devices"]

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def visible_devices(gpus: Sequence[int], environ: Mapping[str, str] | None = None) -> str:
    """CUDA_VISIBLE_DEVICES for a child that may use `gpus` (indices into what this process sees)."""
    environ = os.environ if environ is None else environ
    ours = environ.get(CUDA_VISIBLE_DEVICES)
    if ours is None:
        return gpu_list_text(list(gpus))
    seen = [device.strip() for device in ours.split(",") if device.strip()]
    missing = [gpu for gpu in gpus if gpu >= len(seen)]
    if missing:
        raise ValueError(f"GPUs {gpu_list_text(missing)} asked for, but this server sees only {len(seen)}"
                         f" (CUDA_VISIBLE_DEVICES={ours!r}): index the GPUs it sees, from 0")
    return ",".join(seen[gpu] for gpu in gpus)


@dataclass(frozen=True)
class Placement:
    """A server's GPUs (None: the default), and under Ray the placement group its trainer's ranks go into."""

    engine_gpus: tuple[int, ...] | None = None
    trainer_gpus: tuple[int, ...] | None = None
    #: The name of the server's Ray placement group (`marl serve --ray-group`): its trainer's ranks are Ray actors in
    #: bundles 1..N of it (servers.trainers.ray_ranks), vLLM's replicas after the first in the last bundles
    #: (servers.engines.vllm_ray), on whatever nodes Ray reserved them. None: local processes.
    ray_group: str | None = None
    ray_address: str | None = None  # the Ray cluster's GCS address (None: the cluster of this node)
    ray_ranks: bool = True  # the group holds the trainer's ranks (False: only vLLM's replicas)

    def __post_init__(self) -> None:
        for name in ("engine_gpus", "trainer_gpus"):
            if (gpus := getattr(self, name)) is not None:
                object.__setattr__(self, name, tuple(gpus))

    def shares_gpu(self) -> bool:
        """Do the engine and the trainer use a GPU in common? (by default both take GPU 0; never under Ray, where
        each rank has the GPU of its own bundle)"""
        return bool(set(self.engine_gpus or (0,)) & set(self.node_trainer_gpus()))

    def node_trainer_gpus(self) -> tuple[int, ...]:
        """The trainer's GPUs among the server's own (ranks 0..n-1 in this order), as `shares_gpu` counts them: GPU
        0 by default; none under Ray (its ranks' GPUs are their bundles')."""
        return () if self.ranks_on_ray else self.trainer_gpus or (0,)

    @property
    def ranks_on_ray(self) -> bool:
        """The trainer's ranks are Ray actors in the server's placement group (servers.trainers.ray_ranks)."""
        return self.ray_group is not None and self.ray_ranks

    def engine_device(self, device: str | None) -> str | None:
        """The in-process engine's torch device: `cuda:<first engine GPU>` when GPUs are placed and the device is
        CUDA (or left to default), else `device` as given."""
        if self.engine_gpus is None or device == "cpu":
            return device
        return f"cuda:{self.engine_gpus[0]}"

    def trainer_device(self, device: str | None) -> str | None:
        """The one-process trainer's device: its one trainer GPU, as `engine_device`."""
        if self.trainer_gpus is None or device == "cpu":
            return device
        return f"cuda:{self.trainer_gpus[0]}"
