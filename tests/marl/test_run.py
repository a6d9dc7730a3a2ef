"""`marl run` end to end on tiny models: local servers started, games played, run directory written, Ctrl-C clean."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from PIL import Image

from marl.games.record import GameRecord, read_games
from marl.runner.launch import threads_per_server, usable_cores
from marl.watching.plot import summarize_games

TOPOLOGY = {
    "name": "tiny-signalling",
    "servers": {
        "speaker_model": {"model": None, "trainable": True, "device": "cpu",
                          "train": {"job": "tiny", "batch_size": 1, "num_repeat": 2, "save_freq": 0}},
        "listener_model": {"model": None, "trainable": True, "device": "cpu",
                           "train": {"job": "tiny", "batch_size": 1, "num_repeat": 2, "save_freq": 0}},
    },
    "roles": {"speaker": {"server": "speaker_model"}, "listener": {"server": "listener_model"}},
    "env": {"class": "envs.signalling:SignallingGame", "args": {"num_items": 3}},
    "run": {"max_steps": 2, "repeats": 2, "concurrency": 2},
}


def write_topology(tmp_path, tiny_model) -> str:
    spec = json.loads(json.dumps(TOPOLOGY))
    for server in spec["servers"].values():
        server["model"] = str(tiny_model)
    spec["run"]["run_dir"] = str(tmp_path / "run")
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_local_servers_split_the_cores_unless_the_user_set_omp_num_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert threads_per_server(2) == {"OMP_NUM_THREADS": "4"}
    assert threads_per_server(3) == {"OMP_NUM_THREADS": "2"}
    assert threads_per_server(16) == {"OMP_NUM_THREADS": "1"}
    assert threads_per_server(1) == {}  # alone: torch's default, a thread per core
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    assert threads_per_server(2) == {}  # the servers inherit the user's
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delattr(os, "sched_getaffinity")  # macOS has no affinity: every core counts
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert threads_per_server(2) == {"OMP_NUM_THREADS": "3"}


def test_marl_run_plays_trains_and_writes_the_run_directory(tiny_model, tmp_path):
    path = write_topology(tmp_path, tiny_model)
    environment = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # marl splits the cores
    result = subprocess.run([sys.executable, "-m", "marl.cli", "run", path, "run.max_steps=2"],
                            capture_output=True, text=True, timeout=300, env={**environment, "COLUMNS": "120"})
    assert result.returncode == 0, result.stdout + result.stderr
    threads = max(1, usable_cores() // 2)  # two servers share this machine's cores
    assert result.stdout.count(f", OMP_NUM_THREADS={threads}) on http://127.0.0.1:") == 2, result.stdout
    run_dir = tmp_path / "run"
    games = read_games(run_dir / "games.jsonl")
    assert len(games) >= 4 and all(set(g.role_rewards) == {"speaker", "listener"} for g in games)
    for server in ("speaker_model", "listener_model"):
        steps = [json.loads(line) for line in (run_dir / "servers" / server / "metrics.jsonl").read_text().splitlines()]
        assert [s["step"] for s in steps][:2] == [1, 2]
        assert (run_dir / "logs" / f"{server}.log").exists()
    with Image.open(run_dir / "reward_curves.png") as image:
        assert image.size[0] > 500
    assert "stopped 2 local servers" in result.stdout
    step_line = r"speaker_model: step \d (done; \d+ games; recent reward|trained nothing)"  # from the monitor
    assert re.search(step_line, result.stdout)
    assert re.search(r"recent actions {\"listener\": \"pick [\w ]+ \d+%", result.stdout)  # shares of actions
    assert all(len(g.actions["listener"]) == 1 for g in games)
    assert "valid replies" in result.stdout and "games/hour" in result.stdout  # the per-role summary
    assert all(g.replies["listener"] - g.invalid_actions["listener"] in (0, 1) for g in games)  # 1 pick or a fallback


def test_run_games_is_the_number_of_games_played_and_recorded(tiny_model, tmp_path):
    path = write_topology(tmp_path, tiny_model)
    result = subprocess.run([sys.executable, "-m", "marl.cli", "run", path, "run.games=2", "run.concurrency=8",
                             "run.max_steps=1000"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(read_games(tmp_path / "run" / "games.jsonl")) == 2  # 8 workers, and not one game more
    assert "2/2 games, 0 failed attempts, 0 retries" in result.stdout  # the live table's title
    assert "done: 2 games, 0 failed attempts, 0 retries" in result.stdout


#: An env whose scripted speaker has no scripted move: `scripted_action` raises on its free-text turn, every game.
FAILING_ENV = """
from envs.base import TextAECEnv
from envs.signalling import SignallingGame


class ScriptlessSignalling(SignallingGame):
    scripted_action = TextAECEnv.scripted_action
"""


def test_a_game_that_always_fails_ends_the_run_with_exit_1_and_the_reason(tiny_model, tmp_path):
    (tmp_path / "scriptless_env.py").write_text(FAILING_ENV)
    spec = json.loads(json.dumps(TOPOLOGY))
    del spec["servers"]["speaker_model"]
    spec["servers"]["listener_model"]["model"] = str(tiny_model)
    spec["roles"]["speaker"] = {"scripted": True}
    spec["env"]["class"] = "scriptless_env:ScriptlessSignalling"
    spec["run"].update(run_dir=str(tmp_path / "run"), concurrency=8, max_steps=1000, max_failures=2)
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(spec))
    python_path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))  # the env module
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "marl.cli", "run", str(tmp_path / "topology.yaml")],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "COLUMNS": "200", "PYTHONPATH": python_path})
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert time.monotonic() - started < 120, output  # server start, then 2 attempts 2 s apart
    assert "gave up: " in output and "ScriptlessSignalling has no scripted action for free-text turns" in output
    assert "failed 2 times in a row" in output
    assert "stopped 1 local servers" in output
    assert read_games(tmp_path / "run" / "games.jsonl") == []


#: A listener that never acts: the speaker's word ends the game, and the listener's server never sees a token.
MUTE_ENV = """
from envs.base import TextAECEnv


class MuteListener(TextAECEnv):
    possible_agents = ["speaker", "listener"]

    def _reset_game(self, seed, options):
        self.agent_selection = "speaker"

    def _observe_text(self, agent):
        return "Say a word."

    def _legal_actions(self, agent):
        return ["red", "green", "blue"]

    def _apply(self, agent, action):
        for who in self.agents:
            self.rewards[who] = float(action == "red")
            self.terminations[who] = True
"""


def test_a_role_that_never_gets_a_token_stops_the_run_with_exit_1_and_the_reason(tiny_model, tmp_path):
    """Liveness (issue 55): the listener's server can never fill a batch, so run.max_steps could never be reached;
    the run notices within run.stall_batches batches' worth of games and stops, naming the role."""
    (tmp_path / "mute_env.py").write_text(MUTE_ENV)
    spec = json.loads(json.dumps(TOPOLOGY))
    for server in spec["servers"].values():
        server["model"] = str(tiny_model)
    spec["env"] = {"class": "mute_env:MuteListener"}
    spec["run"].update(run_dir=str(tmp_path / "run"), max_steps=1000, stall_batches=2)
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(spec))
    python_path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))  # the env module
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "marl.cli", "run", str(tmp_path / "topology.yaml")],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "COLUMNS": "250", "PYTHONPATH": python_path})
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert time.monotonic() - started < 180, output
    assert "gave up: listener's episodes have no tokens: every game ended before listener called the model" in output
    bound = 2 * 1 * 2 + 2  # stall_batches x batch_size x num_repeat + concurrency
    games = read_games(tmp_path / "run" / "games.jsonl")
    assert bound < len(games) <= bound + 2 * 2, len(games)  # noticed at once (the games in flight still finish)
    assert all(g.replies.get("listener", 0) == 0 for g in games)


def test_games_jsonl_rows_of_older_versions_still_read(tmp_path):
    path = tmp_path / "games.jsonl"
    old = {"time": 1.0, "task_id": "t-0", "seed": 0, "agent_rewards": {"speaker": 1.0},  # as the first version wrote
           "role_rewards": {"speaker": 1.0}, "episodes": {"m": "e1"}, "policy_versions": {"m": 0},
           "invalid_actions": {}, "seconds": 1.0, "turns": 2}
    new = GameRecord(task_id="t-1", seed=1, role_rewards={"speaker": 0.0}, policy_versions={"m": 1},
                     replies={"speaker": 1}, winner="speaker", teams={"speaker": "speaker"}, time=3601.0)
    path.write_text(json.dumps(old) + "\n" + '{"torn": ' + "\n" + new.model_dump_json() + "\n")
    games = read_games(path)
    assert [g.task_id for g in games] == ["t-0", "t-1"]
    assert (games[0].replies, games[0].winner, games[0].teams) == ({}, None, {})  # not recorded then
    assert games[1] == new
    stats = summarize_games(tmp_path)
    assert stats["speaker"]["games"] == 2 and stats["speaker"]["win_rate"] == 1.0  # only the game with a winner
    assert stats["all"]["games_per_hour"] == 1.0


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_aborts_open_leases_and_stops_the_servers(tiny_model, tmp_path, signum):
    path = write_topology(tmp_path, tiny_model)
    proc = subprocess.Popen([sys.executable, "-m", "marl.cli", "run", path, "run.max_steps=1000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    games = tmp_path / "run" / "games.jsonl"
    deadline = time.monotonic() + 180
    while not (games.exists() and games.read_text().count("\n") >= 2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("no games were played:\n" + proc.communicate()[0])
        time.sleep(0.5)
    proc.send_signal(signum)
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # do not leave the run (and its servers) behind
        proc.terminate()
        output = proc.communicate(timeout=60)[0]
        raise AssertionError(f"marl run did not stop on signal {signum}:\n{output}") from None
    assert proc.returncode == 130, output
    assert "stopped 2 local servers" in output
    ports = [line.rsplit(":", 1)[1] for line in output.splitlines() if "started local trainable" in line]
    assert len(ports) == 2
    for port in ports:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            raise AssertionError(f"server on port {port} still answers")
        except httpx.TransportError:
            pass


def pid_listening_on(port: int) -> int:
    """The `marl serve` process started with --port `port` (Linux /proc)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in args and b"--port" in args and args[args.index(b"--port") + 1] == str(port).encode():
            return int(cmdline.parent.name)
    raise AssertionError(f"no marl serve process on port {port}")


def test_a_local_server_that_dies_is_restarted_and_the_run_completes(tiny_model, tmp_path):
    path = write_topology(tmp_path, tiny_model)
    proc = subprocess.Popen([sys.executable, "-m", "marl.cli", "run", path, "run.max_steps=3"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    run_dir = tmp_path / "run"
    deadline = time.monotonic() + 180
    while not ((run_dir / "games.jsonl").exists() and (run_dir / "games.jsonl").read_text().count("\n") >= 2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("no games were played:\n" + proc.communicate()[0])
        time.sleep(0.5)
    servers = json.loads((run_dir / "servers.json").read_text())
    assert (run_dir / "servers.json").stat().st_mode & 0o777 == 0o600  # it holds the admin token
    port = int(servers["listener_model"]["url"].rsplit(":", 1)[1])
    os.kill(pid_listening_on(port), signal.SIGKILL)  # as the out-of-memory killer would
    output, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, output
    assert "local server listener_model killed by SIGKILL" in output and "restarting it (1/3)" in output
    steps = [json.loads(line)["step"] for line in
             (run_dir / "servers" / "listener_model" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] >= 3  # it came back and trained on


def test_marl_run_with_a_league_of_past_selves_and_evaluations_every_k_steps(tiny_model, tmp_path):
    spec = {
        "name": "tiny-league",
        "servers": {"learner": {"model": str(tiny_model), "trainable": True, "device": "cpu",
                                "train": {"job": "tiny", "batch_size": 1, "num_repeat": 2, "save_freq": 1,
                                          "keep_checkpoints": 50}},
                    "past_learner": {"past_of": {"server": "learner", "pool": "latest", "k": 2}, "device": "cpu"}},
        "roles": {"speaker": {"server": "learner"}, "listener": {"server": "past_learner"}},
        "env": {"class": "envs.signalling:SignallingGame", "args": {"num_items": 3}},
        "run": {"max_steps": 1000, "concurrency": 2, "max_tokens": 6, "eval_every": 2, "eval_games": 2,
                "run_dir": str(tmp_path / "run")},
    }
    (tmp_path / "league.yaml").write_text(yaml.safe_dump(spec))
    proc = subprocess.Popen([sys.executable, "-m", "marl.cli", "run", str(tmp_path / "league.yaml")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    run_dir = tmp_path / "run"

    def evaluated_and_played_a_past_self() -> bool:
        evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()] \
            if (run_dir / "evals.jsonl").exists() else []
        pasts = [g.co_players["listener"].policy_version for g in read_games(run_dir / "games.jsonl")]
        later = {row["pairing"] for row in evals if row["step"] > 0}  # both pairings of an evaluation past step 0
        return {"latest", "learner latest"} <= later and any(v >= 1 for v in pasts)

    deadline = time.monotonic() + 300
    while not evaluated_and_played_a_past_self():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("no whole evaluation past step 0, or no game against a past checkpoint:\n"
                                 + proc.communicate()[0])
        time.sleep(1)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, output
    assert "past_of server past_learner serves snapshots [0] of learner" in output
    for game in read_games(run_dir / "games.jsonl"):
        past = game.co_players["listener"]
        assert (past.server, past.snapshot_of) == ("past_learner", "learner")
        assert past.policy_version <= game.policy_versions["learner"]  # a past self, never a future one
    rows = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and rows[0]["pairing"] == "latest" and rows[0]["games"] == 2
    later = [row for row in rows if row["step"] > 0]
    assert all(row["seats"]["listener"] == "initial" for row in later if row["pairing"] == "learner latest")
    assert set(rows[0]["roles"]) == {"speaker", "listener"} and "win_low" in rows[0]["roles"]["listener"]
    assert "eval at step 0, latest: win rate" in output
    with Image.open(run_dir / "evals.png") as image:
        assert image.size[0] > 300
