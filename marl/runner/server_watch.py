"""`ServerMonitor`: what a run knows of its trainable servers' status, and how it brings a stopped one back.

One monitor per run: `marl run` builds it for every trainable server and hands it to the coordinator (a
`Coordinator` built without one makes its own for the servers its games lease on).
- Not lease gating: whether a game may lease now is the server's own answer to `begin` (a busy server says how
  long to wait), never a status read here (`marl.transaction.coordinator`). A server that refused a lease because its
  engine is stopped is handed to `revive_if_offline(names)`: read again (at most once per `max_age_s`, 0.5 s, however
  many games ask) and revived if it is OFFLINE. `state(name)` and `fresh(name)` read with the same cache.
- The live table: `start()` runs a poll loop that reads every server each `poll_s`, each on its own worker (a server
  that hangs delays nobody else); `views()` is what it saw last; `on_step(name, status)` fires once per new policy
  version (`marl run`'s step-done line).
- Recovery: a server found OFFLINE (a restarted process comes up OFFLINE; a failed boot or training step stops its
  engine) gets its config synced and its engine started again, in the background, one revival per server at a time.
  A server that is found OFFLINE with an error `max_revivals` times in a row without a training step in between keeps
  failing the same way: the monitor stops reviving it and `fatal` says which server and why, so the run can end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import httpx

from marl.client import SwarmClient, SwarmError
from marl.protocol import EngineState, ServerStatus, TrainConfig

log = logging.getLogger("marl.runner.server_watch")

STATUS_MAX_AGE_S = 0.5
_STATUS_TIMEOUT_S = 5.0


class Watched(Protocol):
    """What the monitor needs of a server: its client, and the config to sync when reviving it (None: never)."""

    client: SwarmClient | None
    train_config: TrainConfig | None


@dataclass(frozen=True)
class ServerView:
    """The monitor's last read of one server: the last status it answered, and why the latest read failed, if it did."""

    status: ServerStatus | None = None  # the latest answer (from before an outage while `error` is set)
    error: str | None = None  # why the latest read failed: the server is unreachable
    read_at: float = float("-inf")  # time.monotonic() of the latest read

    @property
    def state(self) -> EngineState | None:
        """The engine state now; None while the server cannot be reached."""
        return None if self.error is not None or self.status is None else self.status.state


class ServerMonitor:
    def __init__(self, servers: Mapping[str, Watched], *, max_age_s: float = STATUS_MAX_AGE_S, poll_s: float = 1.0,
                 max_revivals: int = 5, on_step: Callable[[str, ServerStatus], None] | None = None):
        """`servers` are read through their `client` at every read, so a server given a new client is seen at once."""
        self.servers = servers
        self.max_age_s, self.poll_s, self.max_revivals = max_age_s, poll_s, max_revivals
        self.on_step = on_step
        self.fatal: str | None = None  # set once a server keeps failing to come back (see the module docstring)
        self._views = {name: ServerView() for name in servers}
        self._lock = threading.Lock()
        self._reading = {name: threading.Lock() for name in servers}  # one read at a time per server
        self._reviving: set[str] = set()
        self._failed_revivals: dict[str, tuple[int, int]] = {}  # name -> (in a row, policy version at the last one)
        self._closed = threading.Event()
        self._poller: threading.Thread | None = None

    # --- reads -------------------------------------------------------------------------------------------------

    def state(self, name: str) -> EngineState | None:
        """The server's engine state (at most `max_age_s` old); None while it cannot be reached."""
        return self.fresh(name).state

    def fresh(self, name: str) -> ServerView:
        """The server's view, read again if it is older than `max_age_s`."""
        with self._reading[name]:  # who waited here reads the answer of the read that held it
            view = self.view(name)
            if time.monotonic() - view.read_at < self.max_age_s:
                return view
            return self._read(name)

    def view(self, name: str) -> ServerView:
        with self._lock:
            return self._views[name]

    def views(self) -> dict[str, ServerView]:
        """What the monitor saw last of every server (no read)."""
        with self._lock:
            return dict(self._views)

    def versions(self, names: Iterable[str] | None = None) -> dict[str, int]:
        """The last policy version each server reported (0 before its first answer)."""
        views = self.views()
        return {name: views[name].status.policy_version if views[name].status else 0
                for name in (views if names is None else names)}

    def revive_if_offline(self, names: Iterable[str]) -> None:
        """Read these servers again (cached for `max_age_s`), so that one found OFFLINE is revived (see below)."""
        for name in names:
            self.fresh(name)

    def forget(self, names: Iterable[str]) -> None:
        """Drop what was seen of these servers: the next `state` reads them again."""
        with self._lock:
            for name in names:
                self._views[name] = ServerView(self._views[name].status, self._views[name].error)

    def _read(self, name: str) -> ServerView:
        try:
            status, error = self.servers[name].client.status(timeout=_STATUS_TIMEOUT_S), None
        except (SwarmError, httpx.HTTPError) as exc:
            status, error = None, f"unreachable ({type(exc).__name__})"
        with self._lock:
            before = self._views[name]
            view = self._views[name] = ServerView(status or before.status, error, time.monotonic())
        if status is not None:
            self._react(name, before.status, status)
        return view

    def _react(self, name: str, before: ServerStatus | None, status: ServerStatus) -> None:
        if before is not None and status.policy_version > before.policy_version and self.on_step is not None:
            self.on_step(name, status)
        if status.state == EngineState.OFFLINE:
            self._revive(name, status)

    # --- recovery ----------------------------------------------------------------------------------------------

    def _revive(self, name: str, status: ServerStatus) -> None:
        """Sync the config and start the engine of an OFFLINE server, in the background (once at a time)."""
        with self._lock:
            if self.servers[name].train_config is None or name in self._reviving or self.fatal or self._closed.is_set():
                return
            if not self._may_revive(name, status):
                return
            self._reviving.add(name)
        threading.Thread(target=self._start_engine, args=(name,), name=f"revive-{name}", daemon=True).start()

    def _may_revive(self, name: str, status: ServerStatus) -> bool:
        """Count a revival after an error (call with the lock held); False once `max_revivals` in a row are spent.

        A restarted process comes up OFFLINE without an error: that revival is free. A training step taken since the
        last failed revival means the server works again: the count starts over.
        """
        if status.last_error is None:
            return True
        in_a_row, version = self._failed_revivals.get(name, (0, status.policy_version))
        in_a_row = 1 if status.policy_version > version else in_a_row + 1
        self._failed_revivals[name] = (in_a_row, status.policy_version)
        if in_a_row <= self.max_revivals:
            return True
        self.fatal = (f"server {name} stopped with an error {in_a_row} times in a row and was restarted"
                      f" {self.max_revivals} times; its last error: {status.last_error}")
        log.error("%s", self.fatal)
        return False

    def _start_engine(self, name: str) -> None:
        server = self.servers[name]
        try:
            log.info("%s is OFFLINE: syncing its config and starting its engine", name)
            server.client.auto_sync_train_config_and_start_engine(server.train_config)
        except (SwarmError, httpx.HTTPError) as exc:
            log.warning("could not restart %s: %s", name, exc)
        finally:
            with self._lock:
                self._reviving.discard(name)
            self.forget([name])

    # --- the poll loop -----------------------------------------------------------------------------------------

    def start(self) -> ServerMonitor:
        """Read every server every `poll_s` in the background (for the live table and the step-done line)."""
        self._poller = threading.Thread(target=self._poll, name="server-monitor", daemon=True)
        self._poller.start()
        return self

    def close(self) -> None:
        self._closed.set()
        if self._poller is not None:
            self._poller.join(timeout=2 * self.poll_s)

    def _poll(self) -> None:
        reads: dict[str, Future] = {}
        with ThreadPoolExecutor(max(1, len(self.servers)), thread_name_prefix="server-monitor") as pool:
            while not self._closed.is_set():
                for name in self.servers:
                    if name not in reads or reads[name].done():  # a server that hangs is not asked twice
                        reads[name] = pool.submit(self.fresh, name)
                self._closed.wait(self.poll_s)
