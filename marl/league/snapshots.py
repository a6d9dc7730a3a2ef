"""Snapshots: a learner's weights at one policy version, and the static `marl serve` processes that serve them.

A snapshot is what `marl serve --model X --static` loads: a server's base model (policy version 0, `initial`), or a
checkpoint that a local trainable server wrote into its data dir, `<run_dir>/servers/<server>/checkpoints/step_N/`
with N zero-padded to 6 digits (a Hugging Face model dir holding policy version N; servers/training/checkpoint_dirs.py
renames it into place only once complete). The paths are re-derived here, not imported: marl/ reaches servers over HTTP
only.

A LoRA policy of a server (the learner `server.policy`) checkpoints into
`<run_dir>/servers/<server>/policies/<policy>/checkpoints/step_N/`, whose `adapter/` (PEFT's format) is served on the
server's base model (`marl serve --static --model BASE --adapter DIR`). Its `initial` is the base model alone: a new
adapter's B is zero, so it changes nothing.

Used by `marl eval` and `run.eval_every` (marl/eval/) and by past_of servers (marl/league/__init__.py; the snapshots of
a LoRA policy are served by its own server instead, as frozen policies: marl/league/frozen_fleet.py).
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
from marl.protocol import EngineState
from marl.runner.endpoints import StaticEndpoint
from marl.runner.launch import ServerProcess
from marl.topology import ServerKind, Topology
from marl.topology.graph import LEARNER_SEPARATOR

log = logging.getLogger("marl.league.snapshots")

INITIAL, LATEST = "initial", "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# in a policy's checkpoint (as servers/trainers/lora_grpo.py writes it)
_ADAPTER_DIR, _ADAPTER_CONFIG = "adapter", "adapter_config.json"
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
    policy: str | None = None  # the server's LoRA policy whose weights these are; None: the server's own
    adapter: str | None = None  # what `marl serve --adapter` applies to `model`: the policy's adapter dir (None: none)
    revision: str | None = None  # `marl serve --revision`: the base model's, when a Hugging Face id names it

    @property
    def learner(self) -> str:
        """The server, or `server.policy`: two policies of one server are two players, so names and labels differ."""
        return self.server if self.policy is None else f"{self.server}{LEARNER_SEPARATOR}{self.policy}"

    @property
    def label(self) -> str:
        if self.version is None:
            return _checkpoint_dir(Path(self.adapter or self.model)).name
        return INITIAL if self.version == 0 else f"v{self.version}"

    @property
    def name(self) -> str:
        """Its endpoint's name and served model name, e.g. `speaker_model@v5`, `team.speaker@v5`."""
        return f"{self.learner}@{self.label}"

    def describe(self) -> str:
        """What it serves, for logs and errors: the model, and the adapter on it."""
        return self.model if self.adapter is None else f"{self.model} + adapter {self.adapter}"


def _checkpoint_dir(path: Path) -> Path:
    """The checkpoint a path names: an adapter's `step_N/adapter` is `step_N`."""
    return path.parent if path.name == _ADAPTER_DIR else path


def checkpoints_root(run_dir: Path, server: str, policy: str | None = None) -> Path:
    """Where local trainable server `server` (or its LoRA policy `policy`) keeps its checkpoints."""
    server_dir = Path(run_dir) / "servers" / server
    return (server_dir if policy is None else server_dir / "policies" / policy) / "checkpoints"


def checkpoints_of(run_dir: Path, server: str, policy: str | None = None) -> dict[int, Path]:
    """The complete checkpoints of local trainable server `server` of the run in `run_dir`, or of its LoRA policy
    `policy`: step -> directory (a policy's holds its adapter in `adapter/`)."""
    root = checkpoints_root(run_dir, server, policy)
    if not root.is_dir():
        return {}
    found = {int(m.group(1)): p for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))}
    return dict(sorted(found.items()))


def snapshots_on_disk(run_dir: Path, server: str, base_model: str, policy: str | None = None, *,
                      revision: str | None = None) -> dict[int, Snapshot]:
    """Every snapshot of local trainable server `server` (or of its LoRA policy `policy`) the run directory holds:
    version 0 (the base model, at `revision`; a policy's fresh adapter adds nothing to it), then each complete
    checkpoint."""
    found = {0: Snapshot(server, 0, base_model, policy=policy, revision=revision)}
    for version, path in checkpoints_of(run_dir, server, policy).items():
        found[version] = (Snapshot(server, version, str(path)) if policy is None else
                          Snapshot(server, version, base_model, policy=policy, adapter=str(path / _ADAPTER_DIR),
                                   revision=revision))
    return found


def checkpoint_source(topology: Topology, server: str) -> str:
    """The learner whose checkpoints `server` plays: a past_of server's source (`server.policy` for a LoRA policy),
    else the server itself."""
    past_of = topology.spec.servers[server].past_of
    if past_of is None:
        return server
    return past_of.server if past_of.policy is None else f"{past_of.server}{LEARNER_SEPARATOR}{past_of.policy}"


def role_checkpoints(topology: Topology, role: str) -> str:
    """The learner whose checkpoints `role` plays: its own (a server, or `server.policy` for a role of a LoRA
    policy), or a past_of server's source (a server, or `server.policy`)."""
    server = topology.server_of(role)
    if server is not None and topology.spec.servers[server].past_of is not None:
        return checkpoint_source(topology, server)
    learner = topology.learner_of(role)
    assert learner is not None, f"role {role} is scripted: it plays no checkpoints"
    return learner


def resolve_snapshot(topology: Topology, run_dir: Path, learner: str, ref: str, *,
                     latest_may_be_initial: bool = False) -> Snapshot:
    """The snapshot `ref` names for learner `learner` (a trainable server, or `server.policy`): `initial`, `latest`
    (the newest checkpoint), a step (`5`, `v5`, `step_5`), or a checkpoint directory (a path; of a policy: its
    checkpoint or its adapter directory). Raises `SnapshotError`, also for `latest` without a checkpoint (a wrong run
    directory must not play the initial model as if trained) unless `latest_may_be_initial` (a run's own evaluation
    before its first checkpoint)."""
    server, policy = topology.learners().get(learner, (learner, None))
    spec = topology.spec.servers[server]
    if spec.policies and policy is None:
        raise SnapshotError(f"servers.{server} trains LoRA policies, each its own checkpoints: name one of"
                            f" {', '.join(f'{server}{LEARNER_SEPARATOR}{p}' for p in spec.policies)}")
    who = f"servers.{server}" + (f".policies.{policy}" if policy is not None else "")
    if "/" in ref or ref.startswith((".", "~")):
        return _snapshot_at(Path(ref).expanduser(), ref, server, policy, spec.model or "", spec.revision)
    initial = Snapshot(server, 0, spec.model or "", policy=policy, revision=spec.revision)
    if ref == INITIAL:
        if not spec.model:
            raise SnapshotError(f"servers.{server} names no model: give its initial weights as a directory")
        return initial
    if spec.kind is not ServerKind.LOCAL_TRAINABLE:
        raise SnapshotError(f"servers.{server} is a {spec.kind.value} server: only local trainable servers keep"
                            f" checkpoints in the run directory; give a checkpoint directory instead of {ref!r}")
    found = checkpoints_of(run_dir, server, policy)
    match = _VERSION.match(ref)
    if ref != LATEST and match is None:
        raise SnapshotError(f"{ref!r} is not a checkpoint: give initial, latest, a step (5, v5) or a directory")
    if ref == LATEST and not found and not latest_may_be_initial:
        root = checkpoints_root(run_dir, server, policy)
        raise SnapshotError(f"{who} has no checkpoint in {root}{'' if root.is_dir() else ' (no such directory)'}, so"
                            " there is no latest: is the run directory right (run.run_dir, or --run-dir)? Ask for"
                            " initial (ROLE=initial) to play the untrained model")
    version = (max(found) if found else 0) if ref == LATEST else int(match.group(1))
    if version == 0:
        return initial
    if version not in found:
        have = ", ".join(map(str, found)) or "none"
        raise SnapshotError(f"{who} has no checkpoint of step {version} in {checkpoints_root(run_dir, server, policy)}"
                            f" (steps kept: {have}; also initial). Checkpoints are kept every train.save_freq steps,"
                            " the newest train.keep_checkpoints of them")
    if policy is None:
        return Snapshot(server, version, str(found[version]))
    return Snapshot(server, version, spec.model or "", policy=policy, adapter=str(found[version] / _ADAPTER_DIR),
                    revision=spec.revision)


def _snapshot_at(path: Path, ref: str, server: str, policy: str | None, base_model: str,
                 revision: str | None) -> Snapshot:
    """The snapshot of a checkpoint directory given by path; a policy's is its checkpoint or its adapter dir."""
    if not path.is_dir():
        raise SnapshotError(f"{ref}: no such checkpoint directory")
    step = _STEP_DIR.match(_checkpoint_dir(path).name)
    version = int(step.group(1)) if step else None
    if policy is None:
        return Snapshot(server, version, str(path))
    adapter = path if (path / _ADAPTER_CONFIG).is_file() else path / _ADAPTER_DIR
    if not (adapter / _ADAPTER_CONFIG).is_file():
        raise SnapshotError(f"{ref}: not a LoRA adapter checkpoint of policy {policy} (no {_ADAPTER_CONFIG} in it"
                            f" or in its {_ADAPTER_DIR}/)")
    return Snapshot(server, version, base_model, policy=policy, adapter=str(adapter), revision=revision)


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
                             prefix_cache_gb=self.prefix_cache_gb, revision=snapshot.revision,
                             adapter=Path(snapshot.adapter) if snapshot.adapter else None)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"could not serve {snapshot.name}: the fleet is closed")
            self._booting.add(proc.start())
        try:
            proc.wait_healthy()
            _wait_static(proc, self.token)
        except Exception as exc:
            proc.stop()
            why = f"could not serve {snapshot.name} ({snapshot.describe()}): {exc}; see {proc.log_path}"
            raise RuntimeError(why) from exc
        finally:
            with self._lock:
                self._booting.discard(proc)
        log.info("serving %s (%s) on %s", snapshot.name, snapshot.describe(), proc.url)
        endpoint = StaticEndpoint(snapshot.name, base_url=proc.url + "/v1", model=snapshot.name,
                                  policy_version=snapshot.version,
                                  snapshot_of=snapshot.learner if snapshot.trainable else None)
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
