"""What a GPU server's box holds beside its GPUs: which way the weights travel after a step, and host memory.

The way (`vllm.weight_sync`) mirrors `servers.engines.vllm_process.VLLMLaunch.weight_sync` (marl/ never imports
servers/; tests/marl/test_plan.py compares the two over a grid of placements):

    set explicitly                                        that setting
    the CPU build                                         disk  (its transfer routes answer 500)
    every engine GPU also a trainer GPU of the node       ipc   (CUDA IPC handles, any tensor x data parallel size)
    engine GPUs disjoint from the trainer's               nccl  (the plan assumes the trainer's NCCL is found)
    a partial overlap                                     disk  (NCCL refuses two ranks on one GPU)

Only `disk` writes per step: the exported safetensors in the engine's dtype (bf16 on CUDA).

Host memory of the box, at the moments that load it most (each with every process's own allowance,
HOST_PROCESS_BYTES: the server, its trainer ranks on this box, and each vLLM replica's API server, engine core and,
with tensor parallelism, workers):

    a training step   a sleeping vLLM's weights, offloaded to host memory (sleep mode level 1), every replica's
    a checkpoint      dcp.async_save's staging of this box's ranks' shards, and rank 0's gather of the export
                      (vLLM is awake then: the checkpoint follows the weight sync)
    loading           rank 0 reads the model's files

It is checked against `placement.host_memory_gb` when the topology states it, and printed always.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from marl.topology.problems import Problem

from .architecture import Architecture
from .memory import GB, HOST_PROCESS_BYTES, Parts, checkpoint_host

__all__ = ["HostLoad", "host_load", "weight_sync_way"]


def weight_sync_way(mode: str, *, on_cpu: bool, engine_gpus: list[int], trainer_gpus: list[int]) -> str:
    """How a trainer's weights reach its vLLM after a step: disk, ipc or nccl (see the module docstring)."""
    if mode != "auto":
        return mode
    if on_cpu:
        return "disk"
    engine, trainer = set(engine_gpus), set(trainer_gpus)
    if engine <= trainer:
        return "ipc"
    return "nccl" if not engine & trainer else "disk"


@dataclass
class HostLoad:
    """A box's host memory at each moment (name -> parts), and its capacity when the topology states it."""

    moments: dict[str, Parts] = field(default_factory=dict)
    capacity: float | None = None

    @property
    def peak(self) -> tuple[str, Parts]:
        return max(self.moments.items(), key=lambda item: item[1].total)

    def line(self) -> str:
        moment, parts = self.peak
        biggest = ", ".join(f"{what} {nbytes / GB:.1f}" for what, nbytes in parts.items)
        stated = (f"of {self.capacity / GB:.0f} GB (placement.host_memory_gb)" if self.capacity is not None
                  else "(placement.host_memory_gb not stated: not checked)")
        others = "; ".join(f"{m} {p.total / GB:.1f}" for m, p in self.moments.items() if m != moment)
        return (f"host memory: {parts.total / GB:.1f} GB {stated} at {moment} ({biggest})"
                + (f"; {others} GB" if others else ""))

    def problem(self, key: str) -> Problem | None:
        moment, parts = self.peak
        if self.capacity is None or parts.total <= self.capacity:
            return None
        what, most = max(parts.items, key=lambda item: item[1])
        return Problem(f"{key}.placement.host_memory_gb", f"the box needs {parts.total / GB:.1f} GB of host memory"
                       f" at {moment} (most: {what}, {most / GB:.1f} GB), more than its {self.capacity / GB:.0f} GB:"
                       " fewer vLLM replicas or ranks on the box, a rarer train.save_freq, or a box with more"
                       " memory")  # fmt: skip


def host_load(arch: Architecture, *, processes: int, asleep_weights: float, ranks_here: int, ranks: int,
              export_bytes: int, checkpoints: bool, capacity: float | None) -> HostLoad:  # fmt: skip
    """The moments of the module docstring for one box (`ranks_here`: 0 without a trainer; `asleep_weights`: what
    sleeping vLLMs offload, 0 when they do not sleep)."""
    base = Parts().add(f"{processes} processes", processes * HOST_PROCESS_BYTES)
    load = HostLoad(capacity=capacity)
    if not ranks_here:
        load.moments["serving"] = base
        return load
    load.moments["loading"] = Parts().extend(base).add("rank 0 reads the model",
                                                       arch.parameter_count() * arch.weights_bytes_per_param)
    load.moments["a training step"] = Parts().extend(base).add("sleeping vLLM's weights", asleep_weights)
    if checkpoints:
        load.moments["a checkpoint"] = Parts().extend(base).extend(checkpoint_host(
            arch, ranks_here=ranks_here, ranks=ranks, export_bytes=export_bytes))
    return load
