"""Keeps one vLLM subprocess serving for a `VLLMEngine`: starts it, watches it, restarts it, says why it is down.

A watcher thread starts vLLM and then waits on it (vLLM gets SIGTERM when that thread ends: servers.engines.
vllm_process). When vLLM dies, the requests running on it fail (an engine error), new ones wait (`serving`), and
it is started again, at most `max_restarts` times, with what it served (`replay`: the engine's latest weights and
adapters). When it cannot be (`unrestorable` says why, e.g. weights that left no copy), or the restart fails, the
engine is down: every call fails at once with `down`, the reason, until the engine is stopped and started again.
An engine of several replicas has a supervisor per replica (servers.engines.vllm_replicas): each restarts its own
vLLM, at most `max_restarts` times, and counts its restarts into the engine's `stats.restarts` too. A replica in a
Ray actor (servers.engines.vllm_ray) is watched and restarted the same way: a restart is a new actor in its bundle.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from servers.engines.vllm_http import generate_one_token
from servers.engines.vllm_process import VLLMLaunch, VLLMProcess

__all__ = ["VLLMSupervisor"]

log = logging.getLogger("servers.engines.vllm_engine")


class VLLMSupervisor:
    """The vLLM process of one engine or replica (see the module docstring). `lock` serializes every change of what
    vLLM serves with the restarts; `restarts` counts this one's restarts, `stats.restarts` the engine's."""

    def __init__(self, launch: VLLMLaunch, log_path: Path, *, replay: Callable[[VLLMProcess], None],
                 unrestorable: Callable[[], str | None], stats: Any, start_timeout_s: float,
                 max_restarts: int, replica: int = 0,
                 spawn: Callable[[VLLMLaunch, Path], VLLMProcess] = VLLMProcess) -> None:  # fmt: skip
        self._launch, self._log_path, self._replay, self._unrestorable = launch, log_path, replay, unrestorable
        self._spawn = spawn  # starts one vLLM: a subprocess here, or one in a Ray actor (servers.engines.vllm_ray)
        self._stats, self.start_timeout_s, self._max_restarts = stats, start_timeout_s, max_restarts
        self.lock = threading.Lock()
        self.process: VLLMProcess | None = None
        self.down: str | None = None  # why the engine no longer serves (every call fails with it)
        self.restarts = 0
        self._ready = threading.Event()  # set while vLLM serves
        self._closing = threading.Event()
        self._booted = threading.Event()
        self._boot_error: BaseException | None = None
        self._watcher = threading.Thread(target=self._run, name=f"marl-vllm-watcher-{replica}", daemon=True)

    def start(self) -> None:
        """Start vLLM and return once it serves; raises why it could not."""
        self._watcher.start()
        self._booted.wait()
        if self._boot_error is not None:
            self.close()
            raise self._boot_error

    @property
    def serving(self) -> bool:
        """vLLM is up (not starting, restarting or down)."""
        return self._ready.is_set() and self.down is None

    def lost(self, process: VLLMProcess, error: Exception) -> str:
        """What a request or sync that failed with `error` on `process` tells its caller."""
        code = process.exit_code()
        if code is None:
            return f"the request to vLLM failed: {type(error).__name__}: {error}"
        what = "it is down" if self.down else "it is being restarted"
        return f"{process.ended(code)} during the request; {what} (log: {process.log_path})"

    def close(self) -> None:
        """Stop vLLM (idempotent); calls still running or waiting fail."""
        self._closing.set()
        self.down = self.down or "the engine is closed"
        self._ready.clear()
        if self.process is not None:
            self.process.stop()
        if self._watcher.is_alive() and threading.current_thread() is not self._watcher:
            self._watcher.join(timeout=30)

    def _start(self) -> VLLMProcess:
        """Start vLLM, wait until it serves, give it what the engine served (`replay`), check that it generates."""
        process = self._spawn(self._launch, self._log_path)
        self.process = process
        try:
            process.wait_ready(self.start_timeout_s, cancelled=self._closing.is_set)
            self._replay(process)
            try:
                generate_one_token(process.url)
            except RuntimeError as exc:
                raise RuntimeError(f"vLLM started but cannot generate: {exc}; {process.describe_log()}") from exc
        except BaseException:
            process.stop()
            raise
        log.info("vLLM ready on %s (pid %d)", process.url, process.pid)
        return process

    def _run(self) -> None:
        """The watcher thread: start vLLM, then wait on it and restart it when it dies."""
        try:
            self._start()
            self._ready.set()
        except BaseException as exc:  # noqa: BLE001 - `start` raises it
            self._boot_error = exc
        finally:
            self._booted.set()
        while self._boot_error is None and not self._closing.is_set():
            process = self.process
            code = process.wait()
            if self._closing.is_set():
                return
            self._ready.clear()
            log.error("vLLM (pid %d): %s; %s", process.pid, process.ended(code), process.describe_log())
            if not self._restart(process, code):
                return

    def _restart(self, dead: VLLMProcess, code: int) -> bool:
        with self.lock:
            dead.stop()  # whatever is left of its session
            if self._closing.is_set():
                return False
            if (reason := self._unrestorable()) is not None:
                self.down = (f"{dead.ended(code)}, and {reason}: start the engine again"
                             f" (it resumes from the last checkpoint) (log: {dead.log_path})")
                return False
            if self.restarts >= self._max_restarts:
                self.down = (f"{dead.ended(code)} after {self.restarts} restart(s): the engine is down until it"
                             f" is stopped and started again (log: {dead.log_path})")
                return False
            self.restarts += 1
            self._stats.restarts += 1
            try:
                self._start()
            except Exception as exc:  # noqa: BLE001 - reported to every later call
                self.down = f"{dead.ended(code)} and could not be restarted: {exc}"
                log.error("%s", self.down)
                return False
            self._ready.set()
        log.warning("vLLM restarted (%d of %d restarts used)", self.restarts, self._max_restarts)
        return True
