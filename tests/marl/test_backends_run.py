"""`marl run` with the production backends on this CPU: a local server whose engine is vLLM (`engine: vllm`) and
whose trainer is FSDP2 over 2 ranks (`trainer: fsdp`), as topologies/signalling-gpu.yaml runs them on a GPU box.

Needs the vLLM environment (`make vllm`, or $MARL_VLLM_PYTHON); skipped without it. Its own file, so that the vLLM
of tests/servers/test_vllm_engine.py's module fixture is stopped before this one starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from tiny_model import build_tiny_model

from marl.games.record import read_games
from servers.engines.vllm_process import VLLM_PYTHON_ENV, vllm_python

pytestmark = [
    pytest.mark.skipif(not vllm_python().exists(),
                       reason=f"no vLLM environment at {vllm_python()} (`make vllm`, or set ${VLLM_PYTHON_ENV})"),
    pytest.mark.timeout(900),
]


def test_marl_run_trains_through_vllm_and_a_two_rank_fsdp_trainer(tmp_path):
    # head_dim 32: vLLM's CPU attention supports 32 and up
    model = build_tiny_model(tmp_path / "tiny", hidden_size=64, num_heads=2)
    topology = {
        "name": "tiny-backends",
        "servers": {"speaker_model": {
            "model": str(model), "trainable": True, "device": "cpu", "engine": "vllm",
            "train": {"job": "tiny", "batch_size": 1, "num_repeat": 2, "save_freq": 1, "trainer": "fsdp",
                      "fsdp": {"ranks": 2, "learning_rate": 1e-4}}}},
        "roles": {"speaker": {"server": "speaker_model"}, "listener": {"scripted": True}},
        "env": {"class": "envs.signalling:SignallingGame", "args": {"num_items": 3, "naming_bonus": 0.5}},
        "run": {"max_steps": 3, "repeats": 2, "concurrency": 2, "max_tokens": 8, "run_dir": str(tmp_path / "run")},
    }
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(topology))
    result = subprocess.run([sys.executable, "-m", "marl.cli", "run", str(path)], capture_output=True, text=True,
                            timeout=840, env={**os.environ, "COLUMNS": "120"})
    run_dir = tmp_path / "run"
    log = (run_dir / "logs" / "speaker_model.log").read_text()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + log[-3000:]
    steps = [json.loads(line) for line in (run_dir / "servers" / "speaker_model" / "metrics.jsonl").open()]
    assert [s["step"] for s in steps][:3] == [1, 2, 3]  # games in flight when step 3 lands may train more
    # Later games were played on trained weights, loaded into the running vLLM. (With 2 steps every game could begin
    # on version 0: the repeats of two tasks interleaved, both groups complete before step 1, and step 2 trained
    # the second at once. Two games at most are in flight when a group completes, so the third group's are later.)
    versions = {g.policy_versions["speaker_model"] for g in read_games(run_dir / "games.jsonl")}
    assert 0 in versions and max(versions) >= 1, versions
    assert (run_dir / "servers" / "speaker_model" / "vllm" / "vllm.log").exists()
    checkpoints = sorted(p.name for p in (run_dir / "servers" / "speaker_model" / "checkpoints").iterdir())
    assert checkpoints and checkpoints[-1] >= "step_000002"  # the newest are kept (keep_checkpoints: 2)
