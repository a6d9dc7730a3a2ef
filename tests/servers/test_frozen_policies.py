"""Frozen policies: a policy's past adapters served by its own server, unleased and untrained, on the shared engine
(the league's `past_of` a LoRA policy). Real server, real HTTP, a tiny model, PEFT as the reference."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import ADMIN, admin_http
from tests.servers.test_policy_server import (
    POLICIES,
    greedy,
    ledger_episodes,
    play,
    start_policies,
    wait_policy,
)
from tests.servers.test_static_adapter import peft_greedy

pytestmark = pytest.mark.timeout(600)

MESSAGES = [{"role": "user", "content": "hello there"}]


def adapter_of(data_dir: Path, step: int) -> Path:
    return data_dir / "policies" / "speaker" / "checkpoints" / f"step_{step:06d}" / "adapter"


def train_speaker(http: httpx.Client, version: int) -> None:
    for reward in (0.0, 1.0):
        play(http, "speaker", f"t{version}", reward)
    wait_policy(http, "speaker", "ROLLING", version=version)


def frozen_call(url: str, key: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60, json={
        "model": model, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True,
        "return_token_ids": True})


def reply_of(r: httpx.Response) -> tuple[list[int], list[int], list[float]]:
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    return body["prompt_token_ids"], choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]


def speaker_lease_logprobs(http: httpx.Client) -> list[float]:
    lease = http.post("/episodes/begin", json={"client_id": "c", "policy": "speaker"}).json()
    try:
        return greedy(lease, "hello there")
    finally:
        http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "c"})


def test_a_frozen_policy_serves_its_checkpoint_while_the_live_one_trains(local_server, tiny_model, tmp_path):
    from peft import PeftModel

    data_dir = tmp_path / "server"
    with local_server(policies=POLICIES, data_dir=data_dir) as srv, admin_http(srv.url) as http:
        start_policies(http)
        train_speaker(http, 1)
        r = http.post("/control/frozen", json={"name": "speaker@1", "adapter": str(adapter_of(data_dir, 1)),
                                               "policy_version": 1})
        assert r.status_code == 200, r.text
        key = r.json()["api_key"]
        assert http.post("/control/frozen", json={"name": "speaker@0"}).json()["api_key"] == key
        assert {m["id"] for m in http.get("/v1/models").json()["data"]} == {*POLICIES, "speaker@0", "speaker@1"}
        prompt_ids, ids_v1, frozen_v1 = reply_of(frozen_call(srv.url, key, "speaker@1"))
        _, ids_v0, frozen_v0 = reply_of(frozen_call(srv.url, key, "speaker@0"))
        assert speaker_lease_logprobs(http) == pytest.approx(frozen_v1, abs=1e-5)  # the live policy, at v1 too

        train_speaker(http, 2)  # the live policy moves on; the frozen one does not
        assert speaker_lease_logprobs(http) != pytest.approx(frozen_v1, abs=1e-4)
        assert reply_of(frozen_call(srv.url, key, "speaker@1"))[2] == pytest.approx(frozen_v1, abs=1e-6)
        assert len(ledger_episodes(data_dir, "speaker")) == 4  # frozen calls are recorded nowhere

        engine = srv.server.frozen._engine.current
        slots = engine.lora._count
        assert http.delete("/control/frozen/speaker@1").json() == {"data": [
            {"name": "speaker@0", "adapter": None, "policy_version": None, "api_key": key}]}
        assert "speaker@1" not in engine.lora.names
        r = frozen_call(srv.url, key, "speaker@1")
        assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")
        r = http.delete("/control/frozen/speaker@1")
        assert (r.status_code, r.json()["error"]["code"]) == (404, "frozen_policy_not_found")
        r = http.post("/control/frozen", json={"name": "speaker@2", "adapter": str(adapter_of(data_dir, 2))})
        assert r.status_code == 200 and engine.lora._count == slots  # the freed slot is taken again

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    plain_ids, plain = peft_greedy(base, prompt_ids, len(ids_v0))  # version 0: a fresh adapter is the base alone
    assert ids_v0 == plain_ids and frozen_v0 == pytest.approx(plain, abs=1e-4)
    adapted = PeftModel.from_pretrained(base, adapter_of(data_dir, 1)).eval()
    ids, expected = peft_greedy(adapted, prompt_ids, len(ids_v1))
    assert ids == ids_v1 and frozen_v1 == pytest.approx(expected, abs=1e-4)


def test_frozen_policy_refusals(local_server, tmp_path):
    data_dir = tmp_path / "server"
    with local_server(policies=POLICIES, data_dir=data_dir) as srv, admin_http(srv.url) as http:
        start_policies(http, save_freq=0)
        key = http.post("/control/frozen", json={"name": "speaker@0"}).json()["api_key"]
        r = http.post("/control/frozen", json={"name": "speaker@0", "adapter": str(tmp_path)})
        assert (r.status_code, r.json()["error"]["code"]) == (409, "frozen_policy_exists")
        r = http.post("/control/frozen", json={"name": "speaker@9", "adapter": str(tmp_path)})
        assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (
            400, "invalid_request", "adapter")
        r = http.post("/control/frozen", json={"name": "speaker"})  # a live policy's name: no separator
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_request")
        r = httpx.post(f"{srv.url}/control/frozen", json={"name": "speaker@1"}, headers={
            "Authorization": f"Bearer {key}"})
        assert (r.status_code, r.json()["error"]["code"]) == (401, "unauthorized")  # its key is no admin token
        assert frozen_call(srv.url, key[:-2] + "xx", "speaker@0").json()["error"]["code"] == "invalid_api_key"
        r = frozen_call(srv.url, ADMIN, "speaker@0")
        assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key")
        assert frozen_call(srv.url, key, "speaker@0").status_code == 200
        r = frozen_call(srv.url, key, "speaker")  # the frozen key reaches frozen policies only
        assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")

    with local_server(data_dir=tmp_path / "plain") as srv, admin_http(srv.url) as http:
        r = http.post("/control/frozen", json={"name": "speaker@0"})
        assert (r.status_code, r.json()["error"]["code"]) == (409, "no_policies")


def test_a_pool_of_a_policys_past_selves_loads_and_unloads_them_on_its_server(local_server, tmp_path):
    import openai

    from marl.league import SnapshotPool
    from marl.league.frozen_fleet import FrozenFleet
    from marl.topology import PastOfSpec

    run_dir = tmp_path / "run"
    data_dir = run_dir / "servers" / "team"  # where marl run puts its data: the pool reads the checkpoints there
    with local_server(policies=POLICIES, data_dir=data_dir) as srv, admin_http(srv.url) as http:
        start_policies(http)
        pool = SnapshotPool("past", PastOfSpec(server="team", policy="speaker", k=1), base_model="tiny",
                            run_dir=run_dir, fleet=FrozenFleet(lambda: srv.url, token=ADMIN)).start()
        try:
            assert pool.versions() == [0]
            assert [f["name"] for f in http.get("/control/frozen").json()["data"]] == ["speaker@0"]
            train_speaker(http, 1)
            pool.refresh()
            assert pool.versions() == [1]
            assert [f["name"] for f in http.get("/control/frozen").json()["data"]] == ["speaker@1"]  # 0 retired
            with pool.draw() as endpoint:
                assert (endpoint.model, endpoint.policy_version, endpoint.snapshot_of) == ("speaker@1", 1,
                                                                                           "team.speaker")
                client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
                reply = client.chat.completions.create(model=endpoint.model, messages=MESSAGES, max_tokens=3)
                assert reply.model == "speaker@1"
            http.post("/control/stop")  # a restarted engine serves no frozen policy: the pool loads it again
            start_policies(http)
            assert http.get("/control/frozen").json()["data"] == []
            pool.refresh()
            assert [f["name"] for f in http.get("/control/frozen").json()["data"]] == ["speaker@1"]
        finally:
            pool.close()
        assert http.get("/control/frozen").json()["data"] == []
