"""`overlap: true`: a complete batch trains while leases keep beginning, calling and ending on the current weights;
the new weights then serve, later calls record the new version, and an episode whose calls ran on two versions is
one sample that the next step trains with each token's own behaviour logprob. Real server, tiny model, real trainer
held at a gate so the test sees the step running."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest

from marl.protocol import TrainConfig
from servers.episodes.ledger import Ledger
from servers.episodes.samples import token_versions
from servers.trainers.grpo import GRPOTrainer
from tests.conftest import admin_http

pytestmark = pytest.mark.timeout(300)

CONFIG = TrainConfig(batch_size=1, num_repeat=2, overlap=True, max_staleness=2, save_freq=0,
                     grpo={"learning_rate": 0.05})


class GatedTrainer(GRPOTrainer):
    """The GRPO trainer, each step held until the test opens `gate` (and `stepping` set meanwhile)."""

    def __init__(self, *args, gate: threading.Event, stepping: threading.Event, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate, self.stepping = gate, stepping

    def step(self, batch):
        self.stepping.set()
        assert self.gate.wait(120), "the test never opened the gate"
        self.gate.clear()
        return super().step(batch)


def begin(http) -> tuple[dict, openai.OpenAI]:
    lease = http.post("/episodes/begin", json={"client_id": "c"}).json()
    client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"], max_retries=0)
    client.served_model = lease["model"]
    return lease, client


def say(client: openai.OpenAI, history: list[dict], text: str) -> None:
    """One more turn of a conversation (the next call's prompt extends the last: one merged sample)."""
    history.append({"role": "user", "content": text})
    reply = client.chat.completions.create(model=client.served_model, messages=history, max_tokens=4,
                                           temperature=1.0, seed=1)
    history.append({"role": "assistant", "content": reply.choices[0].message.content})


def end(http, lease: dict, task: str, reward: float) -> None:
    r = http.post(f"/episodes/{lease['episode_id']}/end", json={"client_id": "c", "task_id": task, "reward": reward})
    assert r.status_code == 200, r.text


def wait_version(http, version: int) -> dict:
    deadline = time.monotonic() + 120
    while (status := http.get("/control/status").json())["policy_version"] < version:
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    return status


def test_leases_roll_on_while_a_step_trains(local_server, tmp_path):
    gate, stepping = threading.Event(), threading.Event()

    def trainer(model_dir, config):
        return GatedTrainer(model_dir, config.grpo, device="cpu", gate=gate, stepping=stepping)

    with local_server(trainer_factory=trainer) as srv, admin_http(srv.url) as http:
        assert http.post("/control/config", json=CONFIG.model_dump(mode="json")).status_code == 200
        assert http.post("/control/start").status_code == 200
        while http.get("/control/status").json()["state"] != "ROLLING":
            time.sleep(0.05)
        early, early_client = begin(http)  # begun before the step
        early_history: list[dict] = []
        say(early_client, early_history, "first turn")
        for reward in (0.0, 1.0):  # a complete batch: the step starts
            lease, client = begin(http)
            say(client, [], "hello")
            end(http, lease, "t1", reward)
        assert stepping.wait(60)
        status = http.get("/control/status").json()
        assert status["state"] == "ROLLING" and status["policy_version"] == 0  # training, nothing drained
        during, during_client = begin(http)  # begun during the step
        say(during_client, [], "during the step")
        say(early_client, early_history, "second turn, still version 0")
        gate.set()
        wait_version(http, 1)
        say(early_client, early_history, "third turn, after the swap")  # the same lease: the new weights
        end(http, early, "t2", 1.0)
        end(http, during, "t2", 0.0)
        ledger = Ledger(srv.data_dir / "ledger.sqlite")
        try:
            [spanning] = ledger.samples_of(early["episode_id"])
            [during_sample] = ledger.samples_of(during["episode_id"])
        finally:
            ledger.close()
        versions = {v for v, m in zip(token_versions(spanning), spanning.loss_mask, strict=True) if m}
        assert versions == {0, 1} and spanning.policy_version == 0 and spanning.num_calls == 3
        assert during_sample.policy_version == 0
        gate.set()  # the next step: the group of t2, whose samples ran partly on version 0
        wait_version(http, 2)
        steps = [json.loads(line) for line in (srv.data_dir / "metrics.jsonl").read_text().splitlines()]
        assert [s["step"] for s in steps] == [1, 2]
        assert steps[1]["offpolicy_frac"] > 0 and steps[1]["staleness_max"] == 1.0
        assert steps[1]["importance_weight_mean"] > 0 and steps[0]["offpolicy_frac"] == 0.0
        assert all(0.0 <= s["rollout_idle_frac"] <= 1.0 for s in steps)
        scrape = http.get("/metrics").text
        assert "marl_generation_busy_seconds_total" in scrape and "marl_last_step_offpolicy_frac" in scrape
        assert "marl_last_step_rollout_idle_frac" in scrape and "marl_last_step_staleness_max" in scrape


def test_samples_beyond_max_staleness_are_dropped_and_counted(local_server):
    """max_staleness 0: an episode that began on version 0 and ended after step 1 is never trained on."""
    config = CONFIG.model_copy(update={"max_staleness": 0})
    with local_server() as srv, admin_http(srv.url) as http:
        assert http.post("/control/config", json=config.model_dump(mode="json")).status_code == 200
        assert http.post("/control/start").status_code == 200
        while http.get("/control/status").json()["state"] != "ROLLING":
            time.sleep(0.05)
        old, old_client = begin(http)
        say(old_client, [], "generated on version 0")
        for reward in (0.0, 1.0):  # a complete batch: step 1 trains while `old` stays open
            lease, client = begin(http)
            say(client, [], "hello")
            end(http, lease, "t1", reward)
        wait_version(http, 1)
        end(http, old, "t2", 1.0)  # its group fills with a version-1 episode: the stale one is dropped first
        fresh, client = begin(http)
        say(client, [], "generated on version 1")
        end(http, fresh, "t2", 0.0)
        deadline = time.monotonic() + 60
        while (status := http.get("/control/status").json())["metrics"]["samples_dropped_stale"] < 1:
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert status["policy_version"] == 1  # its group is one short again: no step 2 yet
        refill, client = begin(http)
        say(client, [], "generated on version 1 too")
        end(http, refill, "t2", 1.0)
        wait_version(http, 2)
        steps = [json.loads(line) for line in (srv.data_dir / "metrics.jsonl").read_text().splitlines()]
        assert steps[1]["samples"] == 2 and steps[1]["dropped_stale"] == 0 and steps[1]["staleness_max"] == 0.0
        assert http.get("/control/status").json()["metrics"]["samples_dropped_stale"] == 1


def test_rollouts_run_at_most_max_staleness_batches_ahead_of_training(local_server):
    """max_staleness 1, batches of 2 episodes: while step 1 trains, two more leases may run (the next batch); a third
    would be trained two versions late and is refused with 503 rollouts_ahead until the step is done."""
    gate, stepping = threading.Event(), threading.Event()

    def trainer(model_dir, config):
        return GatedTrainer(model_dir, config.grpo, device="cpu", gate=gate, stepping=stepping)

    config = CONFIG.model_copy(update={"max_staleness": 1})
    with local_server(trainer_factory=trainer) as srv, admin_http(srv.url) as http:
        assert http.post("/control/config", json=config.model_dump(mode="json")).status_code == 200
        assert http.post("/control/start").status_code == 200
        while http.get("/control/status").json()["state"] != "ROLLING":
            time.sleep(0.05)
        for reward in (0.0, 1.0):  # a complete batch: step 1 starts
            lease, client = begin(http)
            say(client, [], "hello")
            end(http, lease, "t1", reward)
        assert stepping.wait(60)
        deadline = time.monotonic() + 60
        while http.get("/control/pool").json()["pending_episodes"]:  # until step 1 has claimed its batch
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ahead = [begin(http)[0] for _ in range(2)]  # the next batch, generated while step 1 trains
        refused = http.post("/episodes/begin", json={"client_id": "c"})
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "rollouts_ahead" and error["retry_after_s"] > 0 and "max_staleness" in error["message"]
        gate.set()
        wait_version(http, 1)
        begin(http)  # step 1 is done: room again
        for lease, reward in zip(ahead, (0.0, 1.0), strict=True):
            end(http, lease, "t2", reward)
