"""The swarm server over real HTTP on 127.0.0.1: OpenAI SDK calls, exact token recording, merging, leases, errors."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import torch
from conftest import admin_http, play_episode, start_rolling, wait_state, wait_version
from transformers import AutoModelForCausalLM

from marl.protocol import ROUTE_HEALTH, SERVER_KEEP_ALIVE_S, TIMING_ENGINE, TIMING_MARL, parse_server_timing
from servers.entrypoint import default_trainer_factory
from servers.episodes.ledger import Ledger
from servers.trainers.grpo import token_logprobs

HTTPX_KEEP_ALIVE_S = httpx.Limits().keepalive_expiry  # what the openai SDK's httpx client keeps too

CLIENT = "client-a"


def begin(http: httpx.Client, client_id: str = CLIENT) -> dict:
    r = http.post("/episodes/begin", json={"client_id": client_id})
    assert r.status_code == 200, r.text
    return r.json()


def end(http: httpx.Client, episode_id: str, reward: float = 1.0, client_id: str = CLIENT, **extra) -> httpx.Response:
    return http.post(f"/episodes/{episode_id}/end",
                     json={"client_id": client_id, "task_id": "t0", "reward": reward, **extra})


def samples(srv, episode_id):
    ledger = Ledger(srv.data_dir / "ledger.sqlite")
    try:
        return ledger.samples_of(episode_id)
    finally:
        ledger.close()


@pytest.fixture
def rolling(local_server):
    """A trainable server, ROLLING, with a batch too big to fill during a test (no training interferes)."""
    with local_server() as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=100, num_repeat=4, lease_patience_s=60)
        yield srv, http


def test_openai_sdk_streaming_and_not(rolling):
    srv, http = rolling
    lease = begin(http)
    client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"])
    assert [m.id for m in client.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, seed=7, temperature=1.0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, seed=7, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content  # same seed, same tokens, same text
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert end(http, lease["episode_id"]).json()["samples"] == 2  # same prompt twice: two separate samples


def test_recorded_ids_and_logprobs_are_the_engines(rolling, tiny_model):
    srv, http = rolling
    lease = begin(http)
    client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"])
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say yes."}], max_tokens=16, logprobs=True,
        extra_body={"return_token_ids": True})
    body = reply.model_dump()
    prompt_ids, completion_ids = body["prompt_token_ids"], body["choices"][0]["token_ids"]
    returned_logprobs = [t["logprob"] for t in body["choices"][0]["logprobs"]["content"]]
    end(http, lease["episode_id"])
    (sample,) = samples(srv, lease["episode_id"])
    assert sample.token_ids == prompt_ids + completion_ids
    assert sample.loss_mask == [0] * len(prompt_ids) + [1] * len(completion_ids)
    recorded = sample.logprobs[len(prompt_ids):]
    assert recorded == pytest.approx(returned_logprobs, abs=1e-6)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.tensor([sample.token_ids])
    with torch.no_grad():
        fresh = token_logprobs(model, ids, torch.ones_like(ids))[0, len(prompt_ids):]  # aligned like Sample.logprobs
    assert fresh.tolist() == pytest.approx(recorded, abs=1e-4)


def test_multi_turn_conversation_merges_into_one_sample(rolling):
    srv, http = rolling
    lease = begin(http)
    client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"],
                           default_headers={"X-Marl-Agent": "speaker"})
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    completion_tokens = 0
    for turn in range(5):
        messages.append({"role": "user", "content": f"Turn {turn}: what is {turn} + 1?"})
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=1.0)
        completion_tokens += reply.usage.completion_tokens
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    # a second agent in the same episode, tagged through the `user` field
    other = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"])
    other.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                  user="listener")
    result = end(http, lease["episode_id"], agent_rewards={"speaker": 1.0, "listener": 0.0}).json()
    assert result["samples"] == 2
    speaker, listener = samples(srv, lease["episode_id"])
    assert (speaker.agent, speaker.num_calls, speaker.reward) == ("speaker", 5, 1.0)
    assert sum(speaker.loss_mask) == completion_tokens
    assert (listener.agent, listener.num_calls, listener.reward) == ("listener", 1, 0.0)


def test_an_agent_that_made_no_call_still_counts_in_its_group(local_server):
    """A role named in agent_rewards that never called (a villager killed before it spoke) gets an empty sample:
    its group reaches num_repeat episodes and the step trains (else that role's groups never complete)."""
    with local_server() as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=2, num_repeat=2, save_freq=0)  # both groups of task t0 must complete
        silent = []
        for listener_calls in (True, False):
            lease = begin(http)
            for agent in ("speaker", "listener")[: 1 + listener_calls]:
                openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"]).chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, user=agent)
            r = end(http, lease["episode_id"], agent_rewards={"speaker": 1.0, "listener": float(listener_calls)})
            assert r.status_code == 200 and r.json()["samples"] == 2, r.text
            silent = samples(srv, lease["episode_id"])
        listener = next(s for s in silent if s.agent == "listener")
        assert (listener.num_calls, listener.token_ids, listener.reward) == (0, [], 0.0)
        metrics = wait_version(http, 1)["metrics"]
        assert metrics["groups"] == 2 and metrics["groups_trained"] == 1  # the speaker's rewards are equal
        assert metrics["samples"] == 1  # of the listener's two, the one with tokens: the empty one is its baseline
        assert metrics["reward_mean/listener"] == pytest.approx(0.5)


def test_lease_expiry_requeues_and_kills_the_key(local_server):
    with local_server() as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=100, lease_patience_s=0.5)
        lease = begin(http)
        client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"], max_retries=0)
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        time.sleep(1.5)
        pool = http.get("/control/pool").json()
        assert (pool["expired"], pool["requeued"], pool["running_leases"]) == (1, 1, 0)
        with pytest.raises(openai.AuthenticationError, match="expired"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        r = end(http, lease["episode_id"])
        assert r.status_code == 404 and "expired" in r.json()["error"]["message"]
        state = http.get(f"/episodes/{lease['episode_id']}").json()
        assert state["can_continue"] is False


def test_abort_requeues_while_rolling_and_discards_after_batch_is_full(local_server):
    with local_server() as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=1, num_repeat=1, lease_patience_s=60)
        first, second, third = begin(http), begin(http), begin(http)
        r = http.post(f"/episodes/{first['episode_id']}/abort", json={"client_id": CLIENT})
        assert r.json()["disposition"] == "requeued"
        client = openai.OpenAI(base_url=second["base_url"], api_key=second["api_key"])
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert end(http, second["episode_id"]).status_code == 200  # the batch (1 group of 1) is complete
        wait_state(http, "ROLLING_POST")  # drained only when `third` goes
        refused = http.post("/episodes/begin", json={"client_id": CLIENT})
        assert refused.status_code == 503
        assert refused.json()["error"]["state"] == "ROLLING_POST" and refused.json()["error"]["retry_after_s"]
        r = http.post(f"/episodes/{third['episode_id']}/abort", json={"client_id": CLIENT})
        assert r.json()["disposition"] == "discarded"
        status = wait_state(http, "ROLLING")
        assert status["policy_version"] == 1 and status["metrics"]["train_steps"] == 1


def test_only_the_holder_may_end_or_abort(rolling):
    _, http = rolling
    lease = begin(http, client_id="alice")
    r = end(http, lease["episode_id"], client_id="mallory")
    assert r.status_code == 403 and "another client" in r.json()["error"]["message"]
    r = http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "mallory"})
    assert r.status_code == 403
    assert http.post(f"/episodes/{lease['episode_id']}/renew", json={"client_id": "alice"}).json()["can_continue"]
    assert end(http, lease["episode_id"], client_id="alice").status_code == 200


def test_control_plane_needs_the_admin_token(rolling):
    srv, http = rolling
    lease = begin(http)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {lease['api_key']}"}):
        for method, route in (("GET", "/control/status"), ("POST", "/control/stop"), ("POST", "/episodes/begin")):
            r = httpx.request(method, srv.url + route, headers=headers, json={"client_id": "x"})
            assert r.status_code == 401, (route, headers)
    r = httpx.get(srv.url + "/control/status", headers={"Authorization": f"Bearer {lease['api_key']}"})
    assert "episode key cannot reach the control plane" in r.json()["error"]["message"]
    assert http.get("/control/status").json()["state"] == "ROLLING"  # nothing was stopped


def test_bad_input_is_refused_with_a_clear_message_and_records_nothing(rolling):
    srv, http = rolling
    lease = begin(http)
    chat = httpx.Client(base_url=lease["base_url"], headers={"Authorization": f"Bearer {lease['api_key']}"})
    ok = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        (chat.post("/chat/completions", content=b"{not json", headers={"content-type": "application/json"}),
         400, "not valid JSON"),
        (chat.post("/chat/completions", json={"model": "tiny"}), 400, "messages"),
        (chat.post("/chat/completions", json={**ok, "model": "gpt-9"}), 404, "not served here"),
        (chat.post("/chat/completions", json={**ok, "messages": [{"role": "user", "content": "x " * 3000}]}),
         400, "context limit"),
        (chat.post("/chat/completions", json={**ok, "max_tokens": 10**6}), 400, "context limit"),
        (chat.post("/chat/completions", json={**ok, "temperature": 9}), 400, "temperature"),
        (http.post("/episodes/nope/end", json={"client_id": CLIENT, "task_id": "t", "reward": 1}), 404, "nope"),
        (http.post(f"/episodes/{lease['episode_id']}/end", json={"client_id": CLIENT}), 400, "task_id"),
        (http.post("/control/config", json={"batch_size": 0}), 400, "batch_size"),
        (http.post("/control/config", json={"bacth_size": 4}), 400, "bacth_size"),
    ]
    for response, status, words in cases:
        assert response.status_code == status, response.text
        assert words in response.json()["error"]["message"], response.text
    r = end(http, lease["episode_id"])
    assert r.status_code == 200 and r.json()["samples"] == 0  # none of the bad calls was recorded


def test_engine_states_and_refusals(local_server):
    with local_server() as srv, admin_http(srv.url) as http:
        assert http.get("/control/status").json()["state"] == "OFFLINE"
        r = http.post("/episodes/begin", json={"client_id": CLIENT})
        assert r.status_code == 409 and "start the engine" in r.json()["error"]["message"]
        assert http.post("/control/start").status_code == 200
        second = http.post("/control/start")
        assert second.status_code == 409 and second.json()["error"]["code"] == "engine_not_offline"
        wait_state(http, "ROLLING")
        r = http.post("/control/config", json={"batch_size": 7})
        assert r.status_code == 409 and "stop the engine first" in r.json()["error"]["message"]
        lease = begin(http)
        assert http.post("/control/stop").json()["state"] == "OFFLINE"
        r = httpx.post(lease["base_url"] + "/chat/completions", headers={"Authorization": f"Bearer {lease['api_key']}"},
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 401 and "stopped" in r.json()["error"]["message"]


def test_static_server_serves_without_leases(local_server):
    with local_server(static=True) as srv, admin_http(srv.url) as http:
        wait_state(http, "STATIC")
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="anything")
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
        assert reply.usage.completion_tokens >= 1
        r = http.post("/episodes/begin", json={"client_id": CLIENT})
        assert r.status_code == 409 and "static" in r.json()["error"]["message"]


def test_samples_too_stale_to_train_on_are_dropped_and_counted(local_server):
    with local_server() as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=1, num_repeat=2, max_staleness=0, save_freq=0)
        play_episode(http, "old", 1.0)  # its group never completes at version 0
        play_episode(http, "a", 1.0)
        play_episode(http, "a", 0.0)
        wait_version(http, 1)
        assert {g["task_id"] for g in http.get("/control/pool").json()["groups"]} == {"old"}
        play_episode(http, "b", 1.0)
        play_episode(http, "b", 0.0)
        status = wait_version(http, 2)
        assert status["metrics"]["samples_dropped_stale"] == 1 and status["metrics"]["dropped_stale"] == 1
        assert http.get("/control/pool").json()["groups"] == []


def test_weights_reach_the_engine_through_a_directory_when_the_trainer_lives_elsewhere(local_server, tiny_model):
    """A trainer in another process has no tensors to hand over (`named_weights` is None): the server publishes
    through `export_weights` and the engine's `load_weights_from`, and serves exactly the trained weights."""
    trainers = []

    def remote_like(model_dir, config):
        trainer = default_trainer_factory("cpu")(model_dir, config)
        trainer.named_weights = lambda: None
        trainers.append(trainer)
        return trainer

    with local_server(trainer_factory=remote_like) as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=1, num_repeat=2, save_freq=0, learning_rate=1e-2)
        play_episode(http, "a", 1.0)
        play_episode(http, "a", 0.0)
        wait_version(http, 1)
        served = srv.server.lifecycle.engine.model.state_dict()
        trained = trainers[0].policy.state_dict()
        base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
        assert any(not torch.equal(trained[name], base[name]) for name in trained)  # the step moved the policy
        for name, tensor in trained.items():
            assert torch.equal(served[name], tensor), name
        assert not list(srv.data_dir.glob(".weights-*"))  # the exported copy is removed once loaded


def test_a_chat_call_looks_its_key_up_once_and_header_tags_win(rolling, monkeypatch):
    """The key is admitted once, from the headers (before the body is read), and the call runs under that lease; the
    `X-Marl-Agent` header tags the call, `user` only when there is no header."""
    srv, http = rolling
    lease = begin(http)
    admitted = []
    admit = srv.server.chat.admit
    monkeypatch.setattr(srv.server.chat, "admit", lambda key: admitted.append(key) or admit(key))
    client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"], max_retries=0)
    hi = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model="tiny", messages=hi, max_tokens=2, user="ignored",
                                   extra_headers={"X-Marl-Agent": "seer"})
    client.chat.completions.create(model="tiny", messages=hi, max_tokens=2, user="wolf")
    assert admitted == [lease["api_key"]] * 2
    assert end(http, lease["episode_id"]).json()["samples"] == 2
    assert sorted(s.agent for s in samples(srv, lease["episode_id"])) == ["seer", "wolf"]


def test_a_chat_completion_reports_the_engines_time_and_the_servers_own_as_server_timing(rolling):
    """`Server-Timing: engine;dur=<ms>, marl;dur=<ms>`: the engine's share of a non-streaming call's latency and the
    server's own (bench/scale.py reports both); a streamed reply has its status line sent before the engine runs:
    none."""
    _, http = rolling
    lease = begin(http)
    call = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    key = {"Authorization": f"Bearer {lease['api_key']}"}
    started = time.perf_counter()
    reply = http.post("/v1/chat/completions", json=call, headers=key)
    seen_ms = (time.perf_counter() - started) * 1000
    assert reply.status_code == 200, reply.text
    timings = parse_server_timing(reply.headers["server-timing"])
    assert list(timings) == [TIMING_ENGINE, TIMING_MARL]
    assert timings[TIMING_ENGINE] > 0 and timings[TIMING_MARL] > 0
    assert timings[TIMING_ENGINE] + timings[TIMING_MARL] < seen_ms  # both inside what the client saw
    streamed = http.post("/v1/chat/completions", json={**call, "stream": True}, headers=key)
    assert streamed.status_code == 200 and "server-timing" not in streamed.headers


def test_server_timing_is_read_by_metric_name():
    assert parse_server_timing("engine;dur=12.5, marl;dur=0.25") == {"engine": 12.5, "marl": 0.25}
    assert parse_server_timing('cache;desc="hit", db;dur=3;desc=x') == {"db": 3.0}  # no duration: left out
    assert parse_server_timing("") == {}


def test_end_and_commit_replies_carry_the_pool_only_when_asked(rolling):
    srv, http = rolling
    ended, asked = begin(http), begin(http)
    assert end(http, ended["episode_id"]).json()["pool"] is None
    reply = http.post(f"/episodes/{asked['episode_id']}/end?include_pool=true",
                      json={"client_id": CLIENT, "task_id": "t0", "reward": 1.0}).json()
    assert reply["pool"]["batch_size"] == 100 and reply["pool"]["running_leases"] == 0
    again = end(http, asked["episode_id"]).json()  # asking is no part of the body: a plain repeat is the same end
    assert again["replayed"] and again["pool"] is None
    for include_pool in ("false", "true"):
        episode_id = begin(http)["episode_id"]
        prepared = http.post(f"/episodes/{episode_id}/prepare",
                             json={"client_id": CLIENT, "task_id": "t0", "reward": 1.0, "game_id": "g"})
        assert prepared.status_code == 200 and "pool" not in prepared.json()
        committed = http.post(f"/episodes/{episode_id}/commit?include_pool={include_pool}", json={"client_id": CLIENT})
        assert (committed.json()["pool"] is not None) == (include_pool == "true")


def test_an_idle_connection_outlives_the_clients_keep_alive(local_server):
    """A seat waits more than httpx's 5 s between calls in a long game; the server must not be the side that closes
    the idle connection (a call sent as it closes fails, and a call under a lease is not retried)."""
    import http.client

    with local_server(static=True) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("GET", ROUTE_HEALTH)
        assert conn.getresponse().read() and conn.sock is not None
        sock = conn.sock
        time.sleep(HTTPX_KEEP_ALIVE_S + 0.5)
        conn.request("GET", ROUTE_HEALTH)  # on the same socket: it fails if the server closed it meanwhile
        answer = conn.getresponse()
        assert answer.status == 200 and conn.sock is sock
        conn.close()
    assert SERVER_KEEP_ALIVE_S > HTTPX_KEEP_ALIVE_S
