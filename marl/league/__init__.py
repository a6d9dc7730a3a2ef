"""A league of past selves: a past_of server is a pool of static servers on past checkpoints of a trainable server.

    servers:
      learner: {model: smollm2-135m, trainable: true, train: {...}}
      past_learner: {past_of: {server: learner, pool: latest, k: 3}}
    roles:
      player_1: {server: learner}
      player_2: {server: past_learner}       # plays against one of learner's past selves each game

Which snapshots a pool serves (the initial model is snapshot 0):
- `latest`: the k newest; each new checkpoint replaces the oldest.
- `uniform`: k drawn uniformly from every snapshot seen so far (a reservoir sample: a new checkpoint replaces a
  random one with probability k / snapshots seen), so old selves stay in the league.
Each game draws one served snapshot uniformly (`draw`); its version is the game's provenance (`co_players` in
games.jsonl and in every trainable server's episode metadata).

The past_of server of a LoRA policy (`past_of: {server: team, policy: speaker}`) plays that policy's checkpoints
(adapters), which `team` serves itself as frozen policies (`speaker@3`, on the engine it already runs: no process and
no model of their own; marl/league/frozen_fleet.py); everything below holds for it with "loaded" for "started".

A thread polls the trainable server's checkpoint directory every `poll_s`. A new snapshot is started and booted
before it joins the pool (games never wait for it); one that leaves is stopped once no game holds it. The pool serves
before the first game: the initial model, plus the newest checkpoints of a resumed run. A snapshot server that dies
is started again while its checkpoint exists (checkpoints are pruned to `train.keep_checkpoints`), else dropped.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from marl.league.frozen_fleet import FrozenFleet
from marl.league.snapshots import Snapshot, StaticFleet, snapshots_on_disk
from marl.runner.endpoints import StaticEndpoint
from marl.topology import PastOfSpec, Topology

log = logging.getLogger("marl.league")

_MAX_START_FAILURES = 3  # a snapshot that fails to start this often is dropped from the pool


@dataclass
class _Served:
    snapshot: Snapshot
    endpoint: StaticEndpoint
    users: int = 0  # games holding it


class SnapshotPool:
    """The snapshots one past_of server serves; `draw()` one per game (a
    `marl.transaction.coordinator.SnapshotSource`)."""

    def __init__(self, name: str, spec: PastOfSpec, *, base_model: str, run_dir: Path, fleet: StaticFleet | FrozenFleet,
                 seed: int = 0, poll_s: float = 2.0, base_revision: str | None = None):
        self.name, self.spec, self.base_model, self.run_dir, self.fleet = name, spec, base_model, Path(run_dir), fleet
        self.base_revision = base_revision  # of a base model given by its Hugging Face id
        self.poll_s = poll_s
        self._draws = random.Random(f"{seed}-{name}-draws")
        self._reservoir = random.Random(f"{seed}-{name}-reservoir")
        self._seen: set[int] = set()
        self._chosen: list[int] = []  # the versions to serve
        self._failures: Counter[int] = Counter()
        self._serving: dict[int, _Served] = {}
        self._leaving: dict[int, _Served] = {}
        self._lock = threading.Lock()  # what games read: the served snapshots and their users
        self._refreshing = threading.Lock()  # one refresh at a time (the thread's, or a caller's)
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> SnapshotPool:
        """Serve the first snapshots (blocking), then follow new checkpoints in the background."""
        self.refresh()
        if not self._serving:
            raise RuntimeError(f"past_of server {self.name} could not serve any snapshot of {self.spec.server}")
        self._thread = threading.Thread(target=self._follow, name=f"league-{self.name}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        self.fleet.close()  # first: a snapshot still booting in `refresh` is stopped, not waited for
        if self._thread is not None:
            self._thread.join(timeout=60)

    @contextlib.contextmanager
    def draw(self) -> Iterator[StaticEndpoint]:
        """One served snapshot, uniformly; it keeps serving until the block exits."""
        with self._lock:
            if not self._serving:
                raise RuntimeError(f"past_of server {self.name} serves no snapshot")
            served = self._draws.choice(list(self._serving.values()))
            served.users += 1
        try:
            yield served.endpoint
        finally:
            with self._lock:
                served.users -= 1

    def versions(self) -> list[int]:
        """The versions served now."""
        with self._lock:
            return sorted(self._serving)

    def refresh(self) -> None:
        """One pass: take in new checkpoints, restart dead snapshot servers, serve the chosen, stop the left."""
        with self._refreshing:
            on_disk = snapshots_on_disk(self.run_dir, self.spec.server, self.base_model, self.spec.policy,
                                        revision=self.base_revision)
            self._choose(sorted(set(on_disk) - self._seen))
            self._drop_dead(on_disk)
            for version in [v for v in self._chosen if v not in self._serving]:
                self._serve(version, on_disk)
            self._retire()

    def _follow(self) -> None:
        while not self._closed.wait(self.poll_s):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - the pool keeps serving what it has; the next pass tries again
                log.exception("past_of server %s: refreshing its snapshots failed", self.name)

    def _choose(self, new_versions: list[int]) -> None:
        for version in new_versions:
            self._seen.add(version)
            if self.spec.pool == "latest":
                self._chosen = sorted([*self._chosen, version])[-self.spec.k:]
            elif len(self._chosen) < self.spec.k:
                self._chosen.append(version)
            else:  # reservoir sampling: every version seen is in the pool with probability k / seen
                slot = self._reservoir.randrange(len(self._seen))
                if slot < self.spec.k:
                    self._chosen[slot] = version

    def _drop_dead(self, on_disk: dict[int, Snapshot]) -> None:
        with self._lock:
            dead = [v for v, served in self._serving.items() if not self.fleet.alive(served.snapshot)]
            gone = [self._serving.pop(v) for v in dead]
        for served in gone:
            log.warning("past_of server %s: the server of %s died", self.name, served.snapshot.name)
            self.fleet.stop(served.snapshot)
            if served.snapshot.version not in on_disk and served.snapshot.version in self._chosen:
                self._chosen.remove(served.snapshot.version)  # its checkpoint was pruned: it cannot come back

    def _serve(self, version: int, on_disk: dict[int, Snapshot]) -> None:
        if version not in on_disk:
            self._chosen.remove(version)
            return
        snapshot = on_disk[version]
        try:
            endpoint = self.fleet.endpoints([snapshot])[snapshot]
        except RuntimeError as exc:
            if self._closed.is_set():
                return
            self._failures[version] += 1
            log.warning("past_of server %s: %s (attempt %d)", self.name, exc, self._failures[version])
            pruned = version != 0 and not Path(snapshot.adapter or snapshot.model).exists()
            if self._failures[version] >= _MAX_START_FAILURES or pruned:
                self._chosen.remove(version)  # broken, or pruned while it booted: newer checkpoints take its place
            return
        with self._lock:
            self._serving[version] = _Served(snapshot, endpoint)
        log.info("past_of server %s now serves %s", self.name, snapshot.name)

    def _retire(self) -> None:
        with self._lock:
            replaced = [v for v in self._serving if v not in self._chosen]
            if any(v in self._serving for v in self._chosen):  # else none of the chosen serves yet: keep the old
                for version in replaced:
                    self._leaving[version] = self._serving.pop(version)
            idle = [self._leaving.pop(v) for v, served in list(self._leaving.items()) if served.users == 0]
        for served in idle:
            self.fleet.stop(served.snapshot)


def snapshot_pools(topology: Topology, run_dir: Path, token: str, *, seed: int = 0,
                   url_of: Callable[[str], str] | None = None) -> dict[str, SnapshotPool]:
    """A pool (not started yet) for every past_of server of the topology; logs go to `<run_dir>/logs/<name>/`.
    `url_of(server)`: where a local server listens, read when a pool of its LoRA policy loads a snapshot there."""
    pools = {}
    for name, past_of in topology.past_of_servers().items():
        spec, source = topology.spec.servers[name], topology.spec.servers[past_of.server]
        fleet: StaticFleet | FrozenFleet
        if past_of.policy is not None:
            if url_of is None:
                raise ValueError(f"past_of server {name} plays policy {past_of.policy} of {past_of.server}: give"
                                 " url_of, where that server listens")
            fleet = FrozenFleet(functools.partial(url_of, past_of.server), token=token)
        else:
            fleet = StaticFleet(Path(run_dir) / "logs" / name, token=token,
                                devices={past_of.server: spec.device or source.device},
                                prefix_cache_gb=spec.prefix_cache_gb)
        pools[name] = SnapshotPool(name, past_of, base_model=source.model, base_revision=source.revision,
                                   run_dir=run_dir, fleet=fleet, seed=seed)
    return pools
