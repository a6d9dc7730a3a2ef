"""A server of several LoRA policies on one base model: each policy its own learner (pool, ledger, version, steps),
one engine batching their adapters, one trainer stepping one adapter at a time; real server, real HTTP, tiny model."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import openai
import pytest

from marl import SwarmClient
from marl.protocol import LoraSpec, TrainConfig
from servers.episodes.ledger import Ledger
from servers.episodes.samples import token_versions
from tests.conftest import ADMIN, admin_http, wait_state

pytestmark = pytest.mark.timeout(600)

POLICIES = {"speaker": LoraSpec(rank=4, alpha=8), "listener": LoraSpec(rank=8, alpha=8)}
#: Large enough that one step visibly moves the adapter of a random tiny model.
CONFIG = TrainConfig(batch_size=1, num_repeat=2, save_freq=1, grpo={"learning_rate": 0.05})


def start_policies(http, **overrides) -> None:
    config = CONFIG.model_copy(update=overrides)
    for policy in POLICIES:
        r = http.post("/control/config", params={"policy": policy}, json=config.model_dump(mode="json"))
        assert r.status_code == 200, r.text
    assert http.post("/control/start").status_code == 200
    for policy in POLICIES:
        wait_policy(http, policy, "ROLLING")


def wait_policy(http, policy: str, state: str, version: int = 0) -> dict:
    import time

    deadline = time.monotonic() + 120
    while True:
        status = http.get("/control/status", params={"policy": policy}).json()
        if status["state"] == state and status["policy_version"] >= version:
            return status
        assert time.monotonic() < deadline, f"{policy} stayed {status['state']} v{status['policy_version']}"
        time.sleep(0.05)


def greedy(lease: dict, prompt: str = "hello") -> list[float]:
    """The logprobs of a short greedy completion under the lease's policy."""
    client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"])
    reply = client.chat.completions.create(model=lease["model"], messages=[{"role": "user", "content": prompt}],
                                           max_tokens=6, temperature=0, logprobs=True)
    return [t.logprob for t in reply.choices[0].logprobs.content]


def play(http, policy: str, task_id: str, reward: float) -> str:
    lease = http.post("/episodes/begin", json={"client_id": "c", "policy": policy}).json()
    greedy(lease, f"task {task_id}")
    r = http.post(f"/episodes/{lease['episode_id']}/end", json={"client_id": "c", "task_id": task_id,
                                                                 "reward": reward})
    assert r.status_code == 200, r.text
    return lease["episode_id"]


def ledger_episodes(data_dir: Path, policy: str) -> list[str]:
    db = sqlite3.connect(data_dir / "policies" / policy / "ledger.sqlite")
    try:
        return [row[0] for row in db.execute("SELECT episode_id FROM episodes")]
    finally:
        db.close()


def test_a_policys_step_leaves_the_other_rolling_and_unchanged(local_server, tmp_path):
    with local_server(policies=POLICIES) as srv, admin_http(srv.url) as http:
        start_policies(http)
        models = http.get("/v1/models").json()["data"]
        assert {card["id"] for card in models} == set(POLICIES)

        # a listener episode mid-conversation while the speaker trains
        listening = http.post("/episodes/begin", json={"client_id": "c", "policy": "listener"}).json()
        assert listening["model"] == "listener" and listening["episode_id"].startswith("listener.")
        before = greedy(listening)
        speaker_ids = [play(http, "speaker", "t", reward) for reward in (0.0, 1.0)]
        wait_policy(http, "speaker", "ROLLING", version=1)
        assert http.get("/control/status", params={"policy": "listener"}).json()["policy_version"] == 0

        after = greedy(listening)  # the same lease goes on, on the same (untouched) adapter
        assert after == pytest.approx(before, abs=1e-6)
        r = http.post(f"/episodes/{listening['episode_id']}/end", json={"client_id": "c", "task_id": "t",
                                                                         "reward": 1.0})
        assert r.status_code == 200, r.text
        play(http, "listener", "t", 0.0)
        wait_policy(http, "listener", "ROLLING", version=1)

        # each policy's ledger holds its own episodes only; ids carry the policy
        assert sorted(ledger_episodes(srv.data_dir, "speaker")) == sorted(speaker_ids)
        assert all(e.startswith("listener.") for e in ledger_episodes(srv.data_dir, "listener"))
        assert len(ledger_episodes(srv.data_dir, "listener")) == 2
        status = http.get("/control/status").json()
        assert {name: s["policy_version"] for name, s in status["policies"].items()} == {"speaker": 1,
                                                                                           "listener": 1}
        metrics = http.get("/metrics").text
        assert 'marl_policy_version{model="tiny",policy="speaker"} 1.0' in metrics
        speaker = http.get("/control/monitor", params={"policy": "speaker"}).json()  # overwatch's row of a policy
        assert [s["step"] for s in speaker["recent_steps"]] == [1] and speaker["pool"]["num_repeat"] == 2
        merged = http.get("/control/monitor").json()
        assert sorted(s["policy"] for s in merged["recent_steps"]) == ["listener", "speaker"]


def test_a_trained_policy_serves_differently_and_resumes_exactly(local_server, tmp_path):
    data_dir = tmp_path / "server"
    with local_server(policies=POLICIES, data_dir=data_dir) as srv, admin_http(srv.url) as http:
        start_policies(http)
        lease = http.post("/episodes/begin", json={"client_id": "c", "policy": "speaker"}).json()
        untrained = greedy(lease)
        http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "c"})
        for reward in (0.0, 1.0):
            play(http, "speaker", "t", reward)
        wait_policy(http, "speaker", "ROLLING", version=1)
        lease = http.post("/episodes/begin", json={"client_id": "c", "policy": "speaker"}).json()
        trained = greedy(lease)
        http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "c"})
        assert trained != pytest.approx(untrained, abs=1e-4)  # the adapter moved
    assert (data_dir / "policies" / "speaker" / "checkpoints").is_dir()

    with local_server(policies=POLICIES, data_dir=data_dir) as srv, admin_http(srv.url) as http:
        start_policies(http)
        assert wait_policy(http, "speaker", "ROLLING", version=1)["policy_version"] == 1
        lease = http.post("/episodes/begin", json={"client_id": "c", "policy": "speaker"}).json()
        assert greedy(lease) == pytest.approx(trained, abs=1e-6)  # the adapter checkpoint, served again


def test_a_call_must_name_a_policy_the_server_trains(local_server):
    with local_server(policies=POLICIES) as srv, admin_http(srv.url) as http:
        start_policies(http)
        r = http.post("/episodes/begin", json={"client_id": "c"})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "policy_required")
        r = http.post("/episodes/begin", json={"client_id": "c", "policy": "critic"})
        assert (r.status_code, r.json()["error"]["code"]) == (404, "policy_not_found")
        assert "speaker" in r.json()["error"]["message"]
        r = http.post("/episodes/nobody.123/end", json={"client_id": "c", "task_id": "t", "reward": 0})
        assert (r.status_code, r.json()["error"]["code"]) == (404, "episode_not_found")
        wait_state(http, "ROLLING")


def test_the_client_binds_one_policy(local_server):
    with local_server(policies=POLICIES) as srv:
        speaker = SwarmClient(srv.url, admin_token=ADMIN, policy="speaker")
        listener = SwarmClient(srv.url, admin_token=ADMIN, policy="listener")
        config = CONFIG.model_copy(update={"save_freq": 0})
        for client in (speaker, listener):
            assert client.auto_sync_train_config_and_start_engine(config).state.value == "ROLLING"
        with speaker.episode("t") as ep:
            assert ep.model == "speaker"
            ep.openai().chat.completions.create(model=ep.model, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3)
            ep.reward = 1.0
        assert speaker.pool().pending_episodes == 1 and listener.pool().pending_episodes == 0
        with pytest.raises(Exception, match="policy"):
            SwarmClient(srv.url, admin_token=ADMIN).begin_episode(timeout=5)


def test_with_overlap_each_policy_steps_without_draining_its_own_leases(local_server):
    """`overlap` per policy: the speaker's step runs while one of its own leases stays open mid-conversation (no
    drain would ever finish), and that lease's next call runs on the new adapter."""
    with local_server(policies=POLICIES) as srv, admin_http(srv.url) as http:
        start_policies(http, overlap=True)
        open_lease = http.post("/episodes/begin", json={"client_id": "c", "policy": "speaker"}).json()
        greedy(open_lease, "first turn")
        for reward in (0.0, 1.0):
            play(http, "speaker", "t", reward)
        wait_policy(http, "speaker", "ROLLING", version=1)  # stepped with `open_lease` still open
        assert http.get("/control/status", params={"policy": "listener"}).json()["policy_version"] == 0
        greedy(open_lease, "second turn")
        r = http.post(f"/episodes/{open_lease['episode_id']}/end",
                      json={"client_id": "c", "task_id": "t2", "reward": 1.0})
        assert r.status_code == 200, r.text
        ledger = Ledger(srv.data_dir / "policies" / "speaker" / "ledger.sqlite")
        try:
            samples = ledger.samples_of(open_lease["episode_id"])  # two calls, two unrelated prompts: two samples
        finally:
            ledger.close()
        assert {v for s in samples for v, m in zip(token_versions(s), s.loss_mask, strict=True) if m} == {0, 1}
