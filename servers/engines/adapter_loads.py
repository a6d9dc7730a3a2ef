"""LoRA adapters waiting for the torch engine's worker: which may be installed now, and installing them.

A load is prepared (validated, stacked) in the caller's thread, queued here, and installed by the worker between two
forwards once none of that adapter's requests runs; meanwhile that adapter's new requests wait (`held`), and every
other adapter's and the base's keep running. The engine guards the queue with its condition variable; `install`
runs outside it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from servers.engines.multi_lora import MultiLora, PreparedAdapter
from servers.engines.prefix_cache import PrefixCache
from servers.engines.running_batch import RunningBatch

log = logging.getLogger("marl.engine")


class AdapterLoad:
    """An adapter waiting for the worker to install it; `done` is set once it serves (or `error` says why not)."""

    def __init__(self, adapter: PreparedAdapter) -> None:
        self.adapter = adapter
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

    def add(self, adapter: PreparedAdapter) -> AdapterLoad:
        load = AdapterLoad(adapter)
        self.pending.append(load)
        return load

    def held(self) -> set[str | None]:
        """Adapters being replaced: their new requests wait, so a generation never mixes two of their versions."""
        return {load.adapter.name for load in self.pending}

    def installable(self, batch: RunningBatch | None, swapping: bool) -> list[AdapterLoad]:
        """Loads that may be installed now: none of their requests runs, and no weight swap is under way (its body
        runs outside the worker)."""
        if swapping or not self.pending:
            return []
        running = {r.adapter for r in batch.requests} if batch is not None else set()
        return [load for load in self.pending if load.adapter.name not in running]

    def take(self, loads: list[AdapterLoad]) -> None:
        self.pending = [load for load in self.pending if load not in loads]

    def fail_all(self, error: BaseException) -> None:
        loads, self.pending = self.pending, []
        for load in loads:
            load.error = error
            load.done.set()


def install(loads: list[AdapterLoad], lora: MultiLora, prefix_cache: PrefixCache | None, stats: Any) -> None:
    """Install `loads` (the worker, between two forwards); a failure goes to its caller, never to the worker."""
    for load in loads:
        try:
            lora.install(load.adapter)
            if prefix_cache is not None:
                prefix_cache.forget(load.adapter.name)  # computed by its old version
            stats.adapter_loads += 1
        except Exception as error:  # noqa: BLE001 - e.g. out of memory: the caller hears of it, the worker goes on
            log.exception("loading LoRA adapter %r failed", load.adapter.name)
            load.error = error
        load.done.set()
