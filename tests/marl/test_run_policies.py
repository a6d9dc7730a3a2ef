"""`marl run` on a topology whose roles are two LoRA policies of one server (tiny model): one `marl serve`, two
learners that each take their own steps, their records under the server's data dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from marl.games.record import read_games

pytestmark = pytest.mark.timeout(600)


def marl_run(spec: dict, tmp_path) -> subprocess.CompletedProcess:
    """`marl run` of the topology `spec` (written to tmp_path), which must succeed."""
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = subprocess.run([sys.executable, "-m", "marl.cli", "run", str(path)], capture_output=True, text=True,
                            timeout=500, env={**os.environ, "COLUMNS": "120"})
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_marl_run_trains_two_policies_of_one_server(tiny_model, tmp_path):
    spec = {
        "name": "tiny-lora",
        "servers": {"team": {"model": str(tiny_model), "trainable": True, "device": "cpu",
                             "train": {"job": "tiny", "batch_size": 1, "num_repeat": 2, "save_freq": 1,
                                       "grpo": {"learning_rate": 1e-3}},
                             "policies": {"speaker": {"lora": {"rank": 4}}, "listener": {"lora": {"rank": 8}}}}},
        "roles": {"speaker": {"server": "team", "policy": "speaker"},
                  "listener": {"server": "team", "policy": "listener"}},
        "env": {"class": "envs.signalling:SignallingGame", "args": {"num_items": 3}},
        "run": {"max_steps": 2, "concurrency": 2, "run_dir": str(tmp_path / "run")},
    }
    result = marl_run(spec, tmp_path)
    run_dir = tmp_path / "run"
    assert "stopped 1 local server" in result.stdout
    for policy in ("speaker", "listener"):
        data_dir = run_dir / "servers" / "team" / "policies" / policy
        steps = [json.loads(line) for line in (data_dir / "metrics.jsonl").read_text().splitlines()]
        assert [s["step"] for s in steps][:2] == [1, 2]
        latest = sorted((data_dir / "checkpoints").glob("step_*"))[-1]  # adapter-only, in PEFT's format
        assert (latest / "adapter" / "adapter_config.json").exists() and (latest / "trainer_state.pt").exists()
    games = read_games(run_dir / "games.jsonl")
    assert games and all({p.server for p in g.co_players.values()} == {"team.speaker", "team.listener"}
                         for g in games)
    assert (run_dir / "servers" / "team" / "policies" / "speaker" / "training.png").exists()


def test_marl_run_plays_a_policys_past_selves_served_by_its_own_server(tiny_model, tmp_path):
    spec = {
        "name": "tiny-lora-league",
        "servers": {"team": {"model": str(tiny_model), "trainable": True, "device": "cpu",
                             "train": {"job": "tiny", "batch_size": 1, "num_repeat": 2, "save_freq": 1,
                                       "grpo": {"learning_rate": 1e-3}},
                             "policies": {"speaker": {"lora": {"rank": 4}}}},
                    "past": {"past_of": {"server": "team", "policy": "speaker", "k": 2}}},
        "roles": {"speaker": {"server": "team", "policy": "speaker"}, "listener": {"server": "past"}},
        "env": {"class": "envs.signalling:SignallingGame", "args": {"num_items": 3}},
        "run": {"max_steps": 4, "concurrency": 2, "max_tokens": 6, "run_dir": str(tmp_path / "run")},
    }
    result = marl_run(spec, tmp_path)
    run_dir = tmp_path / "run"
    assert "past_of server past serves snapshots [0] of team.speaker" in result.stdout
    assert "stopped 1 local server" in result.stdout  # the snapshots ran on team itself: no process of their own
    assert not (run_dir / "logs" / "past").exists()
    games = read_games(run_dir / "games.jsonl")
    for game in games:
        past = game.co_players["listener"]
        assert (past.server, past.snapshot_of) == ("past", "team.speaker")
        assert past.policy_version <= game.policy_versions["team.speaker"]  # a past self, never a future one
        assert game.replies["listener"] >= 1
    # Whether a later snapshot joins the pool before the run ends depends on the league's 2 s poll against how fast
    # a tiny model trains (a loaded CI machine saw none): the pool's loading of later checkpoints is tested without
    # timing in tests/servers/test_frozen_policies.py (SnapshotPool.refresh against a live server).
