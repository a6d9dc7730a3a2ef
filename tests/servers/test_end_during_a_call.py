"""`end` (or `prepare`) while the lease's own call is still generating: the call is waited for and recorded with the
episode, or (past `CALLS_WAIT_S`) the request is refused with 503 `calls_in_flight` and a retry records it. A served
call is never dropped. Real server app on 127.0.0.1 over the stub engine, whose generation is held by a gate."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import ADMIN
from stubs import REPLY_TEXT, StubServer, recorded_episodes, stub_server

from marl import SwarmClient
from marl.protocol import ROUTE_END, ErrorCode
from servers.episodes import recorder as episode_recorder
from servers.episodes.leases import Lease
from servers.errors import Refusal

pytestmark = pytest.mark.timeout(120)

CONFIG = {"batch_size": 100, "num_repeat": 2, "save_freq": 0}


@pytest.fixture
def server(tiny_model, tmp_path):
    with stub_server(tiny_model, tmp_path / "server") as srv:
        yield srv


def _call_in_flight(srv: StubServer, client: SwarmClient, io: ThreadPoolExecutor):
    """Begin an episode and start one chat call, held by the engine's gate mid-generation: (episode id, the call)."""
    client.auto_sync_train_config_and_start_engine(CONFIG, timeout=60)
    episode_id, lease = client.begin_episode(timeout=30)
    srv.backends.generate_gate.clear()
    call = io.submit(httpx.post, f"{lease.base_url}/chat/completions", timeout=60,
                     headers={"Authorization": f"Bearer {lease.api_key}"},
                     json={"model": lease.model, "messages": [{"role": "user", "content": "hi"}]})
    assert srv.backends.generating.wait(30), "the call never started generating"
    return episode_id, call


@pytest.mark.parametrize("how", ["end", "prepare"])
def test_end_waits_for_the_call_in_flight_and_records_it(server, how):
    with SwarmClient(server.url, ADMIN, timeout=30) as client, ThreadPoolExecutor(2) as io:
        episode_id, call = _call_in_flight(server, client, io)
        ending = io.submit(client.end_episode, "t", episode_id, 1.0) if how == "end" else \
            io.submit(client.prepare_episode, "t", episode_id, 1.0, game_id="g")
        time.sleep(0.5)
        assert not ending.done(), "end answered while the lease's call was still generating"
        server.backends.generate_gate.set()
        answer = ending.result(timeout=30)
        reply = call.result(timeout=30)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == REPLY_TEXT
    assert answer.samples == 1 and answer.trainable_tokens > 0  # the call is in the episode, not dropped
    if how == "end":
        (episode,) = recorded_episodes(server.data_dir)
        assert episode["episode_id"] == episode_id and episode["agents"] == ["default"]


def test_end_past_the_wait_is_refused_and_its_retry_records_the_call(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(episode_recorder, "CALLS_WAIT_S", 0.3)
    with stub_server(tiny_model, tmp_path / "server") as srv, SwarmClient(srv.url, ADMIN, timeout=30) as client, \
            ThreadPoolExecutor(2) as io:
        episode_id, call = _call_in_flight(srv, client, io)
        body = {"client_id": client.client_id, "task_id": "t", "reward": 1.0}
        refused = httpx.post(srv.url + ROUTE_END.format(episode_id=episode_id), json=body, timeout=30,
                             headers={"Authorization": f"Bearer {ADMIN}"})
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == ErrorCode.CALLS_IN_FLIGHT and error["retry_after_s"] > 0
        assert client.can_continue_episode(episode_id)  # nothing recorded: the lease is live again
        threading.Timer(1.0, srv.backends.generate_gate.set).start()
        answer = client.end_episode("t", episode_id, 1.0)  # told to wait, retried until the call finished
        assert call.result(timeout=30).status_code == 200
    assert answer.samples == 1
    assert [e["agents"] for e in recorded_episodes(srv.data_dir)] == [["default"]]


def test_a_call_that_would_start_generating_on_a_sealed_lease_is_refused():
    lease = Lease(episode_id="e", key="k", client_id="c", generation=1, patience_s=60.0)
    lease.sealed = True  # its end is waiting for the calls in flight: a new one would come too late for it
    with pytest.raises(Refusal) as info, lease.busy():
        pytest.fail("the call generated")
    assert info.value.code is ErrorCode.INVALID_API_KEY and lease.inflight == 0
