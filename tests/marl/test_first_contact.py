"""First contact: a fresh model cache built once whatever asks, and every start-up failure a user can cause said in
one line, without a traceback (issue 42)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from marl.client import SwarmClient
from marl.protocol import MODEL_ALIASES, LoraSpec
from marl.runner.launch import ServerProcess, ServerStartError, last_error_line
from servers.model_files import KNOWN_MODELS
from tests.conftest import ADMIN

#: `marl serve` with a stand-in alias registered: a tiny random model whose build takes a second and leaves a mark
#: per build in $STAND_IN_BUILDS (the real smollm2-135m build downloads a wheel: tests/servers/test_models.py, slow)
STAND_IN_SERVE = """
import os, sys, threading, time
from pathlib import Path
sys.path.insert(0, TESTS_DIR)  # the tiny model helper
from servers import model_files as models
from tiny_model import build_tiny_model

class StandIn:
    description = "a tiny random model (tests)"

    def stage(self, scratch):
        (Path(os.environ["STAND_IN_BUILDS"]) / f"{os.getpid()}-{threading.get_ident()}").touch()
        time.sleep(1.0)  # the others ask meanwhile
        return build_tiny_model(scratch / "model")

models.KNOWN_MODELS["stand-in"] = StandIn()
from marl.cli import main
main(sys.argv[1:])
""".replace("TESTS_DIR", repr(str(Path(__file__).resolve().parents[1])))

TRAIN = {"batch_size": 1, "num_repeat": 2, "save_freq": 0}


def marl(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marl.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200", **env})


def assert_one_line_error(result: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr
    return result.stderr


def test_the_known_aliases_are_the_protocols():
    assert set(KNOWN_MODELS) == set(MODEL_ALIASES)


def test_one_build_per_cache_for_two_policies_and_a_second_server(tmp_path):
    """A server of two LoRA policies (two threads resolve the model) and a second server (another process) start on
    one empty cache at once: the alias is built once, and all three learners roll."""
    cache, builds = tmp_path / "cache", tmp_path / "builds"
    builds.mkdir()
    environment = {"MARL_CACHE": str(cache), "STAND_IN_BUILDS": str(builds)}
    processes = [ServerProcess(model="stand-in", admin_token=ADMIN, data_dir=tmp_path / name, device="cpu",
                               log_path=tmp_path / f"{name}.log", environment=environment, policies=policies)
                 for name, policies in (("pair", {"a": LoraSpec(rank=4), "b": LoraSpec(rank=4)}), ("solo", None))]
    for process in processes:
        assert process.args[1:3] == ["-m", "marl.cli"]
        process.args[1:3] = ["-c", STAND_IN_SERVE]
    try:
        for process in processes:
            process.start()
        for process in processes:
            process.wait_healthy(timeout=120)
        learners = [(processes[0].url, "a"), (processes[0].url, "b"), (processes[1].url, None)]
        errors: list[BaseException] = []

        def start(url: str, policy: str | None) -> None:
            try:
                with SwarmClient(url, admin_token=ADMIN, policy=policy, max_wait_s=240) as client:
                    client.auto_sync_train_config_and_start_engine(TRAIN)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=start, args=learner) for learner in learners]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        logs = "\n".join(p.log_path.read_text() for p in processes)
        assert errors == [], logs
        assert len(list(builds.iterdir())) == 1, logs  # one build, whoever asked
        assert (cache / "models" / "stand-in" / "config.json").is_file()
        assert [p.name for p in (cache / "models").iterdir()] == ["stand-in"]  # no scratch directory left
        assert logs.count("building 'stand-in'") == 1 and "cannot import name" not in logs
    finally:
        for process in processes:
            process.stop()


def test_marl_serve_refuses_a_missing_model_and_a_taken_port_before_it_starts(tmp_path):
    for model, needle in ((str(tmp_path / "no-such-dir"), "no such directory and not a known alias"),
                          ("smollm2-135", "(did you mean 'smollm2-135m'?)")):
        result = marl("serve", "--model", model, "--data-dir", str(tmp_path / "data"))
        assert_one_line_error(result, 2, "marl serve: error: cannot resolve model", needle,
                              "known aliases: smollm2-135m")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = marl("serve", "--model", str(tmp_path), "--port", str(port), "--data-dir", str(tmp_path / "data"))
    assert_one_line_error(result, 2, f"marl serve: error: port {port} on 127.0.0.1 is taken (address already in use)",
                          "pass another --port")


def test_topology_show_checks_a_local_servers_model_at_its_line(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(Path("topologies/signalling-cpu.yaml").read_text().replace("model: smollm2-135m\n",
                                                                              "model: smollm2-135\n", 1))
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.endswith("model: smollm2-135"))
    result = marl("topology", "show", str(path))
    stderr = assert_one_line_error(result, 2, f"{path}:{line}: servers.speaker_model.model: 'smollm2-135' is no"
                                              " directory here and no model alias (did you mean 'smollm2-135m'?)")
    assert "listener_model" not in stderr  # its smollm2-135m is fine
    assert marl("topology", "show", str(path), f"servers.speaker_model.model={tmp_path}").returncode == 0


def write_topology(tmp_path: Path, model: Path, **speaker) -> Path:
    """One trainable server (the listener) and a scripted speaker, so that a run starts one process."""
    spec = {"name": "first-contact",
            "servers": {"listener_model": {"model": str(model), "trainable": True, "device": "cpu",
                                           "train": {"job": "tiny", **TRAIN}, **speaker}},
            "roles": {"speaker": {"scripted": True}, "listener": {"server": "listener_model"}},
            "env": {"class": "envs.signalling:SignallingGame", "args": {"num_items": 3}},
            "run": {"max_steps": 1, "repeats": 2, "concurrency": 2, "run_dir": str(tmp_path / "run")}}
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_marl_run_on_a_taken_port_says_so_in_one_line(tiny_model, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = marl("run", str(write_topology(tmp_path, tiny_model, port=port)))
    assert_one_line_error(result, 1, f"marl run: servers.listener_model.port: port {port} is taken (address already"
                                     " in use)", "change servers.listener_model.port")


def test_a_server_whose_engine_cannot_load_its_model_ends_the_run_in_one_line(tiny_model, tmp_path):
    """A model directory with a config.json but no weights: the plan reads it, the server starts, its engine fails."""
    broken = tmp_path / "no-weights"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_model / "config.json").read_text())
    result = marl("run", str(write_topology(tmp_path, broken)))
    stderr = assert_one_line_error(result, 1, "marl run: server listener_model did not start its engine:",
                                   f"(log: {tmp_path / 'run' / 'logs' / 'listener_model.log'})")
    assert "fell back to OFFLINE" in stderr and len(stderr.strip().splitlines()) == 1


def test_a_server_that_exits_while_starting_is_named_with_its_last_error_line(tmp_path):
    log_path = tmp_path / "server.log"
    log_path.write_text("Traceback (most recent call last):\nRuntimeError: an earlier start's failure\n")
    process = ServerProcess(model="m", admin_token=ADMIN, data_dir=tmp_path / "data", log_path=log_path)
    process.args = [sys.executable, "-c", "print('marl serve: trainable server on ...', flush=True);"
                                          " raise OSError(98, 'address already in use')"]
    with pytest.raises(ServerStartError) as info:
        process.start().wait_healthy(timeout=60)
    message = str(info.value)
    assert f"the server on port {process.port} exited with code 1 while starting" in message
    assert "OSError: [Errno 98] address already in use" in message and f"(log: {log_path})" in message
    process.args[2] = "import sys; print('marl serve: error: port 1 is taken', file=sys.stderr); sys.exit(2)"
    with pytest.raises(ServerStartError, match="exited with code 2 while starting: marl serve: error: port 1 is"):
        process.start().wait_healthy(timeout=60)
    process.args[2] = "print('loading...')"  # a silent death: no error line of its own, not an earlier one either
    with pytest.raises(ServerStartError) as info:
        process.start().wait_healthy(timeout=60)
    assert "exited with code 0 while starting (log:" in str(info.value)
    assert last_error_line(tmp_path / "missing.log") is None


STAMPED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (.*)$")


def test_a_piped_marl_run_prints_timestamped_progress_before_the_first_step_ends(tiny_model, tmp_path):
    result = marl("run", str(write_topology(tmp_path, tiny_model)))
    assert result.returncode == 0, result.stdout + result.stderr
    stamped = [m.group(1) for line in result.stdout.splitlines() if (m := STAMPED.match(line))]
    expected = ["started local trainable server listener_model", "1 local servers answer; loading models",
                "listener_model: model loaded, engine running", "playing games, 2 at a time", "first game done",
                "listener_model: step ", "stopped 1 local servers"]  # the monitor may see step 2 first
    where = [next((i for i, line in enumerate(stamped) if line.startswith(text)), None) for text in expected]
    assert None not in where and where == sorted(where), json.dumps(stamped, indent=1)


def test_overwatch_once_without_a_token_says_refused_and_what_to_do(local_server):
    env = {key: value for key, value in os.environ.items() if key != "MARL_ADMIN_TOKEN"}
    with local_server() as srv:
        result = subprocess.run([sys.executable, "-m", "marl.cli", "overwatch", srv.url, "--once"], capture_output=True,
                                text=True, timeout=60, env={**env, "COLUMNS": "80"})
    words = " ".join(result.stdout.replace("│", " ").split())  # the panel's text, its lines joined
    assert "REFUSED" in words and "UNREACHABLE" not in words, result.stdout
    assert "no admin token was given (HTTP 401): pass --admin-token or set $MARL_ADMIN_TOKEN" in words, result.stdout
    assert "servers.json)" in words, result.stdout  # the hint whole, wrapped rather than cut


def test_reward_curves_draw_each_servers_own_roles_on_whole_versions(tmp_path):
    from marl.games.record import CoPlayer, GameRecord, append_game
    from marl.watching.plot import plot_reward_curves, reward_figure

    with open(tmp_path / "games.jsonl", "w") as f:
        for version in range(3):
            append_game(f, GameRecord(role_rewards={"speaker": 0.1 * version, "listener": 1.0},
                                      policy_versions={"team.speaker": version, "team.listener": version // 2},
                                      co_players={"speaker": CoPlayer(server="team.speaker"),
                                                  "listener": CoPlayer(server="team.listener")}))
        append_game(f, GameRecord(role_rewards={"speaker": 0.0, "listener": 0.0}, policy_versions={"old": 0}))
    figure = reward_figure(tmp_path)
    panels = {ax.get_title(): ax for ax in figure.axes}
    assert sorted(panels) == ["old", "team.listener", "team.speaker"]
    lines = {title: {line.get_label(): list(line.get_xdata()) for line in ax.get_lines()}
             for title, ax in panels.items()}
    assert lines == {"team.speaker": {"speaker": [0, 1, 2]}, "team.listener": {"listener": [0, 1]},
                     "old": {"listener": [0], "speaker": [0]}}  # a row without co_players: every role
    speaker = panels["team.speaker"].get_lines()[0]
    assert [round(y, 6) for y in speaker.get_ydata()] == [0.0, 0.1, 0.2]
    for ax in figure.axes:
        ticks = ax.get_xticks()
        assert len(ticks) and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
    assert plot_reward_curves(tmp_path) == tmp_path / "reward_curves.png"
