"""Snapshots: a server's weights at one policy version, and the static `marl serve` processes that serve them.

A snapshot is what `marl serve --model X --static` loads: a server's base model (policy version 0, `initial`), or a
checkpoint that a local trainable server wrote into its data dir, `<run_dir>/servers/<server>/checkpoints/step_N/`
with N zero-padded to 6 digits (a Hugging Face model dir holding policy version N; servers/checkpoint_dirs.py renames it
into place only once complete). The paths are re-derived here, not imported: marl/ reaches servers over HTTP only.

Used by `marl eval` and `run.eval_every` (marl/eval/) and by past_of servers (marl/league.py).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from marl.client import SwarmClient
from marl.endpoints import StaticEndpoint
from marl.launch import ServerProcess
from marl.protocol import EngineState
from marl.topology import ServerKind, Topology

log = logging.getLogger("marl.snapshots")

INITIAL, LATEST = "initial", "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_VERSION = re.compile(r"^(?:v|step_?)?(\d+)$")
_BOOT_TIMEOUT_S = 600.0
_STATUS_TIMEOUT_S = 5.0


class SnapshotError(ValueError):
    """A checkpoint that cannot be served: the message says which exist."""


@dataclass(frozen=True)
class Snapshot:
    """One model to serve statically."""

    server: str  # the topology server whose weights these are
    version: int | None  # its policy version (0: the base model); None: unknown (a directory given by path)
    model: str  # what `marl serve --model` loads: a checkpoint dir, or the base model (a dir or an alias)
    trainable: bool = True  # a trainable server's weights (recorded as `snapshot_of`); False: a static server's model

    @property
    def label(self) -> str:
        if self.version is None:
            return Path(self.model).name
        return INITIAL if self.version == 0 else f"v{self.version}"

    @property
    def name(self) -> str:
        """Its endpoint's name and served model name, e.g. `speaker_model@v5`."""
        return f"{self.server}@{self.label}"


def checkpoints_of(run_dir: Path, server: str) -> dict[int, Path]:
    """The complete checkpoints of local trainable server `server` of the run in `run_dir`: step -> directory."""
    root = Path(run_dir) / "servers" / server / "checkpoints"
    if not root.is_dir():
        return {}
    found = {int(m.group(1)): p for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))}
    return dict(sorted(found.items()))


def checkpoint_source(topology: Topology, server: str) -> str:
    """The server whose checkpoints `server` plays: a past_of server's source, else the server itself."""
    past_of = topology.spec.servers[server].past_of
    return past_of.server if past_of is not None else server


def resolve_snapshot(topology: Topology, run_dir: Path, server: str, ref: str) -> Snapshot:
    """The snapshot `ref` names for trainable server `server`: `initial`, `latest` (the newest checkpoint, else
    initial), a step (`5`, `v5`, `step_5`), or a checkpoint directory (a path). Raises `SnapshotError`."""
    spec = topology.spec.servers[server]
    if "/" in ref or ref.startswith((".", "~")):
        path = Path(ref).expanduser()
        if not path.is_dir():
            raise SnapshotError(f"{ref}: no such checkpoint directory")
        step = _STEP_DIR.match(path.name)
        return Snapshot(server, int(step.group(1)) if step else None, str(path))
    initial = Snapshot(server, 0, spec.model or "")
    if ref == INITIAL:
        if not spec.model:
            raise SnapshotError(f"servers.{server} names no model: give its initial weights as a directory")
        return initial
    if spec.kind is not ServerKind.LOCAL_TRAINABLE:
        raise SnapshotError(f"servers.{server} is a {spec.kind.value} server: only local trainable servers keep"
                            f" checkpoints in the run directory; give a checkpoint directory instead of {ref!r}")
    found = checkpoints_of(run_dir, server)
    if ref == LATEST:
        return Snapshot(server, max(found), str(found[max(found)])) if found else initial
    match = _VERSION.match(ref)
    if match is None:
        raise SnapshotError(f"{ref!r} is not a checkpoint: give initial, latest, a step (5, v5) or a directory")
    version = int(match.group(1))
    if version == 0:
        return initial
    if version not in found:
        have = ", ".join(map(str, found)) or "none"
        raise SnapshotError(f"servers.{server} has no checkpoint of step {version} in"
                            f" {Path(run_dir) / 'servers' / server / 'checkpoints'} (steps kept: {have}; also"
                            " initial). Checkpoints are kept every train.save_freq steps, the newest"
                            " train.keep_checkpoints of them")
    return Snapshot(server, version, str(found[version]))


class StaticFleet:
    """Static `marl serve` processes, one per snapshot, started on demand; each is reached as a `StaticEndpoint`.

    `max_servers` bounds how many run at once: starting more stops the least recently used ones that are not asked
    for. Logs go to `log_dir/<snapshot name>.log`; `devices` maps a server to the device its snapshots load on.
    `close()` stops every process, those still booting too (their `endpoints` call then fails at once).
    """

    def __init__(self, log_dir: Path, *, token: str, devices: Mapping[str, str | None] | None = None,
                 prefix_cache_gb: float | None = None, max_servers: int | None = None):
        self.log_dir, self.token, self.devices = Path(log_dir), token, dict(devices or {})
        self.prefix_cache_gb, self.max_servers = prefix_cache_gb, max_servers
        self._running: dict[Snapshot, tuple[ServerProcess, StaticEndpoint]] = {}
        self._used_at: dict[Snapshot, float] = {}
        self._booting: set[ServerProcess] = set()
        self._closed = False
        self._lock = threading.Lock()

    def endpoints(self, snapshots: Iterable[Snapshot]) -> dict[Snapshot, StaticEndpoint]:
        """An endpoint for each snapshot, starting (in parallel) those not running yet. Raises RuntimeError."""
        wanted = list(dict.fromkeys(snapshots))
        with self._lock:
            missing = [s for s in wanted if s not in self._running]
            now = time.monotonic()
            self._used_at.update({s: now for s in wanted})
        self._make_room(len(missing), keep=set(wanted))
        errors = []
        if missing:
            with ThreadPoolExecutor(len(missing)) as pool:
                futures = {s: pool.submit(self._start, s) for s in missing}
            for snapshot, future in futures.items():
                try:
                    started = future.result()
                except RuntimeError as exc:
                    errors.append(exc)
                    continue
                with self._lock:  # kept even if another failed: `close` stops it
                    self._running[snapshot] = started
                    closed = self._closed
                if closed:  # closed while it booted
                    self.stop(snapshot)
                    errors.append(RuntimeError(f"could not serve {snapshot.name}: the fleet is closed"))
        if errors:
            raise errors[0]
        with self._lock:
            return {s: self._running[s][1] for s in wanted}

    def alive(self, snapshot: Snapshot) -> bool:
        with self._lock:
            entry = self._running.get(snapshot)
        return entry is not None and entry[0].exit_code() is None

    def stop(self, snapshot: Snapshot) -> None:
        with self._lock:
            entry = self._running.pop(snapshot, None)
            self._used_at.pop(snapshot, None)
        if entry is not None:
            entry[0].stop()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            running, booting = list(self._running), list(self._booting)
        for proc in booting:
            proc.kill()
        with ThreadPoolExecutor(max(1, len(running))) as pool:
            list(pool.map(self.stop, running))

    def _make_room(self, starting: int, keep: set[Snapshot]) -> None:
        if self.max_servers is None:
            return
        with self._lock:
            idle = sorted((s for s in self._running if s not in keep), key=lambda s: self._used_at.get(s, 0.0))
            excess = len(self._running) + starting - self.max_servers
        for snapshot in idle[:max(0, excess)]:
            self.stop(snapshot)

    def _start(self, snapshot: Snapshot) -> tuple[ServerProcess, StaticEndpoint]:
        proc = ServerProcess(model=snapshot.model, admin_token=self.token, data_dir=self.log_dir / snapshot.name,
                             log_path=self.log_dir / f"{snapshot.name}.log", static=True,
                             device=self.devices.get(snapshot.server), served_name=snapshot.name,
                             prefix_cache_gb=self.prefix_cache_gb)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"could not serve {snapshot.name}: the fleet is closed")
            self._booting.add(proc.start())
        try:
            proc.wait_healthy()
            _wait_static(proc, self.token)
        except Exception as exc:
            proc.stop()
            why = f"could not serve {snapshot.name} ({snapshot.model}): {exc}; see {proc.log_path}"
            raise RuntimeError(why) from exc
        finally:
            with self._lock:
                self._booting.discard(proc)
        log.info("serving %s (%s) on %s", snapshot.name, snapshot.model, proc.url)
        endpoint = StaticEndpoint(snapshot.name, base_url=proc.url + "/v1", model=snapshot.name,
                            policy_version=snapshot.version,
                            snapshot_of=snapshot.server if snapshot.trainable else None)
        return proc, endpoint


def _wait_static(proc: ServerProcess, token: str) -> None:
    """Until the static server has loaded its model. Raises as soon as it died or its boot failed (a server killed
    by `StaticFleet.close` fails within `_STATUS_TIMEOUT_S`)."""
    deadline = time.monotonic() + _BOOT_TIMEOUT_S
    with SwarmClient(proc.url, admin_token=token, timeout=_STATUS_TIMEOUT_S) as client:
        while True:
            if proc.exit_code() is not None:
                raise RuntimeError(f"the server {proc.describe_exit()}")
            status = client.status(timeout=_STATUS_TIMEOUT_S)
            if status.state is EngineState.STATIC:
                return
            if status.state is EngineState.OFFLINE:  # it boots at start-up: OFFLINE means the boot failed
                raise RuntimeError(f"its boot failed: {status.last_error or 'no error reported'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not serving after {_BOOT_TIMEOUT_S:g}s (state {status.state.value})")
            time.sleep(0.2)
