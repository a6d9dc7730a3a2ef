"""`play_games`: a user's callback that raises is never lost, and the old API (`marl.coordinator.play_games`, the
two-argument `on_result`) still works, with a DeprecationWarning.

The games are real (the coordinator, the table, the signalling env); their roles are scripted, so no server is
needed to show what `play_games` does with its callbacks. `marl run` itself is run as a subprocess.
"""

from __future__ import annotations

import threading
from itertools import islice

import pytest
import yaml

from envs.base import TextAECEnv
from envs.signalling import SignallingGame
from marl.games.record import GameRecord
from marl.games.schedule import CallbackFailed, FailedAttempt, RunStats, episodes, play_games, tasks
from marl.transaction.coordinator import Coordinator, GameFailed

SCRIPTED = {"speaker": None, "listener": None}


class ScriptlessSignalling(SignallingGame):
    """Every game fails: the scripted speaker has no move for its free-text turn."""

    scripted_action = TextAECEnv.scripted_action


@pytest.fixture
def coordinator():
    coordinator = Coordinator(env_factory=lambda: SignallingGame(num_items=3), role_servers=SCRIPTED, endpoints={})
    yield coordinator
    coordinator.close()


@pytest.fixture
def failing_coordinator():
    coordinator = Coordinator(env_factory=lambda: ScriptlessSignalling(num_items=3), role_servers=SCRIPTED,
                              endpoints={})
    yield coordinator
    coordinator.close()


class Broken(Exception):
    pass


def test_a_raising_on_result_stops_the_run_and_play_games_raises_it(coordinator):
    seen: list[GameRecord] = []

    def on_result(record: GameRecord) -> None:
        seen.append(record)
        if len(seen) == 3:
            raise Broken("the user's sink is full")

    with pytest.raises(CallbackFailed, match="on_result raised Broken") as caught:
        play_games(coordinator, tasks("t", 1, seed=0), concurrency=2, games=10_000_000, on_result=on_result)
    assert isinstance(caught.value.__cause__, Broken)  # chained: the user's traceback is kept
    assert caught.value.callback == "on_result"
    stats = caught.value.stats
    assert 3 <= stats.games <= 4  # stopped at once: the other worker's game in flight at most, not 10M
    assert len(seen) == stats.games  # games already played still went to on_result
    assert [t.name for t in threading.enumerate() if t.name.startswith("game-")] == []  # no worker left behind


def test_a_raising_on_failure_or_should_stop_stops_the_run_too(coordinator, failing_coordinator):
    def on_failure(attempt: FailedAttempt) -> None:
        raise Broken(f"cannot log {attempt.task_id}")

    with pytest.raises(CallbackFailed, match="on_failure raised Broken") as caught:
        play_games(failing_coordinator, tasks("t", 1, seed=0), concurrency=2, games=10, on_failure=on_failure)
    assert isinstance(caught.value.__cause__, Broken) and caught.value.stats.retried <= 2  # no replays after it

    calls = []

    def should_stop() -> bool:
        calls.append(1)
        if len(calls) > 5:
            raise Broken("the stop file vanished")
        return False

    with pytest.raises(CallbackFailed, match="should_stop raised Broken"):
        play_games(coordinator, tasks("t", 1, seed=0), concurrency=2, games=10_000_000, should_stop=should_stop)


def test_sys_exit_in_a_callback_is_not_swallowed_by_its_thread(coordinator):
    import sys

    with pytest.raises(CallbackFailed, match="on_result raised SystemExit") as caught:
        play_games(coordinator, tasks("t", 1, seed=0), concurrency=2, games=1000,
                   on_result=lambda record: sys.exit(3))
    assert isinstance(caught.value.__cause__, SystemExit) and caught.value.stats.games <= 2


def test_a_finite_schedule_ends_the_run_and_a_list_will_do(coordinator):
    stats = play_games(coordinator, [("a", 1), ("b", 2), ("c", 3)], concurrency=4)
    assert isinstance(stats, RunStats)
    assert sorted(r.task_id for r in stats.results) == ["a", "b", "c"]


def test_marl_runs_schedule_numbers_each_tasks_episodes_and_they_reach_the_records(coordinator):
    assert list(islice(episodes("t", 3, seed=0), 4)) == [("t-0", 0, 0), ("t-0", 0, 1), ("t-0", 0, 2), ("t-1", 1, 0)]
    assert list(islice(tasks("t", 2, seed=0), 3)) == [("t-0", 0), ("t-0", 0), ("t-1", 1)]  # pairs, as before
    stats = play_games(coordinator, episodes("t", 3, seed=0), concurrency=2, games=6)
    assert sorted((r.task_id, r.episode) for r in stats.results) == [(f"t-{t}", e) for t in (0, 1) for e in range(3)]


def test_without_keep_results_a_run_keeps_nothing_per_game(coordinator):
    seen = []
    stats = play_games(coordinator, [(f"t{i}", i) for i in range(20)], concurrency=4, on_result=seen.append,
                       keep_results=False)
    assert stats.games == len(seen) == 20 and stats.results == []


def test_the_old_import_and_the_two_argument_on_result_work_with_warnings(coordinator, failing_coordinator):
    with pytest.warns(DeprecationWarning, match="marl.coordinator.play_games moved to marl.games.schedule.play_games"):
        from marl.coordinator import play_games as old_play_games
    with pytest.warns(DeprecationWarning, match="marl.coordinator.tasks moved"):
        from marl.coordinator import tasks as old_tasks
    assert (old_play_games, old_tasks) == (play_games, tasks)

    calls = []
    with pytest.warns(DeprecationWarning, match=r"f\(result, error\) is deprecated"):
        stats = old_play_games(coordinator, old_tasks("t", 2, seed=0), concurrency=2, games=4,
                               on_result=lambda result, error: calls.append((result, error)))
    assert stats.games == 4 and len(calls) == 4
    assert all(isinstance(result, GameRecord) and error is None for result, error in calls)

    failures = []
    with pytest.warns(DeprecationWarning) as warned:  # the old keyword too: max_attempts is now max_failures
        stats = play_games(failing_coordinator, old_tasks("t", 1, seed=0), concurrency=1, games=1, max_attempts=1,
                           on_result=lambda result, error: failures.append((result, error)))
    assert {"on_result", "max_attempts"} <= {word for w in warned for word in ("on_result", "max_attempts")
                                             if word in str(w.message)}
    assert stats.failed == 1 and stats.error is not None
    assert len(failures) == 1 and failures[0][0] is None and isinstance(failures[0][1], GameFailed)


def test_one_argument_callbacks_do_not_warn(coordinator, recwarn):
    class Sink:
        def __init__(self):
            self.records = []

        def record(self, result, note=None):  # a second, optional parameter is still the one-argument shape
            self.records.append(result)

    sink = Sink()
    play_games(coordinator, tasks("t", 1, seed=0), concurrency=1, games=2, on_result=sink.record)
    assert len(sink.records) == 2
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_marl_run_exits_1_with_the_reason_when_its_results_cannot_be_written(tmp_path, monkeypatch, capsys):
    """`marl run`'s on_result writes games.jsonl; here every write fails as on a full disk. Before, each worker died
    with a traceback at its first game and the run exited 0."""
    import marl.runner.run
    from marl.cli import main

    def full_disk(file, record):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(marl.runner.run, "append_game", full_disk)
    topology = {"name": "scripted", "roles": {"speaker": {"scripted": True}, "listener": {"scripted": True}},
                "env": {"class": "envs.signalling:SignallingGame", "args": {"num_items": 3}},
                "run": {"games": 1_000_000, "concurrency": 2, "run_dir": str(tmp_path / "run")}}
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(topology))
    with pytest.raises(SystemExit) as exited:
        main(["run", str(tmp_path / "topology.yaml")])
    output = capsys.readouterr().out
    assert exited.value.code == 1, output
    assert "gave up:" in output and "on_result raised OSError(28, 'No space left on device')" in output, output
    assert "stopped: 0 games" in output  # none recorded, and the summary says so
