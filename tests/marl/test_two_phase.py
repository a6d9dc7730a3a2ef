"""Two-phase commit: prepare, commit and abort on real servers, and a game across two `marl serve` processes that
either holds its episode on both servers or on neither, whichever server dies when."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
from conftest import ADMIN, LocalServer, admin_http, start_rolling

from marl import SwarmClient
from marl.client import SwarmError
from marl.protocol import EpisodePhase, ErrorCode
from marl.runner.launch import ServerProcess
from marl.transaction.decision_log import Decision, DecisionLog
from marl.transaction.two_phase import Part, commit_game, redrive

CONFIG = dict(batch_size=1000, num_repeat=4, lease_patience_s=120, save_freq=0)


def wait_for(condition, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return value


def played(client: SwarmClient) -> str:
    """Begin an episode with one model call; its id."""
    episode_id, lease = client.begin_episode(timeout=60)
    client.openai_client(lease).chat.completions.create(
        model=lease.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    return episode_id


def ledger_outcome(data_dir: Path, episode_id: str) -> str:
    """Where the episode is in a server's ledger: "pool", "prepared", "aborted" or "absent"."""
    db = sqlite3.connect(f"file:{data_dir / 'ledger.sqlite'}?mode=ro", uri=True)
    try:
        if db.execute("SELECT 1 FROM episodes WHERE episode_id = ?", (episode_id,)).fetchone():
            return "pool"
        row = db.execute("SELECT outcome FROM prepared WHERE episode_id = ?", (episode_id,)).fetchone()
    finally:
        db.close()
    return "absent" if row is None else {None: "prepared", "aborted": "aborted"}[row[0]]


def code_of(call) -> ErrorCode | str | None:
    with pytest.raises(SwarmError) as info:
        call()
    return info.value.code


# --- one server ---------------------------------------------------------------------------------------------------


@pytest.fixture
def rolling(local_server):
    with local_server() as srv, admin_http(srv.url) as http, SwarmClient(srv.url, ADMIN) as client:
        start_rolling(http, **CONFIG)
        yield srv, client


def test_prepare_commit_and_abort_are_idempotent(rolling, tmp_path):
    srv, client = rolling
    episode_id = played(client)
    assert code_of(lambda: client.commit_episode(episode_id)) is ErrorCode.EPISODE_NOT_PREPARED
    prepared = client.prepare_episode("t", episode_id, 1.0, game_id="g1")
    assert prepared.samples == 1 and prepared.deadline > time.time() + 200
    assert client.prepare_episode("t", episode_id, 1.0, game_id="g1").replayed  # the same prepare, again
    assert code_of(lambda: client.prepare_episode("t", episode_id, 0.0, game_id="g1")) is \
        ErrorCode.EPISODE_ALREADY_ENDED
    assert code_of(lambda: client.end_episode("t", episode_id, 1.0)) is ErrorCode.EPISODE_ALREADY_ENDED
    pool = client.pool()
    assert (pool.prepared_episodes, pool.pending_episodes, pool.running_leases) == (1, 0, 0)  # outside the pool
    assert client.episode_state(episode_id).phase is EpisodePhase.PREPARED
    with SwarmClient(srv.url, ADMIN, client_id="intruder") as other:
        assert code_of(lambda: other.commit_episode(episode_id)) is ErrorCode.NOT_LEASE_HOLDER
    committed = client.commit_episode(episode_id, include_pool=True)
    assert not committed.replayed and committed.samples == 1 and committed.pool.pending_episodes == 1
    assert client.commit_episode(episode_id).replayed
    assert code_of(lambda: client.abort_episode(episode_id)) is ErrorCode.EPISODE_ALREADY_ENDED
    assert client.episode_state(episode_id).phase is EpisodePhase.ENDED
    assert ledger_outcome(srv.data_dir, episode_id) == "pool"

    dropped = played(client)
    client.prepare_episode("t", dropped, 1.0, game_id="g2")
    assert client.abort_episode(dropped).disposition == "discarded"
    assert client.abort_episode(dropped) is None  # aborted already
    assert code_of(lambda: client.commit_episode(dropped)) is ErrorCode.EPISODE_ABORTED
    assert client.episode_state(dropped).phase is EpisodePhase.ABORTED
    assert ledger_outcome(srv.data_dir, dropped) == "aborted" and client.pool().prepared_episodes == 0


def test_an_overdue_prepared_episode_follows_the_decision_log_or_is_presumed_aborted(rolling, tmp_path):
    srv, client = rolling
    decisions = DecisionLog(tmp_path / "decisions.sqlite")
    undecided, committed, unlogged = played(client), played(client), played(client)
    for game, episode_id in (("undecided", undecided), ("committed", committed)):
        client.prepare_episode("t", episode_id, 1.0, game_id=game, prepare_timeout_s=1.0,
                               decision_log=str(decisions.path))
    client.prepare_episode("t", unlogged, 1.0, game_id="unlogged", prepare_timeout_s=1.0)
    decisions.begin("undecided", {})
    assert decisions.decide("committed", commit=True) is Decision.COMMIT
    wait_for(lambda: client.pool().prepared_episodes == 0, "the server to resolve its overdue episodes")
    assert [ledger_outcome(srv.data_dir, e) for e in (undecided, committed, unlogged)] == \
        ["aborted", "pool", "aborted"]


def test_a_commit_decided_too_late_is_recorded_as_abort(tmp_path):
    decisions = DecisionLog(tmp_path / "d.sqlite")
    assert decisions.decide("late", commit=True, decide_by=time.time() - 1) is Decision.ABORT
    assert decisions.decide("late", commit=True) is Decision.ABORT  # the first decision holds
    assert decisions.decide("on-time", commit=True, decide_by=time.time() + 60) is Decision.COMMIT


def test_a_restarted_server_keeps_its_prepared_episodes(tiny_model, tmp_path):
    data = tmp_path / "srv"
    with LocalServer(tiny_model, data) as srv, admin_http(srv.url) as http, SwarmClient(srv.url, ADMIN) as client:
        start_rolling(http, **CONFIG)
        episode_id = played(client)
        client.prepare_episode("t", episode_id, 1.0, game_id="g")
        client_id = client.client_id
    with LocalServer(tiny_model, data) as srv, SwarmClient(srv.url, ADMIN, client_id=client_id) as client:
        assert client.pool().prepared_episodes == 1  # before any engine start
        assert client.commit_episode(episode_id, include_pool=True).pool.pending_episodes == 1


# --- a game across two server processes ----------------------------------------------------------------------------


class Servers:
    """Two `marl serve` processes, A and B; B can be SIGKILLed and restarted on its port and data dir."""

    def __init__(self, model: Path, root: Path):
        self.model, self.root = model, root
        self.procs = {name: self._start(name) for name in ("a", "b")}

    def _start(self, name: str, port: int | None = None) -> ServerProcess:
        proc = ServerProcess(model=str(self.model), admin_token=ADMIN, data_dir=self.data(name), device="cpu",
                             served_name="tiny", port=port, log_path=self.root / f"{name}.log").start()
        proc.wait_healthy(timeout=120)
        return proc

    def data(self, name: str) -> Path:
        return self.root / name

    def client(self, name: str, client_id: str = "coordinator") -> SwarmClient:
        return SwarmClient(self.procs[name].url, ADMIN, client_id=client_id, timeout=5)

    def roll(self, name: str) -> None:
        with self.client(name) as client:
            client.auto_sync_train_config_and_start_engine(CONFIG, timeout=120)

    def kill(self, name: str) -> None:
        self.procs[name].kill()

    def restart(self, name: str) -> None:
        self.procs[name] = self._start(name, port=self.procs[name].port)

    def close(self) -> None:
        for proc in self.procs.values():
            proc.kill()


@pytest.fixture
def servers(tiny_model, tmp_path):
    both = Servers(tiny_model, tmp_path)
    try:
        both.roll("a")
        both.roll("b")
        yield both
    finally:
        both.close()


def game(servers: Servers) -> dict[str, tuple[SwarmClient, str]]:
    """One episode with a model call on each server: {server: (client, episode id)}."""
    clients = {name: servers.client(name) for name in ("a", "b")}
    return {name: (client, played(client)) for name, client in clients.items()}


def outcomes(servers: Servers, episodes: dict[str, tuple[SwarmClient, str]]) -> set[str]:
    return {ledger_outcome(servers.data(name), episode_id) for name, (_, episode_id) in episodes.items()}


def test_a_server_killed_between_prepare_and_commit_gets_the_episode_after_its_restart(servers, tmp_path):
    decisions = DecisionLog(tmp_path / "decisions.sqlite")
    episodes = game(servers)
    parts = {name: Part(client, "t", episode_id, 1.0) for name, (client, episode_id) in episodes.items()}
    for part in parts.values():
        part.client.prepare_episode("t", part.episode_id, 1.0, game_id="g1", decision_log=str(decisions.path))
    decisions.begin("g1", {})
    servers.kill("b")  # between prepare and commit
    assert decisions.decide("g1", commit=True) is Decision.COMMIT
    parts["a"].client.commit_episode(parts["a"].episode_id)
    with pytest.raises(SwarmError):
        parts["b"].client.commit_episode(parts["b"].episode_id, timeout=1)
    assert outcomes(servers, episodes) == {"pool", "prepared"}  # B's prepared episode survived the SIGKILL
    servers.restart("b")
    with servers.client("b") as b:
        assert b.commit_episode(parts["b"].episode_id, include_pool=True).pool.pending_episodes == 1
    assert outcomes(servers, episodes) == {"pool"}  # both servers hold the game's episodes


def test_the_driver_and_its_redrive_commit_a_game_whose_server_died_after_the_first_commit(servers, tmp_path):
    decisions = DecisionLog(tmp_path / "decisions.sqlite")
    episodes = game(servers)
    parts = {name: Part(client, "t", episode_id, 1.0) for name, (client, episode_id) in episodes.items()}

    real_commit = parts["a"].client.commit_episode

    def commit_then_kill_b(episode_id: str, **kwargs):
        answer = real_commit(episode_id, **kwargs)
        servers.kill("b")  # after the first commit, before the second
        return answer

    parts["a"].client.commit_episode = commit_then_kill_b
    io = _Sequential()
    outcome = commit_game(decisions, "g2", parts, prepare_timeout_s=4, io=io)
    assert outcome.committed and outcome.acknowledged == ["a"] and set(outcome.pending) == {"b"}
    assert [g.game_id for g in decisions.unfinished()] == ["g2"]
    servers.restart("b")
    redone = redrive(decisions, ADMIN)
    assert redone["g2"].acknowledged == ["a", "b"] and decisions.unfinished() == []
    assert outcomes(servers, episodes) == {"pool"}


def test_a_game_decided_before_a_restart_past_the_deadline_is_committed_from_the_log(servers, tmp_path):
    decisions = DecisionLog(tmp_path / "decisions.sqlite")
    episodes = game(servers)
    for client, episode_id in episodes.values():
        client.prepare_episode("t", episode_id, 1.0, game_id="g3", prepare_timeout_s=2,
                               decision_log=str(decisions.path))
    decisions.decide("g3", commit=True)
    client_a, episode_a = episodes["a"]
    client_a.commit_episode(episode_a)
    servers.kill("b")
    time.sleep(2.5)  # B is down past its deadline: nobody commits it
    servers.restart("b")
    wait_for(lambda: outcomes(servers, episodes) == {"pool"}, "B to commit from the decision log")


def test_without_a_decision_both_servers_presume_abort(servers):
    episodes = game(servers)
    for client, episode_id in episodes.values():
        client.prepare_episode("t", episode_id, 1.0, game_id="g4", prepare_timeout_s=2)  # no decision log
    servers.kill("b")
    time.sleep(2.5)
    servers.restart("b")
    wait_for(lambda: outcomes(servers, episodes) == {"aborted"}, "both servers to abort")
    for name, (_, episode_id) in episodes.items():
        with servers.client(name) as client:
            assert code_of(lambda: client.commit_episode(episode_id)) is ErrorCode.EPISODE_ABORTED  # noqa: B023 (called at once)


def test_a_prepare_that_fails_aborts_the_game_everywhere(servers, tmp_path):
    decisions = DecisionLog(tmp_path / "decisions.sqlite")
    episodes = game(servers)
    parts = {name: Part(client, "t", episode_id, 1.0) for name, (client, episode_id) in episodes.items()}
    servers.kill("b")  # before its prepare
    outcome = commit_game(decisions, "g5", parts, prepare_timeout_s=4)
    assert outcome.decision is Decision.ABORT and set(outcome.prepare_errors) == {"b"}
    assert outcomes(servers, {"a": episodes["a"]}) == {"aborted"}
    servers.restart("b")
    redrive(decisions, ADMIN)
    assert outcomes(servers, episodes) <= {"aborted", "absent"} and decisions.unfinished() == []


class _Sequential:
    """An executor that runs each call at once, in order (a deterministic place to kill a server)."""

    def submit(self, fn, *args, **kwargs):
        from concurrent.futures import Future

        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(exc)
        return future


def test_the_decision_log_is_readable_from_another_process_while_written(tmp_path):
    from marl.transaction.decision_log import DecisionLogUnreadable, read_decision

    decisions = DecisionLog(tmp_path / "d.sqlite")
    decisions.begin("g", {})
    assert read_decision(decisions.path, "g") is None
    decisions.decide("g", commit=True)
    assert read_decision(decisions.path, "g") is Decision.COMMIT
    with pytest.raises(DecisionLogUnreadable):
        read_decision(tmp_path / "missing.sqlite", "g")


def test_the_decision_log_keeps_only_games_not_yet_acknowledged_everywhere(tmp_path, monkeypatch):
    """Done games are deleted every COMPACT_EVERY, so the log stays the size of the games in flight; an unfinished
    game keeps its decision for the re-drive and for a server's overdue prepared episode."""
    from marl.transaction import decision_log
    from marl.transaction.decision_log import Participant, read_decision

    monkeypatch.setattr(decision_log, "COMPACT_EVERY", 10)
    decisions = DecisionLog(tmp_path / "d.sqlite")
    who = {"a": Participant("http://127.0.0.1:1", "e", "c")}
    decisions.begin("in-flight", who)
    decisions.decide("in-flight", commit=True)
    sizes = []
    for i in range(200):
        decisions.begin(f"g{i}", who)
        decisions.decide(f"g{i}", commit=i % 2 == 0)
        decisions.done(f"g{i}")
        if i % 50 == 49:
            sizes.append(decisions.path.stat().st_size)
    assert [g.game_id for g in decisions.unfinished()] == ["in-flight"]
    assert read_decision(decisions.path, "in-flight") is Decision.COMMIT
    rows = sqlite3.connect(decisions.path).execute("SELECT COUNT(*) FROM games").fetchone()[0]
    assert rows <= 10 and sizes[-1] == sizes[0]  # pages reused: the file does not grow with the games played
