"""Peak tensor memory of a region of code, on any device, the CPU included (torch has no CPU allocator statistics).

Every tensor storage an operator allocates inside `PeakTensorMemory` counts from its allocation to its release
(a weak reference to the storage says when); `peak` is the most bytes alive at once. This is what the CUDA
caching allocator's `max_memory_allocated` counts for the same code on a GPU: tensors only, unaffected by malloc's
caching or by other processes, which is why tests use it rather than the process's resident size. Storages that
existed before the region (weights, optimizer state) and FSDP's unsharded parameters (resized in place, which no
operator sees) are left out; the comparisons in the tests hold them equal.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


class PeakTensorMemory(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and not value.is_meta:
                self._track(value.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        if storage in self._seen:
            return
        size = storage.nbytes()
        self._seen[storage] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, size)

    def _release(self, size: int) -> None:
        self.live -= size
