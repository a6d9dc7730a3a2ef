"""The whole loop learns: client -> server -> ledger -> GRPO trainer -> new weights -> client, on a tiny model."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ADMIN

from marl import SwarmClient

TARGET = {i for i in range(512) if i % 4 == 0}  # about a quarter of the vocabulary: chance is ~0.25


def rollout(client: SwarmClient, task: str) -> float:
    with client.episode(task) as ep:
        reply = ep.openai(agent="solver").chat.completions.create(
            model=ep.model, messages=[{"role": "user", "content": f"Task {task}: say something."}],
            max_tokens=1, extra_body={"return_token_ids": True})
        ep.reward = float(reply.model_dump()["choices"][0]["token_ids"][0] in TARGET)
    return ep.reward


#: A round is one training batch's episodes (4 groups of 8). An idle 2-core machine needs a handful; the bound is
#: in rounds, not seconds, so a busy machine only makes the test slower.
MAX_ROUNDS = 40


@pytest.mark.timeout(1200)
def test_reward_rises_from_chance_to_above_0_8_within_40_training_batches(local_server):
    with local_server() as srv, SwarmClient(srv.url, admin_token=ADMIN) as client:
        client.auto_sync_train_config_and_start_engine(
            {"batch_size": 4, "num_repeat": 8, "learning_rate": 1e-2, "save_freq": 0})
        rewards: list[float] = []
        start = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            for _ in range(MAX_ROUNDS):
                tasks = [f"{len(rewards) // 32}-{g}" for g in range(4) for _ in range(8)]
                rewards += pool.map(lambda t: rollout(client, t), tasks)
                if len(rewards) >= 64 and sum(rewards[-32:]) / 32 > 0.8:
                    break
        first, last = sum(rewards[:32]) / 32, sum(rewards[-32:]) / 32
        print(f"reward {first:.2f} -> {last:.2f} in {time.monotonic() - start:.0f}s over {len(rewards)} episodes;"
              f" policy version {client.status().policy_version}")
        assert first < 0.5
        assert last > 0.8
        assert client.status().policy_version >= 1
