"""A server SIGKILLed between two training steps resumes exactly: same step, same optimizer state, no episode twice."""

from __future__ import annotations

import sqlite3

import torch
from conftest import admin_http, play_episode, server_process, start_rolling, wait_version
from safetensors.torch import load_file

from marl.protocol import TrainConfig
from servers.backends import Group, TrainBatch
from servers.episodes.ledger import Ledger
from servers.trainers.grpo import GRPOTrainer
from servers.training.checkpoint_dirs import CheckpointDir

CONFIG = dict(batch_size=1, num_repeat=2, save_freq=1, learning_rate=1e-3)


def test_sigkill_between_steps_resumes_at_the_right_step_with_the_same_optimizer(tiny_model, tmp_path):
    data = tmp_path / "data"
    with server_process(tiny_model, data) as (proc, url), admin_http(url) as http:
        start_rolling(http, **CONFIG)
        play_episode(http, "a", 1.0)
        play_episode(http, "a", 0.0)  # group "a" complete: step 1, checkpointed
        wait_version(http, 1)
        waiting = play_episode(http, "b", 1.0)  # half of step 2's group is in the pool
        proc.kill()

    with server_process(tiny_model, data) as (proc, url), admin_http(url) as http:
        start_rolling(http, **CONFIG)
        status = http.get("/control/status").json()
        assert status["policy_version"] == 1 and status["pool"]["pending_episodes"] == 1
        last = play_episode(http, "b", 0.0)
        wait_version(http, 2)
        proc.kill()

    db = sqlite3.connect(data / "ledger.sqlite")
    steps = dict(db.execute("SELECT episode_id, consumed_step FROM samples").fetchall())
    assert sorted(steps.values()) == [1, 1, 2, 2] and steps[waiting] == steps[last] == 2  # each trained once
    db.close()

    # Replay step 2 from the step-1 checkpoint in this process: the server's step-2 weights must match, which holds
    # only if it resumed with the checkpoint's optimizer state (a fresh optimizer gives visibly different weights).
    checkpoints = dict((step, path) for step, path in CheckpointDir(data / "checkpoints").all())
    ledger = Ledger(data / "ledger.sqlite")
    samples = ledger.samples_of(waiting) + ledger.samples_of(last)
    batch = TrainBatch(step=2, groups=[Group(job="default", task_id="b", agent="default", samples=samples)])
    served = load_file(checkpoints[2] / "model.safetensors")

    def replay(resume: bool) -> float:
        trainer = GRPOTrainer(tiny_model, TrainConfig(**CONFIG).grpo, device="cpu")
        if resume:
            trainer.load(checkpoints[1])
        else:
            trainer.policy.load_state_dict(load_file(checkpoints[1] / "model.safetensors"), strict=False)
        trainer.step(batch)
        weights = dict(trainer.named_weights())
        return max((weights[k] - v).abs().max().item() for k, v in served.items())

    assert replay(resume=True) < 1e-5
    assert replay(resume=False) > 1e-4
    state = torch.load(checkpoints[2] / "trainer_state.pt", weights_only=False)
    assert state["step_count"] == 2
