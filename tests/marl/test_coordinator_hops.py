"""One hop per question on the coordinator's hot path, over the real server app with stub backends (tests/stubs.py):
a game leases by `begin` alone (the server's answer says when to wait), and commits on the coordinator's one
executor (no thread pool per game)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import trainable
from stubs import stub_server

from envs.signalling import SignallingGame
from marl.protocol import ROUTE_BEGIN, ROUTE_STATUS
from marl.transaction import two_phase
from marl.transaction.coordinator import Coordinator, GameSettings

pytestmark = pytest.mark.timeout(120)

ROLES = {"speaker": "speaker_model", "listener": "listener_model"}


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_games_lease_by_begin_alone_and_commit_on_the_coordinators_executor(tiny_model, tmp_path, monkeypatch):
    pools = []  # thread pools the two-phase commit makes for itself: none, when the coordinator passes its own
    monkeypatch.setattr(two_phase, "ThreadPoolExecutor", lambda *a, **k: pools.append(a) or ThreadPoolExecutor(*a, **k))
    with stub_server(tiny_model, tmp_path / "a") as a, stub_server(tiny_model, tmp_path / "b") as b:
        # b trains after every game, and its step is held: the second game must wait for b
        endpoints = {"speaker_model": trainable("speaker_model", a.url, batch_size=100),
                     "listener_model": trainable("listener_model", b.url, batch_size=1, num_repeat=1)}
        b.backends.step_gate.clear()
        status_reads = a.log.count(ROUTE_STATUS) + b.log.count(ROUTE_STATUS)
        coordinator = Coordinator(env_factory=lambda: SignallingGame(num_items=3), role_servers=ROLES,
                                  endpoints=endpoints, settings=GameSettings(max_tokens=4, lease_timeout_s=60))
        try:
            first = coordinator.play_game("t-0", 0)
            results = []
            second = threading.Thread(target=lambda: results.append(coordinator.play_game("t-1", 1)))
            second.start()
            wait_for(lambda: b.log.count(ROUTE_BEGIN) >= 4, "the second game to be told to wait by b, 3 times")
            # b's answer says "wait"; the game asks b first, alone: no lease held on a meanwhile
            assert a.log.count(ROUTE_BEGIN) <= 2 and coordinator.open_leases() == 0
            b.backends.step_gate.set()
            second.join(60)
            games = [first, *results]
            for _ in range(4):  # more games: still no pool of their own
                games.append(coordinator.play_game(f"t-{len(games)}", len(games)))
        finally:
            coordinator.close()
    assert [g.task_id for g in games] == [f"t-{i}" for i in range(6)]
    assert a.log.count(ROUTE_STATUS) + b.log.count(ROUTE_STATUS) == status_reads  # no status read to lease
    assert pools == []
