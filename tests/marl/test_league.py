"""Past selves as opponents: which snapshots a past_of server serves, and that games record the one that played."""

from __future__ import annotations

import shutil
from collections import Counter

from conftest import LocalServer, trainable
from test_coordinator import episode_rows

from envs.signalling import SignallingGame
from marl.league import SnapshotPool
from marl.league.snapshots import Snapshot, StaticFleet
from marl.runner.endpoints import SnapshotPoolEndpoint, StaticEndpoint
from marl.topology import PastOfSpec
from marl.transaction.coordinator import Coordinator, GameSettings


class FakeFleet:
    """Serves snapshots without processes: what the pool asked for, and when."""

    def __init__(self):
        self.started: list[int] = []
        self.stopped: list[int] = []
        self.running: set[Snapshot] = set()

    def endpoints(self, snapshots):
        out = {}
        for snapshot in snapshots:
            self.running.add(snapshot)
            self.started.append(snapshot.version)
            out[snapshot] = StaticEndpoint(snapshot.name, base_url="http://127.0.0.1:9/v1", model=snapshot.name,
                                     policy_version=snapshot.version, snapshot_of=snapshot.server)
        return out

    def alive(self, snapshot):
        return snapshot in self.running

    def stop(self, snapshot):
        if snapshot in self.running:
            self.running.discard(snapshot)
            self.stopped.append(snapshot.version)

    def close(self):
        for snapshot in list(self.running):
            self.stop(snapshot)


def checkpoint(run_dir, step: int, model=None):
    """A checkpoint of the learner: an empty dir, or a copy of `model` renamed into place (as servers save them)."""
    path = run_dir / "servers" / "learner" / "checkpoints" / f"step_{step:06d}"
    if model is None:
        path.mkdir(parents=True)
    else:
        shutil.copytree(model, path.with_name(f".{path.name}.tmp"))
        path.with_name(f".{path.name}.tmp").rename(path)
    return path


def pool_of(run_dir, fleet, pool="latest", k=2, seed=0) -> SnapshotPool:
    return SnapshotPool("past_learner", PastOfSpec(server="learner", pool=pool, k=k), base_model="base",
                        run_dir=run_dir, fleet=fleet, seed=seed)


def test_latest_pool_serves_the_newest_and_stops_a_snapshot_only_once_no_game_holds_it(tmp_path):
    fleet = FakeFleet()
    pool = pool_of(tmp_path, fleet)
    pool.refresh()
    assert pool.versions() == [0]  # the initial model before any checkpoint
    checkpoint(tmp_path, 1)
    pool.refresh()
    assert pool.versions() == [0, 1]
    checkpoint(tmp_path, 2)
    pool.refresh()
    assert pool.versions() == [1, 2] and fleet.stopped == [0]
    game = pool.draw()
    held = game.__enter__()
    while held.policy_version != 1:  # a game that drew v1 and is still playing
        game.__exit__(None, None, None)
        game = pool.draw()
        held = game.__enter__()
    checkpoint(tmp_path, 3)
    pool.refresh()
    assert pool.versions() == [2, 3] and fleet.stopped == [0]  # v1 left the pool but still plays its game
    game.__exit__(None, None, None)
    pool.refresh()
    assert fleet.stopped == [0, 1]
    # a snapshot server that dies comes back while its checkpoint exists, and is dropped once it was pruned
    fleet.running = {s for s in fleet.running if s.version != 3}
    pool.refresh()
    assert pool.versions() == [2, 3] and fleet.started.count(3) == 2
    shutil.rmtree(checkpoint_path := tmp_path / "servers" / "learner" / "checkpoints" / "step_000002")
    fleet.running = {s for s in fleet.running if s.version != 2}
    pool.refresh()
    assert pool.versions() == [3] and not checkpoint_path.exists()
    assert Counter(pool.draw().__enter__().policy_version for _ in range(20)) == {3: 20}


def test_uniform_pool_keeps_a_uniform_sample_of_every_snapshot_seen(tmp_path):
    runs = []
    for steps in range(6):  # runs[i]: checkpoints of steps 1..i
        runs.append(tmp_path / f"run{steps}")
        for step in range(1, steps + 1):
            checkpoint(runs[-1], step)
    kept = Counter()
    trials = 400
    for seed in range(trials):
        fleet = FakeFleet()
        pool = pool_of(runs[0], fleet, pool="uniform", k=2, seed=seed)
        for run_dir in runs:  # checkpoints 1..5 appear one by one
            pool.run_dir = run_dir
            pool.refresh()
        assert len(pool.versions()) == 2 and len(fleet.started) <= 2 + 4  # at most one new server per checkpoint
        kept.update(pool.versions())
    assert sorted(kept) == [0, 1, 2, 3, 4, 5]
    for version, count in kept.items():  # each of the 6 snapshots is kept with probability 2/6
        assert abs(count / trials - 1 / 3) < 0.1, (version, count)


def test_a_past_checkpoint_opponent_is_served_and_recorded(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    checkpoint(run_dir, 1, tiny_model)
    fleet = StaticFleet(tmp_path / "logs", token="-test-token", devices={"learner": "cpu"})
    pool = SnapshotPool("past_learner", PastOfSpec(server="learner", pool="latest", k=1), base_model=str(tiny_model),
                        run_dir=run_dir, fleet=fleet).start()
    try:
        assert pool.versions() == [1]
        with LocalServer(tiny_model, tmp_path / "learner") as learner:
            coordinator = Coordinator(
                env_factory=lambda: SignallingGame(num_items=3),
                role_servers={"speaker": "learner", "listener": "past_learner"},
                endpoints={"learner": trainable("learner", learner.url, batch_size=100),
                           "past_learner": SnapshotPoolEndpoint("past_learner", snapshots=pool)},
                settings=GameSettings(max_tokens=6))
            assert coordinator.linked == ["learner"]
            first = [coordinator.play_game(f"t-{i}", i) for i in range(2)]
            checkpoint(run_dir, 2, tiny_model)  # the learner saved a new checkpoint: the pool moves on
            pool.refresh()
            assert pool.versions() == [2] and not fleet.alive(Snapshot("learner", 1, str(run_dir / "servers" /
                                                                        "learner" / "checkpoints" / "step_000001")))
            second = coordinator.play_game("t-2", 2)
            coordinator.close()
        rows = episode_rows(tmp_path / "learner")
    finally:
        pool.close()
    for record, version in [*((r, 1) for r in first), (second, 2)]:
        past = {"server": "past_learner", "policy_version": version, "snapshot_of": "learner"}
        assert record.co_players["listener"].model_dump() == past
        metadata, _ = rows[record.episodes["learner"]]
        assert metadata["co_players"]["listener"] == past  # the learner's samples say whom they played against
        assert record.replies["listener"] >= 1  # the snapshot did play
