"""The coordinator over real servers with tiny models: linked episodes, crash handling, backpressure."""

from __future__ import annotations

import threading
import time
from collections import Counter

from conftest import ADMIN, LocalServer, admin_http, ledger_samples, server_process, trainable, wait_state
from envs.signalling import SignallingGame
from marl import SwarmClient
from marl.coordinator import Coordinator, Endpoint, GameFailed, GameSettings, play_games, tasks

SETTINGS = GameSettings(max_tokens=6, lease_timeout_s=60)
ROLES = {"speaker": "speaker_model", "listener": "listener_model"}


def episodes(data_dir) -> list[tuple]:
    """(episode_id, task_id, agent, reward) of every sample in a server's ledger."""
    return ledger_samples(data_dir)


def pool(url: str) -> dict:
    with admin_http(url) as http:
        return http.get("/control/pool").json()


def play(coordinator: Coordinator, games: int, concurrency: int = 2, repeats: int = 2):
    done = []
    return play_games(coordinator, tasks("t", repeats, seed=0), concurrency=concurrency,
                      should_stop=lambda: len(done) >= games, on_result=lambda r, e: r and done.append(r))


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
                       "frozen": Endpoint("frozen", base_url=c.url + "/v1", model="tiny")},
            settings=SETTINGS)
        stats = play(coordinator, games=8, concurrency=3)
        coordinator.close()
        assert stats.failed == 0 and stats.games >= 8
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
            assert stats.games >= 4
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
        assert stats.failed == 0 and stats.games >= 8
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
