"""`marl.testing` and `marl check-env`: the tiny model builder makes a model that a real server serves and trains,
a sound env passes the check, a broken one fails it with the reason, and a target that cannot be checked is a
one-line usage error (exit 2). Real `marl serve` subprocesses on 127.0.0.1 (a heavy file: tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from marl.client import SwarmClient
from marl.protocol import TrainConfig
from marl.testing import build_tiny_model, server_process
from marl.testing.env_target import UsageError, env_section, parse_env_args

#: Two broken Signalling games, imported by `marl check-env` from a module written into the test's directory.
BROKEN_ENVS = '''
from envs.signalling import SignallingGame


class UnpaidListener(SignallingGame):
    """Its outcome leaves the listener out: the listener's reward never reaches the listener's samples."""

    def outcome_by_role(self):
        return {role: r for role, r in super().outcome_by_role().items() if role != "listener"}


class PlainObservations(SignallingGame):
    """Observes plain str, which PettingZoo's api_test refuses (a str has no dtype)."""

    def observe(self, agent):
        return str(super().observe(agent))
'''


def check_env(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`marl check-env ARGS` as a user runs it; `cwd` also goes on PYTHONPATH (for an env module there)."""
    python_path = os.pathsep.join(filter(None, [str(cwd) if cwd else None, os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "marl", "check-env", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "PYTHONPATH": python_path})


def test_the_tiny_model_builder_makes_a_model_a_trainable_server_serves(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    with server_process(model, tmp_path / "server") as proc, \
            SwarmClient(proc.url, admin_token=proc.admin_token) as client:
        client.auto_sync_train_config_and_start_engine(TrainConfig(batch_size=1, num_repeat=1, save_freq=0))
        with client.episode("task-0") as episode:
            reply = episode.openai(agent="guesser").chat.completions.create(
                model=episode.model, messages=[{"role": "user", "content": "Which animal?"}], max_tokens=4)
            episode.reward = 1.0
    assert reply.choices[0].message.content is not None and reply.usage.completion_tokens >= 1
    assert episode.result is not None and (tmp_path / "server" / "ledger.sqlite").exists()


def test_check_env_passes_signalling_with_a_line_per_role(tmp_path):
    result = check_env("envs.signalling:SignallingGame", "--run-dir", str(tmp_path / "check"))
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    assert lines[-1] == "check-env: OK", result.stdout
    assert "api_test: passed" in lines and any(line.startswith("training: policy version ") for line in lines)
    for role in ("speaker", "listener"):
        line = next(line for line in lines if line.startswith(f"role {role}: "))
        assert f"role {role}: 4 games, 4 episodes, 4 samples, " in line and "invalid replies " in line, line
    assert (tmp_path / "check" / "server" / "ledger.sqlite").exists() and (tmp_path / "check" / "games.jsonl").exists()


def test_check_env_fails_an_env_whose_reward_never_reaches_a_role(tmp_path, tiny_model):
    (tmp_path / "broken_envs.py").write_text(BROKEN_ENVS)
    result = check_env("broken_envs:UnpaidListener", "--games", "2", "--model", str(tiny_model), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1].startswith(
        "check-env: FAILED: role listener: the env's outcome_by_role() had no reward for it in 2 of 2 games"), \
        result.stdout
    assert "role speaker: 2 games" in result.stdout and "Traceback" not in result.stdout + result.stderr


def test_check_env_fails_an_env_that_api_test_refuses_before_starting_a_server(tmp_path):
    (tmp_path / "broken_envs.py").write_text(BROKEN_ENVS)
    result = check_env("broken_envs:PlainObservations", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1].startswith("check-env: FAILED: api_test: "), result.stdout
    assert "server:" not in result.stdout


@pytest.mark.parametrize("args, says", [
    (["no_such_module:Game"], "cannot import module 'no_such_module'"),
    (["envs.signalling:SignalingGame"], "did you mean 'SignallingGame'"),
    (["envs.signalling.SignallingGame"], "did you mean 'envs.signalling:SignallingGame'"),
    (["envs.signalling:SignallingGame", "--args", "num_itemz=3"], "did you mean 'num_items'"),
    (["textarena:KuhnPokr-v0"], "did you mean 'KuhnPoker-v0'"),
    (["envs.signalling:SignallingGame", "--games", "0"], "--games"),
])
def test_what_cannot_be_checked_is_a_usage_error_in_one_line(args, says):
    result = check_env(*args, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("marl check-env: error: ") and says in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_env_args_read_as_json_or_yaml_values_and_a_suite_game_names_its_env():
    assert parse_env_args(['{"num_items": 3, "naming_bonus": 0.5}']) == {"num_items": 3, "naming_bonus": 0.5}
    assert parse_env_args(["num_items=3", "game_args={max_rounds: 1}", "name=cat", "flag=true"]) == {
        "num_items": 3, "game_args": {"max_rounds": 1}, "name": "cat", "flag": True}
    for bad in (["num_items"], ["{not json"], ["3=x"]):
        with pytest.raises(UsageError):
            parse_env_args(bad)
    assert env_section("textarena:KuhnPoker-v0", {"rotate_seats": True}) == {
        "textarena": "KuhnPoker-v0", "args": {"rotate_seats": True}}
    assert env_section("openspiel:kuhn_poker", {}) == {"openspiel": "kuhn_poker", "args": {}}
    assert env_section("envs.signalling:SignallingGame", {}) == {"class": "envs.signalling:SignallingGame", "args": {}}


def test_importing_marl_testing_imports_neither_pytest_nor_torch():
    code = "import sys, marl.testing; print(sorted({'pytest', 'torch', 'transformers'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
