"""LoRA adapters waiting for the torch engine's worker: which may be installed now, and installing them.

A load is prepared (validated, stacked) in the caller's thread, queued here, and installed by the worker between two
forwards once none of that adapter's requests runs; meanwhile that adapter's new requests wait (`held`), and every
other adapter's and the base's keep running. An unload goes the same way: queued, and done once none of the
adapter's requests runs (its waiting ones then fail). The engine guards the queue with its condition variable;
`install` runs outside it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from marl.protocol import LoraSpec
from servers.engines.multi_lora import MultiLora, PreparedAdapter
from servers.engines.prefix_cache import PrefixCache
from servers.engines.running_batch import RunningBatch

log = logging.getLogger("marl.engine")


class AdapterLoad:
    """An adapter waiting for the worker to install it (or, with `adapter` None, to remove adapter `name`); `done` is
    set once it serves, or is gone (or `error` says why not)."""

    def __init__(self, name: str, adapter: PreparedAdapter | None) -> None:
        self.name, self.adapter = name, adapter
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class AdapterLoads:
    """The queue of adapter loads (read and changed under the engine's condition variable, but `install`)."""

    def __init__(self) -> None:
        self.pending: list[AdapterLoad] = []

    def add(self, name: str, adapter: PreparedAdapter | None) -> AdapterLoad:
        """Queue `adapter` to serve as `name`, or (None) adapter `name`'s removal."""
        load = AdapterLoad(name, adapter)
        self.pending.append(load)
        return load

    def held(self) -> set[str | None]:
        """Adapters being replaced or removed: their new requests wait, so a generation never mixes two of their
        versions (and none starts on an adapter about to go)."""
        return {load.name for load in self.pending}

    def installable(self, batch: RunningBatch | None, swapping: bool) -> list[AdapterLoad]:
        """Loads that may be installed now: none of their requests runs, and no weight swap is under way (its body
        runs outside the worker)."""
        if swapping or not self.pending:
            return []
        running = {r.adapter for r in batch.requests} if batch is not None else set()
        return [load for load in self.pending if load.name not in running]

    def take(self, loads: list[AdapterLoad]) -> None:
        self.pending = [load for load in self.pending if load not in loads]

    def fail_all(self, error: BaseException) -> None:
        loads, self.pending = self.pending, []
        for load in loads:
            load.error = error
            load.done.set()


def install(loads: list[AdapterLoad], lora: MultiLora, prefix_cache: PrefixCache | None, stats: Any) -> None:
    """Install (or remove) `loads` (the worker, between two forwards); a failure goes to its caller, never to the
    worker."""
    for load in loads:
        try:
            if load.adapter is None:
                lora.remove(load.name)
            else:
                lora.install(load.adapter)
                stats.adapter_loads += 1
            if prefix_cache is not None:
                prefix_cache.forget(load.name)  # computed by its old version, or by one that is gone
        except Exception as error:  # noqa: BLE001 - e.g. out of memory: the caller hears of it, the worker goes on
            log.exception("%s LoRA adapter %r failed", "loading" if load.adapter else "unloading", load.name)
            load.error = error
        load.done.set()


class AdapterServing:
    """The torch engine's LoRA API (`InferenceEngine.load_adapter`, `unload_adapter`): each queues its change for the
    worker, which makes it between two forwards (`install`), and waits for it."""

    lora: MultiLora
    _cv: threading.Condition
    _closed: bool
    _adapter_loads: AdapterLoads

    def load_adapter(self, name: str, tensors: Mapping[str, Any], spec: LoraSpec) -> None:
        """Serve LoRA adapter `name` (new, or replacing the one of that name) from now on (see
        `InferenceEngine.load_adapter`); tensors in PEFT's names, ValueError for a bad one before anything changes.

        Blocks until the worker installed it between two forwards: after that adapter's running requests finished
        (its new requests wait meanwhile); other adapters' and the base's requests keep running. Its entries in the
        prefix cache are dropped (computed by the old adapter).
        """
        self._queue_adapter(name, self.lora.prepare(name, tensors, spec))

    def unload_adapter(self, name: str) -> None:
        """Stop serving LoRA adapter `name` and free its slot (see `InferenceEngine.unload_adapter`): blocks until its
        running requests finished and the worker removed it between two forwards; its requests still waiting then
        fail (ValueError). KeyError if no adapter of that name is loaded."""
        self._queue_adapter(name, None)

    def _queue_adapter(self, name: str, adapter: PreparedAdapter | None) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            if adapter is None and name not in self.lora.names:
                raise KeyError(f"no LoRA adapter named {name!r} is loaded (loaded: {sorted(self.lora.names)})")
            load = self._adapter_loads.add(name, adapter)
            self._cv.notify_all()
        load.wait()
