"""A LoRA policy's snapshots, served by the policy's own trainable server as frozen policies.

The past_of server of a policy (`past_of: {server: team, policy: speaker}`) needs no process of its own: each
snapshot is an adapter (`step_N/adapter/`), which `team` loads into the engine it already runs, under the name
`speaker@N` (`POST /control/frozen`), and unloads once the league retires it (`DELETE /control/frozen/speaker@N`).
Games call it at team's /v1 with `model: speaker@N` and the key the load handed out; nothing is leased or recorded.
Version 0 (a fresh adapter, B = 0) is the base model alone: it takes no adapter slot.

`FrozenFleet` is `marl.league.SnapshotPool`'s fleet for such a pool, with `StaticFleet`'s interface. The adapter
directories are paths in the run directory: the server must see them (it runs on this machine, or a shared
filesystem).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from marl.client import SwarmClient, SwarmError, SwarmRefused
from marl.league.snapshots import Snapshot
from marl.protocol import ErrorCode, frozen_name
from marl.runner.endpoints import StaticEndpoint

log = logging.getLogger("marl.league")

_LOAD_TIMEOUT_S = 600.0  # the server may still be booting its engine (the load waits for it)
_QUICK_S = 5.0  # a list or an unload: the server answers at once, or is gone


class FrozenFleet:
    """Snapshots of a LoRA policy as frozen policies on the trainable server at `url()` (read at every call: a
    restarted server may have moved), each reached as a `StaticEndpoint`."""

    def __init__(self, url: Callable[[], str], *, token: str, load_timeout_s: float = _LOAD_TIMEOUT_S):
        self.url, self.token, self.load_timeout_s = url, token, load_timeout_s
        self._serving: dict[Snapshot, StaticEndpoint] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def endpoints(self, snapshots: Iterable[Snapshot]) -> dict[Snapshot, StaticEndpoint]:
        """An endpoint for each snapshot, loading those not served yet. Raises RuntimeError."""
        out = {}
        for snapshot in dict.fromkeys(snapshots):
            with self._lock:
                endpoint = self._serving.get(snapshot)
            out[snapshot] = endpoint if endpoint is not None else self._load(snapshot)
        return out

    def alive(self, snapshot: Snapshot) -> bool:
        """Whether the server still serves it (a restarted engine serves none); True while the server cannot say."""
        with self._lock:
            endpoint = self._serving.get(snapshot)
        if endpoint is None:
            return False
        try:
            with self._client(_QUICK_S) as client:
                return endpoint.model in {frozen.name for frozen in client.frozen_policies(timeout=_QUICK_S)}
        except SwarmError:
            return True  # down or restarting: the run's supervisor sees to it; the next pass asks again

    def stop(self, snapshot: Snapshot) -> None:
        """Unload it (its engine slot is freed once its running calls finished)."""
        with self._lock:
            endpoint = self._serving.pop(snapshot, None)
        if endpoint is None:
            return
        try:
            with self._client(_QUICK_S) as client:
                client.unload_frozen_policy(endpoint.model, timeout=_QUICK_S)
        except SwarmRefused as exc:
            if exc.code is not ErrorCode.FROZEN_POLICY_NOT_FOUND:  # not found: gone with a restarted engine
                log.warning("could not unload %s: %s", endpoint.model, exc)
        except SwarmError as exc:
            log.warning("could not unload %s: %s", endpoint.model, exc)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            serving = list(self._serving)
        for snapshot in serving:
            self.stop(snapshot)

    def _client(self, max_wait_s: float) -> SwarmClient:
        return SwarmClient(self.url(), admin_token=self.token, timeout=min(30.0, max_wait_s), max_wait_s=max_wait_s)

    def _load(self, snapshot: Snapshot) -> StaticEndpoint:
        if self._closed.is_set():
            raise RuntimeError(f"could not serve {snapshot.name}: the fleet is closed")
        assert snapshot.policy is not None and snapshot.version is not None, f"{snapshot} is no policy's snapshot"
        name = frozen_name(snapshot.policy, snapshot.version)
        try:
            with self._client(self.load_timeout_s) as client:
                frozen = client.load_frozen_policy(name, snapshot.adapter, policy_version=snapshot.version)
                url = client.url
        except SwarmError as exc:
            raise RuntimeError(f"could not serve {snapshot.name} ({snapshot.describe()}) as frozen policy {name}:"
                               f" {exc}") from exc
        endpoint = StaticEndpoint(snapshot.name, base_url=url + "/v1", model=name, api_key=frozen.api_key,
                                  policy_version=snapshot.version, snapshot_of=snapshot.learner)
        with self._lock:
            self._serving[snapshot] = endpoint
        if self._closed.is_set():  # closed while it loaded
            self.stop(snapshot)
            raise RuntimeError(f"could not serve {snapshot.name}: the fleet is closed")
        log.info("serving %s (%s) as frozen policy %s on %s", snapshot.name, snapshot.describe(), name, url)
        return endpoint
