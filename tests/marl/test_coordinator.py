"""The coordinator over real servers with tiny models: linked episodes, crash handling, backpressure."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from conftest import ADMIN, LocalServer, admin_http, ledger_samples, server_process, trainable, wait_state

from envs.signalling import SignallingGame
from marl import SwarmClient, TrainConfig
from marl.games.schedule import play_games, tasks
from marl.runner.endpoints import StaticEndpoint, TrainableEndpoint
from marl.runner.launch import free_port
from marl.runner.server_watch import ServerMonitor
from marl.transaction.coordinator import Coordinator, GameFailed, GameSettings, linked_servers_of

SETTINGS = GameSettings(max_tokens=6, lease_timeout_s=60)
ROLES = {"speaker": "speaker_model", "listener": "listener_model"}


def episodes(data_dir) -> list[tuple]:
    """(episode_id, task_id, agent, reward) of every sample in a server's ledger."""
    return ledger_samples(data_dir)


def pool(url: str) -> dict:
    with admin_http(url) as http:
        return http.get("/control/pool").json()


def play(coordinator: Coordinator, games: int, concurrency: int = 2, repeats: int = 2, **kw):
    return play_games(coordinator, tasks("t", repeats, seed=0), concurrency=concurrency, games=games, **kw)


def test_three_servers_each_get_exactly_their_roles_episodes(tiny_model, tmp_path):
    with LocalServer(tiny_model, tmp_path / "a") as a, LocalServer(tiny_model, tmp_path / "b") as b, \
            LocalServer(tiny_model, tmp_path / "c", static=True) as c:
        with admin_http(c.url) as http:
            wait_state(http, "STATIC")
        coordinator = Coordinator(
            env_factory=lambda: SignallingGame(num_items=3, observers=1),
            role_servers={**ROLES, "observer": "frozen"},
            endpoints={"speaker_model": trainable("speaker_model", a.url),
                       "listener_model": trainable("listener_model", b.url),
                       "frozen": StaticEndpoint("frozen", base_url=c.url + "/v1", model="tiny")},
            settings=SETTINGS)
        stats = play(coordinator, games=8, concurrency=3)
        coordinator.close()
        assert stats.failed == 0 and stats.games == len(stats.results) == 8
        for server, role, data in (("speaker_model", "speaker", "a"), ("listener_model", "listener", "b")):
            by_episode = {r.episodes[server]: r for r in stats.results}
            rows = episodes(tmp_path / data)
            assert {episode for episode, *_ in rows} == set(by_episode)  # exactly the games' episodes
            for episode, task, agent, reward in rows:
                assert agent == role  # only the calls of its own role
                assert (task, reward) == (by_episode[episode].task_id, by_episode[episode].role_rewards[role])
        tasks_a = Counter(task for _, task in {(e, t) for e, t, *_ in episodes(tmp_path / "a")})
        tasks_b = Counter(task for _, task in {(e, t) for e, t, *_ in episodes(tmp_path / "b")})
        assert tasks_a == tasks_b and sum(n == 2 for n in tasks_a.values()) >= 4  # groups line up across servers
        assert pool(a.url)["running_leases"] == pool(b.url)["running_leases"] == 0


class _PausingGame(SignallingGame):
    """Signals once the speaker has acted (leases are held), then waits until the test lets it go on."""

    acted = threading.Event()
    proceed = threading.Event()

    def _apply(self, agent, action):
        super()._apply(agent, action)
        if agent == "speaker" and not _PausingGame.acted.is_set():
            _PausingGame.acted.set()
            _PausingGame.proceed.wait(60)


def test_server_killed_mid_game_aborts_the_other_leases_and_is_used_again_after_restart(tiny_model, tmp_path):
    with LocalServer(tiny_model, tmp_path / "a") as a, server_process(tiny_model, tmp_path / "b") as (b, b_url):
        coordinator = Coordinator(env_factory=lambda: _PausingGame(num_items=3), role_servers=ROLES,
                                  endpoints={"speaker_model": trainable("speaker_model", a.url),
                                             "listener_model": trainable("listener_model", b_url)},
                                  settings=GameSettings(max_tokens=6, lease_timeout_s=120))
        outcome: list = []
        game = threading.Thread(target=lambda: outcome.append(_try(coordinator.play_game, "t-0", 0)))
        game.start()
        assert _PausingGame.acted.wait(60)
        assert pool(a.url)["running_leases"] == 1 and coordinator.open_leases() == 2
        b.kill()  # SIGKILL the listener's server while the game holds leases on both
        _PausingGame.proceed.set()
        game.join(60)
        assert isinstance(outcome[0], GameFailed)
        assert pool(a.url)["running_leases"] == 0 and pool(a.url)["requeued"] == 1  # the other lease was aborted
        assert coordinator.open_leases() == 0

        # Keeps going: games wait for the dead server without holding leases on the live one ...
        waiting = threading.Thread(target=lambda: outcome.append(play(coordinator, games=4)))
        waiting.start()
        time.sleep(3)
        assert pool(a.url)["running_leases"] == 0
        # ... and use it again once it is back (the coordinator restarts its engine).
        with server_process(tiny_model, tmp_path / "b") as (_, new_url):
            coordinator.endpoints["listener_model"].client = SwarmClient(new_url, admin_token=ADMIN)
            waiting.join(180)
            stats = outcome[1]
            assert stats.games == 4 and stats.error is None
            assert pool(a.url)["running_leases"] == pool(new_url)["running_leases"] == 0
        coordinator.close()


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc


def test_weight_sync_on_one_server_does_not_expire_leases_on_the_other(tiny_model, tmp_path):
    with LocalServer(tiny_model, tmp_path / "a") as a, LocalServer(tiny_model, tmp_path / "b") as b:
        # a trains after every 2 games, slowly (many PPO epochs); b never trains and expires idle leases after 2 s
        coordinator = Coordinator(
            env_factory=lambda: SignallingGame(num_items=3), role_servers=ROLES,
            endpoints={"speaker_model": trainable("speaker_model", a.url, batch_size=1, ppo_epochs=60),
                       "listener_model": trainable("listener_model", b.url, batch_size=100, lease_patience_s=2)},
            settings=SETTINGS)
        stats = play(coordinator, games=8, concurrency=4)
        coordinator.close()
        with admin_http(a.url) as http:
            assert http.get("/control/status").json()["policy_version"] >= 2  # a did sync weights, repeatedly
        assert stats.failed == 0 and stats.games == 8
        assert pool(b.url)["expired"] == 0  # no lease on b was left waiting while a was syncing


class _SlowListenerGame(SignallingGame):
    """The listener thinks for 4 s after the speaker spoke: longer than the speaker's lease patience (1.5 s)."""

    def _apply(self, agent, action):
        super()._apply(agent, action)
        if agent == "speaker":
            time.sleep(4)


def test_a_role_waiting_longer_than_its_lease_patience_keeps_its_lease(tiny_model, tmp_path):
    with LocalServer(tiny_model, tmp_path / "a") as a, LocalServer(tiny_model, tmp_path / "b") as b:
        coordinator = Coordinator(env_factory=lambda: _SlowListenerGame(num_items=3), role_servers=ROLES,
                                  endpoints={"speaker_model": trainable("speaker_model", a.url, lease_patience_s=1.5),
                                             "listener_model": trainable("listener_model", b.url)},
                                  settings=SETTINGS)
        try:
            result = coordinator.play_game("slow-0", 0)  # would fail at commit if the speaker's lease expired
        finally:
            coordinator.close()
        assert pool(a.url)["expired"] == 0 and pool(a.url)["pending_episodes"] == 1
        assert [episode for episode, *_ in episodes(tmp_path / "a")] == [result.episodes["speaker_model"]]


# --- many games: exactly `games`, a bounded failure budget, a prompt stop -----------------------------------------


def test_games_is_the_number_of_games_played_even_with_more_workers(tiny_model, tmp_path):
    with LocalServer(tiny_model, tmp_path / "a") as a, LocalServer(tiny_model, tmp_path / "b") as b:
        coordinator = Coordinator(env_factory=lambda: SignallingGame(num_items=3), role_servers=ROLES,
                                  endpoints={"speaker_model": trainable("speaker_model", a.url, batch_size=100),
                                             "listener_model": trainable("listener_model", b.url, batch_size=100)},
                                  settings=SETTINGS)
        reported = []
        stats = play(coordinator, games=2, concurrency=8, on_result=reported.append)
        coordinator.close()
        assert stats.games == len(stats.results) == len(reported) == 2 and stats.failed == 0
        for data in ("a", "b"):
            assert len({episode for episode, *_ in episodes(tmp_path / data)}) == 2  # no game beyond the 2 asked


class _BrokenGame(SignallingGame):
    """Fails every game after the speaker spoke (its leases are held by then)."""

    def _apply(self, agent, action):
        if agent == "listener":
            raise RuntimeError("the listener's table is broken")
        super()._apply(agent, action)


def test_a_game_that_always_fails_ends_the_run_with_its_reason(tiny_model, tmp_path):
    with LocalServer(tiny_model, tmp_path / "a") as a, LocalServer(tiny_model, tmp_path / "b") as b:
        coordinator = Coordinator(env_factory=lambda: _BrokenGame(num_items=3), role_servers=ROLES,
                                  endpoints={"speaker_model": trainable("speaker_model", a.url),
                                             "listener_model": trainable("listener_model", b.url)},
                                  settings=SETTINGS)
        failures = []
        started = time.monotonic()
        stats = play(coordinator, games=4, concurrency=3, max_failures=2, on_failure=failures.append)
        assert time.monotonic() - started < 30  # one 2 s pause between a game's two attempts, and the games
        assert stats.games == 0 and stats.error is not None
        assert "failed 2 times in a row" in stats.error and "the listener's table is broken" in stats.error
        assert stats.failed == len(failures) >= 2 and stats.retried == sum(f.retrying for f in failures) >= 1
        assert not any(f.retrying for f in failures if f.attempt == 2)  # the budget: no third attempt
        assert coordinator.open_leases() == 0
        assert pool(a.url)["running_leases"] == pool(b.url)["running_leases"] == 0  # every lease was aborted
        coordinator.close()


def test_stopping_cancels_the_games_waiting_for_a_lease(tiny_model, tmp_path):
    with LocalServer(tiny_model, tmp_path / "a") as a:  # never started: OFFLINE, and nobody may revive it
        coordinator = Coordinator(env_factory=lambda: SignallingGame(num_items=3),
                                  role_servers={"speaker": "speaker_model", "listener": None},
                                  endpoints={"speaker_model": TrainableEndpoint("speaker_model",
                                                                       client=SwarmClient(a.url, admin_token=ADMIN))},
                                  settings=SETTINGS)
        stop_at = time.monotonic() + 1.0
        stats = play(coordinator, games=4, concurrency=2, should_stop=lambda: time.monotonic() > stop_at)
        coordinator.close()
        assert time.monotonic() - stop_at < 5  # not lease_timeout_s: an OFFLINE server counts as busy, not gone
        assert (stats.games, stats.failed, stats.error) == (0, 0, None)
        with admin_http(a.url) as http:
            assert http.get("/control/status").json()["state"] == "OFFLINE"


def test_only_servers_playing_a_dealt_role_are_leased_on():
    nowhere = f"http://127.0.0.1:{free_port()}"  # leasing here would fail every game
    endpoints = {name: TrainableEndpoint(name, client=SwarmClient(nowhere, admin_token=ADMIN))
                 for name in ("a", "ghost")}
    endpoints["frozen"] = StaticEndpoint("frozen", base_url=nowhere + "/v1")
    roles = {"speaker": "a", "listener": "frozen", "observer": "ghost"}  # SignallingGame() deals no observer
    assert linked_servers_of(SignallingGame(num_items=3), roles, endpoints) == ["a"]
    assert linked_servers_of(SignallingGame(num_items=3, observers=1), roles, endpoints) == ["a", "ghost"]
    with pytest.raises(ValueError, match="observer"):
        linked_servers_of(SignallingGame(num_items=3, observers=1), {"speaker": "a", "listener": None}, endpoints)


def test_a_server_that_keeps_failing_to_boot_is_given_up_by_the_monitor(tiny_model, tmp_path):
    def broken_trainer(model_dir, config):
        raise RuntimeError("no trainer for you")

    with LocalServer(tiny_model, tmp_path / "a", trainer_factory=broken_trainer) as a:
        config = TrainConfig(batch_size=2, num_repeat=2, save_freq=0)
        monitor = ServerMonitor({"a": TrainableEndpoint("a", client=SwarmClient(a.url, admin_token=ADMIN),
                                               train_config=config)}, max_revivals=2, poll_s=0.1).start()
        deadline = time.monotonic() + 60
        while monitor.fatal is None and time.monotonic() < deadline:
            time.sleep(0.1)
        monitor.close()
        assert monitor.fatal is not None and "server a" in monitor.fatal and "no trainer for you" in monitor.fatal
        assert monitor.state("a") == "OFFLINE"  # and it is left alone


# --- provenance: who played each role, on every sample ---------------------------------------------------------


def episode_rows(data_dir) -> dict[str, tuple[dict, int]]:
    """episode id -> (its metadata, the policy version of its samples) in a server's ledger."""
    import json
    import sqlite3

    db = sqlite3.connect(data_dir / "ledger.sqlite")
    try:
        rows = db.execute("SELECT e.episode_id, e.metadata, MIN(s.policy_version), MAX(s.policy_version)"
                          " FROM episodes e JOIN samples s USING (episode_id) GROUP BY e.episode_id").fetchall()
    finally:
        db.close()
    assert all(low == high for _, _, low, high in rows)  # one policy per episode
    return {episode: (json.loads(metadata), version) for episode, metadata, version, _ in rows}


def test_every_episode_records_the_versions_of_its_co_players(tiny_model, tmp_path):
    with LocalServer(tiny_model, tmp_path / "a") as a, LocalServer(tiny_model, tmp_path / "b") as b:
        # a trains after every game group, b every other group: their versions drift apart during the games
        coordinator = Coordinator(
            env_factory=lambda: SignallingGame(num_items=3), role_servers=ROLES,
            endpoints={"speaker_model": trainable("speaker_model", a.url, batch_size=1),
                       "listener_model": trainable("listener_model", b.url, batch_size=2)},
            settings=SETTINGS)
        stats = play(coordinator, games=10, concurrency=2)
        coordinator.close()
    assert stats.failed == 0 and len({r.policy_versions["speaker_model"] for r in stats.results}) > 1
    speaker_rows, listener_rows = episode_rows(tmp_path / "a"), episode_rows(tmp_path / "b")
    for record in stats.results:
        meta_a, version_a = speaker_rows[record.episodes["speaker_model"]]
        meta_b, version_b = listener_rows[record.episodes["listener_model"]]
        played = {"speaker": {"server": "speaker_model", "policy_version": version_a, "snapshot_of": None},
                  "listener": {"server": "listener_model", "policy_version": version_b, "snapshot_of": None}}
        assert meta_a["co_players"] == meta_b["co_players"] == played  # what each sample was played against
        assert {role: p.model_dump() for role, p in record.co_players.items()} == played  # and games.jsonl keeps it
        assert (version_a, version_b) == (record.policy_versions["speaker_model"],
                                          record.policy_versions["listener_model"])


def test_a_game_with_only_static_servers_leases_nothing(tiny_model, tmp_path):
    with LocalServer(tiny_model, tmp_path / "c", static=True) as c:
        with admin_http(c.url) as http:
            wait_state(http, "STATIC")
        frozen = StaticEndpoint("frozen", base_url=c.url + "/v1", model="tiny", policy_version=7,
                                snapshot_of="speaker_model")
        coordinator = Coordinator(env_factory=lambda: SignallingGame(num_items=3),
                                  role_servers={"speaker": "frozen", "listener": None},
                                  endpoints={"frozen": frozen}, settings=GameSettings(max_tokens=6, temperature=0.0))
        assert coordinator.linked == []
        stats = play(coordinator, games=3, repeats=1)
        coordinator.close()
    assert stats.games == 3 and stats.failed == 0
    for record in stats.results:
        assert record.episodes == {} and record.policy_versions == {}
        assert record.co_players["speaker"].model_dump() == {"server": "frozen", "policy_version": 7,
                                                             "snapshot_of": "speaker_model"}
        assert record.co_players["listener"].model_dump() == {"server": None, "policy_version": None,
                                                              "snapshot_of": None}
        assert record.replies["speaker"] >= 1  # the static model did play
