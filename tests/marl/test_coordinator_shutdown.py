"""A run that gives up on a dead server exits in bounded time, and loses no game it acknowledged: the two-phase
commit stops retrying the dead server soon after the run stops, and the decision log re-drives what is left."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import ADMIN, trainable
from stubs import recorded_episodes, stub_server

from envs.signalling import SignallingGame
from marl.games.schedule import play_games
from marl.transaction.coordinator import Coordinator, GameSettings
from marl.transaction.decision_log import Decision, DecisionLog
from marl.transaction.two_phase import redrive

pytestmark = pytest.mark.timeout(240)

ROLES = {"speaker": "speaker_model", "listener": "listener_model"}


def test_a_run_whose_server_died_mid_commit_exits_soon_and_the_log_redrives_the_game(tiny_model, tmp_path):
    decisions = DecisionLog(tmp_path / "decisions.sqlite")
    stop = threading.Event()
    b_data = tmp_path / "b"
    with stub_server(tiny_model, tmp_path / "a") as a:
        b_context = stub_server(tiny_model, b_data)
        b = b_context.__enter__()
        b_port = int(b.url.rsplit(":", 1)[1])
        endpoints = {"speaker_model": trainable("speaker_model", a.url, batch_size=100),
                     "listener_model": trainable("listener_model", b.url, batch_size=100)}
        client_b = endpoints["listener_model"].client
        real_commit = client_b.commit_episode

        def b_dies_before_its_commit(episode_id: str, **kwargs):
            b_context.__exit__(None, None, None)  # the server is gone: nothing answers on its port
            stop.set()  # and the run gives up on it (a supervisor's `fatal`, a game failing max_failures times)
            return real_commit(episode_id, **kwargs)

        client_b.commit_episode = b_dies_before_its_commit
        coordinator = Coordinator(env_factory=lambda: SignallingGame(num_items=3), role_servers=ROLES,
                                  endpoints=endpoints, settings=GameSettings(max_tokens=4, lease_timeout_s=60),
                                  decisions=decisions)
        try:
            started = time.monotonic()
            stats = play_games(coordinator, [("t-0", 0)], concurrency=1, games=1, should_stop=stop.is_set)
            stopped = time.monotonic() - started
        finally:
            coordinator.close()
        print(f"the run stopped {stopped:.1f}s after it began (its server died in the commit)")
        assert stopped < 30, f"the run took {stopped:.1f}s to stop after its server died"
        assert stats.games == 1  # COMMIT was decided: the game counts, and its log entry is not done
        (game,) = decisions.unfinished()
        assert game.decision is Decision.COMMIT
        with stub_server(tiny_model, b_data, port=b_port):  # b is back: the re-drive gives it its episode
            outcome = redrive(decisions, ADMIN)
        assert sorted(outcome[game.game_id].acknowledged) == ["listener_model", "speaker_model"]
        assert decisions.unfinished() == []
        for data_dir in (tmp_path / "a", b_data):  # the game's episode is in both pools: nothing acknowledged lost
            assert [e["task_id"] for e in recorded_episodes(data_dir)] == ["t-0"]
    decisions.close()
