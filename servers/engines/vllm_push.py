"""The vLLM engine's side of a weight sync through vLLM's weight-transfer engine (the trainer's side, which sends
the tensors, is servers.engines.weight_transfer): whether it is on, the target the trainer pushes to (every replica
of vLLM at once), and the calls around the push. A push replaces a reload, between the same calls on every replica:
pause (or wake the weights) before, empty the prefix cache and resume (or wake the KV cache) after; a failed push is
logged and counted, and turns it off.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from servers.engines.vllm_http import after_transfer, before_transfer, transfer_abandoned
from servers.engines.vllm_process import VLLMLaunch, VLLMProcess
from servers.engines.weight_transfer import Replica, TransferTarget

__all__ = ["TransferSync"]

log = logging.getLogger(__name__)


class TransferSync:
    """Pushed weight syncs of one engine; `stats` is its `VLLMStats` (weight_transfers, weight_transfer_failures)."""

    def __init__(self, launch: VLLMLaunch, stats: Any) -> None:
        self._launch = launch
        self._stats = stats
        #: Why the engine syncs through the disk (None while it pushes).
        self.off: str | None = launch.disk_reason

    def target(self, processes: Sequence[VLLMProcess]) -> TransferTarget:
        """Where the trainer pushes: these vLLM processes, the replicas in order (a restarted one is a new session),
        each on its share of the engine GPUs (replica r on `engine_gpus[r*n:(r+1)*n]`, n = GPUs / replicas), the
        trainer's GPUs on this machine, and vLLM's dtype."""
        engine, trainer = self._launch.gpu_layout
        per = len(engine) // len(processes)
        replicas = tuple(Replica(url=process.url, session=f"{process.pid}@{process.port}",
                                 gpus=engine[r * per:(r + 1) * per]) for r, process in enumerate(processes))
        return TransferTarget(backend=self._launch.weight_sync, replicas=replicas, trainer_gpus=trainer,
                              dtype=self._launch.dtype)

    def sync(self, processes: Sequence[VLLMProcess], push: Callable[[TransferTarget], None], *, asleep: bool) -> bool:
        """Have the trainer `push` into every one of `processes` (the replicas, in order): True once the weights
        serve on all; False when the push failed (logged, counted, every replica resumed or left waking for the disk
        sync that follows, and `off` from then on). vLLM's own routes failing (httpx errors, RuntimeError) pass
        through: the engine reports them as any failed sync."""
        urls = [process.url for process in processes]
        try:
            _on_each(before_transfer, urls, asleep)
        except Exception:
            _on_each(transfer_abandoned, urls, asleep)  # the replicas that did pause serve again
            raise
        try:
            push(self.target(processes))
        except Exception as exc:  # noqa: BLE001 - any failure of the push falls back to the disk
            self._failed(exc)
            _on_each(transfer_abandoned, urls, asleep)
            return False
        _on_each(functools.partial(after_transfer, kv_setting=self._launch.kv_setting), urls, asleep)
        self._stats.weight_transfers += 1
        return True

    def _failed(self, error: Exception) -> None:
        self._stats.weight_transfer_failures += 1
        self.off = f"the weight transfer failed: {type(error).__name__}: {error}"
        log.warning("vLLM weight sync through its %s weight-transfer engine failed (%s: %s); syncing through the"
                    " disk from now on", self._launch.weight_sync, type(error).__name__, error)


def _on_each(call: Callable[..., None], urls: list[str], asleep: bool) -> None:
    """`call(url, asleep=asleep)` on every replica at once (a pause waits for that replica's running requests);
    raises the first replica's error once all are done."""
    if len(urls) == 1:
        call(urls[0], asleep=asleep)
        return
    with ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="marl-vllm-transfer") as pool:
        done = [pool.submit(call, url, asleep=asleep) for url in urls]
    for each in done:
        each.result()
