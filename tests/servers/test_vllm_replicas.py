"""The vLLM engine's replicas (`vllm.data_parallel_size`): sticky routing of a lease's calls, every weight load on every
replica, and calls held (not failed) while a weight sync has vLLM paused. The engine runs for real, on two stand-in
vLLM processes (tests/servers/stand_in_vllm.py) that refuse while paused as vLLM 0.33 does (503
`ServiceUnavailableError`; streamed, an SSE error event before any token)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from servers.backends import SamplingParams
from servers.engines.vllm_engine import VLLMEngine
from servers.engines.vllm_http import paused_error, paused_refusal
from servers.engines.vllm_process import VLLMSettings
from servers.engines.vllm_replicas import AffinityRouter, SyncGate
from tests.servers.stand_in_vllm import PAUSED_BODY, stand_in_python

pytestmark = pytest.mark.timeout(120)

SYNC = ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"]


# ------------------------------------------------------------------------------------------------------------------
# the router and the gate alone
# ------------------------------------------------------------------------------------------------------------------


def test_a_key_stays_on_its_replica_and_first_calls_go_to_the_least_loaded():
    router = AffinityRouter(3)
    up = [True, True, True]
    assert router.pick("a", [2, 0, 1], up) == 1  # least loaded
    assert router.pick("a", [0, 5, 0], up) == 1  # its home, however loaded
    assert router.pick("b", [0, 0, 0], up) in (0, 2)  # equal load: not the replica that is home to a key already
    homes = {router.home_of("a"), router.home_of("b")}
    assert router.pick("c", [0, 0, 0], up) not in homes  # each replica home to one key
    assert sorted(router.home_of(k) for k in "abc") == [0, 1, 2]


def test_a_down_replicas_keys_move_and_memory_is_bounded():
    router = AffinityRouter(2, max_keys=2)
    assert router.pick("a", [0, 1], [True, True]) == 0
    assert router.pick("a", [0, 1], [False, True]) == 1  # its home is down: it moves, and stays moved
    assert router.pick("a", [0, 9], [True, True]) == 1
    router.pick("b", [0, 0], [True, True])
    router.pick("c", [0, 0], [True, True])
    assert router.home_of("a") is None and router.home_of("c") is not None  # the least recently used is forgotten
    with pytest.raises(LookupError):
        router.pick("d", [0, 0], [False, False])


def test_calls_without_a_key_spread_over_replicas():
    router = AffinityRouter(2)
    assert {router.pick(None, [0, 0], [True, True]) for _ in range(4)} == {0, 1}


def test_the_gate_holds_a_waiter_on_its_loop_until_another_thread_opens_it():
    gate = SyncGate()

    async def main() -> list[str]:
        events: list[str] = []
        gate.close()
        waiter = asyncio.create_task(gate.passed())
        await asyncio.sleep(0)
        assert not waiter.done()
        events.append("held")
        threading.Thread(target=gate.open).start()  # a weight sync's worker thread
        await asyncio.wait_for(waiter, 10)
        events.append("passed")
        await gate.passed()  # open: at once
        return events

    assert asyncio.run(main()) == ["held", "passed"]


def test_a_paused_refusal_is_told_by_its_error_type_or_code_alone():
    assert paused_refusal(503, json.dumps(PAUSED_BODY).encode())  # vLLM 0.33's, exactly
    assert paused_error(PAUSED_BODY["error"])  # its streamed form: the same body as an SSE event
    assert paused_refusal(503, b'{"error": {"message": "x", "type": "engine_paused", "code": 503}}')
    assert paused_refusal(503, b'{"error": {"message": "x", "type": "ServiceUnavailable", "code": "engine_paused"}}')
    assert not paused_refusal(503, b'{"error": {"message": "engine_paused", "type": "x", "code": 503}}')
    assert not paused_refusal(500, json.dumps(PAUSED_BODY).encode())
    assert not paused_refusal(503, b"Service Unavailable")
    assert not paused_error({"message": "x", "type": "InternalServerError", "code": 500}) and not paused_error(None)


# ------------------------------------------------------------------------------------------------------------------
# the engine on two stand-in replicas
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    scratch = tmp_path_factory.mktemp("replicas")
    engine = VLLMEngine(model_dir, device="cpu", settings=VLLMSettings(data_parallel_size=2),
                        python=stand_in_python(scratch), work_dir=scratch / "work", start_timeout_s=60)
    yield engine
    engine.close()


def calls(url: str) -> list[str]:
    return [path for path, _, _ in httpx.get(f"{url}/calls").json()]


def generate(engine: VLLMEngine, key: str | None, stream: bool = False) -> list[int]:
    async def run() -> list[int]:
        ids: list[int] = []
        async for chunk in engine.generate([1, 2, 3], SamplingParams(max_tokens=2, stream=stream, affinity=key)):
            ids += chunk.token_ids
        return ids

    return asyncio.run(run())


def test_each_replica_is_a_process_of_its_own_that_generated_once(engine):
    assert len(set(engine.replica_urls)) == 2
    for url in engine.replica_urls:
        assert calls(url) == ["/v1/completions"]  # the start's one-token check
    assert (engine.work_dir / "vllm.log").exists() and (engine.work_dir / "vllm-1.log").exists()


def test_a_leases_calls_stay_on_one_replica(engine):
    before = [calls(url).count("/v1/completions") for url in engine.replica_urls]
    for turn in range(3):
        assert generate(engine, "episode-a", stream=bool(turn % 2)) == [5, 6]
        assert generate(engine, "episode-b") == [5, 6]
    after = [calls(url).count("/v1/completions") for url in engine.replica_urls]
    assert sorted(a - b for a, b in zip(after, before)) == [3, 3]  # one lease per replica, all 3 calls on it
    assert engine.stats.prefilled_tokens == 6 * 3


def test_a_weight_load_reaches_every_replica(engine, model_dir):
    marks = [len(calls(url)) for url in engine.replica_urls]
    engine.load_weights_from(model_dir)
    for url, mark in zip(engine.replica_urls, marks):
        assert calls(url)[mark:] == SYNC
    assert engine.stats.weight_loads == 1


def test_a_call_during_a_weight_sync_is_held_then_served(engine, model_dir):
    urls = engine.replica_urls
    for url in urls:
        httpx.post(f"{url}/hold_reloads")
    sync = threading.Thread(target=engine.load_weights_from, args=(model_dir,))
    sync.start()
    wait_until(lambda: all(calls(url)[-1] == "/collective_rpc" for url in urls))  # paused, reloading
    held: list[list[int]] = []
    caller = threading.Thread(target=lambda: held.append(generate(engine, "episode-a")))
    caller.start()
    wait_until(lambda: engine._replicas.gate.waiting == 1)  # at the gate, not at vLLM
    for url in urls:
        httpx.post(f"{url}/release_reloads")
    sync.join(30)
    caller.join(30)
    assert held == [[5, 6]] and engine.stats.paused_retries == 0
    home = urls[engine._replicas.router.home_of("episode-a")]
    assert calls(home)[-5:] == [*SYNC, "/v1/completions"]  # sent once vLLM resumed


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_vllm_refuses_as_paused_is_sent_again_until_served(engine, stream):
    home = engine.replica_urls[engine._replicas.router.home_of("episode-b")]
    before = engine.stats.paused_retries
    httpx.post(f"{home}/pause")  # paused behind the engine's back: only vLLM's refusal says so
    served: list[list[int]] = []
    caller = threading.Thread(target=lambda: served.append(generate(engine, "episode-b", stream=stream)))
    caller.start()
    wait_until(lambda: engine.stats.paused_retries >= before + 2)
    assert caller.is_alive()  # held, not failed
    httpx.post(f"{home}/resume")
    caller.join(30)
    assert served == [[5, 6]]


def wait_until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
