"""The vLLM engine's side of a weight sync through vLLM's weight-transfer engine (the trainer's side, which sends
the tensors, is servers.engines.weight_transfer): whether it is on, the target the trainer pushes to, and the calls
around the push. A push replaces a reload, between the same calls: pause (or wake the weights) before, empty the
prefix cache and resume (or wake the KV cache) after; a failed push is logged and counted, and turns it off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from servers.engines.vllm_http import after_transfer, before_transfer, transfer_abandoned
from servers.engines.vllm_process import VLLMLaunch, VLLMProcess
from servers.engines.weight_transfer import TransferTarget

__all__ = ["TransferSync"]

log = logging.getLogger(__name__)


class TransferSync:
    """Pushed weight syncs of one engine; `stats` is its `VLLMStats` (weight_transfers, weight_transfer_failures)."""

    def __init__(self, launch: VLLMLaunch, stats: Any) -> None:
        self._launch = launch
        self._stats = stats
        #: Why the engine syncs through the disk (None while it pushes).
        self.off: str | None = None
        if launch.weight_sync == "disk":
            self.off = ("weight_sync is disk" if launch.settings.weight_sync == "disk" else
                        "the CPU build has no weight-transfer engine" if launch.on_cpu else
                        "vLLM spans GPUs the trainer shares")

    def target(self, process: VLLMProcess) -> TransferTarget:
        """Where the trainer pushes: this vLLM process (a restarted one is a new session), its workers and dtype."""
        settings = self._launch.settings
        return TransferTarget(backend=self._launch.weight_sync, url=process.url,
                              session=f"{process.pid}@{process.port}", dtype=self._launch.dtype,
                              workers=settings.tensor_parallel_size * settings.data_parallel_size)

    def sync(self, process: VLLMProcess, push: Callable[[TransferTarget], None], *, asleep: bool) -> bool:
        """Have the trainer `push` into `process`: True once the weights serve; False when the push failed (logged,
        counted, vLLM resumed or left waking for the disk sync that follows, and `off` from then on). vLLM's own
        routes failing (httpx errors, RuntimeError) pass through: the engine reports them as any failed sync."""
        before_transfer(process.url, asleep=asleep)
        try:
            push(self.target(process))
        except Exception as exc:  # noqa: BLE001 - any failure of the push falls back to the disk
            self._failed(exc)
            transfer_abandoned(process.url, asleep=asleep)
            return False
        after_transfer(process.url, asleep=asleep)
        self._stats.weight_transfers += 1
        return True

    def _failed(self, error: Exception) -> None:
        self._stats.weight_transfer_failures += 1
        self.off = f"the weight transfer failed: {type(error).__name__}: {error}"
        log.warning("vLLM weight sync through its %s weight-transfer engine failed (%s: %s); syncing through the"
                    " disk from now on", self._launch.weight_sync, type(error).__name__, error)
