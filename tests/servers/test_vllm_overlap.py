"""`overlap: true` on the vLLM engine (the CPU build): leases keep calling while each step trains and its weights are
reloaded into vLLM, over three steps, and not one call fails.

Needs the vLLM environment (`make vllm`, or $MARL_VLLM_PYTHON); skipped without it. Its own file (one vLLM at a
time: the module fixture of tests/servers/test_vllm_engine.py stops its vLLM first).
"""

from __future__ import annotations

import threading

import openai
import pytest
from conftest import admin_http, begin_lease, wait_state, wait_version
from tiny_model import build_tiny_model

from marl.protocol import TrainConfig
from servers.engines.vllm_process import VLLM_PYTHON_ENV, vllm_python
from tests.servers.test_vllm_engine import START_TIMEOUT_S, VLLMServer, end, lease_client

pytestmark = [
    pytest.mark.skipif(not vllm_python().exists(),
                       reason=f"no vLLM environment at {vllm_python()} (`make vllm`, or set ${VLLM_PYTHON_ENV})"),
    pytest.mark.timeout(900),
]

STEPS = 3


def test_calls_run_through_overlapped_weight_syncs_without_a_failure(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", hidden_size=64, num_heads=2)  # head_dim 32: vLLM's CPU minimum
    config = TrainConfig(batch_size=1, num_repeat=2, overlap=True, max_staleness=2, save_freq=0,
                         lease_patience_s=600, grpo={"learning_rate": 1e-2})
    with VLLMServer(model, tmp_path / "server", vllm_flags=["--vllm-kv-cache-gb", "0.25"]) as srv, \
            admin_http(srv.url) as http:
        assert http.post("/control/config", json=config.model_dump(mode="json")).status_code == 200
        assert http.post("/control/start").status_code == 200
        wait_state(http, "ROLLING", timeout=START_TIMEOUT_S)
        failures: list[Exception] = []
        done = threading.Event()
        players = [threading.Thread(target=play, args=(http, f"p{i}", done, failures)) for i in range(2)]
        for player in players:
            player.start()
        try:
            wait_version(http, STEPS, timeout=START_TIMEOUT_S)
        finally:
            done.set()
            for player in players:
                player.join(120)
        engine = srv.server.lifecycle.engine
        status = http.get("/control/status").json()
    assert failures == []
    assert engine.stats.weight_loads >= STEPS and engine.stats.restarts == 0
    assert status["policy_version"] >= STEPS


def play(http, name: str, done: threading.Event, failures: list[Exception]) -> None:
    """Episodes of two-turn conversations, one after another, until `done`; every failed call is kept."""
    episode = 0
    while not done.is_set():
        episode += 1
        try:
            lease = begin_lease(http, timeout=START_TIMEOUT_S)  # a full pool answers 503 meanwhile
            client = lease_client(lease)
            messages = [{"role": "user", "content": f"{name} game {episode}"}]
            for _ in range(2):
                reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, seed=episode)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                             {"role": "user", "content": "again"}]
            end(http, lease["episode_id"], f"task-{episode % 2}", float(episode % 2))
        except (openai.APIError, AssertionError) as exc:
            if not done.is_set():
                failures.append(exc)
