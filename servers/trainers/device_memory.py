"""A trainer process's device memory handed back before the inference engine needs it.

PyTorch's CUDA caching allocator keeps every block it ever reserved: after a training step a process still holds
about its peak (activations, gathered parameters, logits chunks), although only the live tensors (a rank's shards of
the weights, gradients and AdamW state) are in use. An inference engine in another process that shares the GPU
(vLLM waking from sleep mode, or restarting) cannot use that memory until the trainer's process empties its cache,
and vLLM's start checks free memory. So every trainer process frees its cache at the end of every command that
allocates on the device (an FSDP rank: servers.trainers.fsdp_worker; the one-process trainer:
`Trainer.release_memory`, called by the train loop before the weights are published), as verl's hybrid engine does
before it wakes its rollout engine.

On the CPU there is no cache to empty: the readings are 0 and nothing runs.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

__all__ = ["DeviceMemory", "MemoryRelease", "free_cached_memory", "memory_metrics"]


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of this process's allocator on one device, in bytes (0 on the CPU)."""

    allocated: int = 0  # held by live tensors
    reserved: int = 0  # held by the allocator: live tensors plus cached blocks

    @classmethod
    def read(cls, device: torch.device | str | None) -> DeviceMemory:
        """`device`'s allocator (None: the current CUDA device, if this process uses CUDA)."""
        if not torch.cuda.is_initialized():
            return cls()
        device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if device.type != "cuda":
            return cls()
        return cls(allocated=torch.cuda.memory_allocated(device), reserved=torch.cuda.memory_reserved(device))


@dataclass(frozen=True)
class MemoryRelease:
    """The allocator right after a command (`before`) and once its cache was emptied (`after`)."""

    before: DeviceMemory
    after: DeviceMemory


def free_cached_memory(device: torch.device | str | None) -> MemoryRelease:
    """On CUDA: collect garbage (reference cycles may hold tensors), wait for the device's queued work, return every
    cached block to the driver, and wait again so the memory is free before the caller answers. Nothing on the CPU
    (a full collection in a serving process walks every call in flight: servers/heap.py)."""
    before = DeviceMemory.read(device)
    if before.reserved:  # this process holds memory on a CUDA device
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    return MemoryRelease(before=before, after=DeviceMemory.read(device))


def memory_metrics(releases: list[MemoryRelease]) -> dict[str, float]:
    """A step's memory metrics, the largest over the processes (ranks) in GB; none on the CPU (all zero)."""
    if not any(release.before.reserved for release in releases):
        return {}
    largest = lambda pick: max(pick(release) for release in releases) / 1e9  # noqa: E731
    return {"device_allocated_gb": largest(lambda r: r.before.allocated),
            "device_reserved_gb": largest(lambda r: r.before.reserved),
            "device_reserved_freed_gb": largest(lambda r: r.after.reserved)}
