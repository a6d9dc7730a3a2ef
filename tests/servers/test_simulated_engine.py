"""The simulated engine and trainer (`marl serve --engine simulated`): the latency model's arithmetic, concurrent
generations counted and run as one batch, weight loads that drain, and a real `marl serve` subprocess on them driven
through a few hundred episodes over HTTP, training, checkpointing and resuming as a real server does."""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from marl.runner.launch import ServerProcess
from servers.backends import SamplingParams
from servers.engines.simulated import LatencyModel, SimulatedEngine
from tests.conftest import ADMIN, admin_http, start_rolling, wait_state, wait_version

pytestmark = [pytest.mark.serial, pytest.mark.timeout(180)]


def test_only_marl_serve_offers_it():
    from pydantic import ValidationError

    from marl.topology.spec import ServerSpec
    from servers.entrypoint import ServeOptions

    with pytest.raises(ValidationError):  # a user's topology never runs on the simulation
        ServerSpec(model="x", engine="simulated")
    with pytest.raises(ValueError, match="simulated-speed"):
        ServeOptions(model="x", port=1, engine="simulated", simulated_speed=0)
    args = ServerProcess(model="x", admin_token=ADMIN, data_dir=Path("d"), log_path=Path("l"), engine="simulated",
                         simulated_speed=50.0).args  # fmt: skip
    assert args[args.index("--engine"):][:4] == ["--engine", "simulated", "--simulated-speed", "50.0"]


def test_latency_model_arithmetic():
    model = LatencyModel()
    assert model.itl(1) == pytest.approx(0.0066, abs=0.0005)  # ~6.5 ms per decode step at batch 1
    assert 0.025 <= model.itl(256) <= 0.030  # ~25-30 ms at 256 running sequences
    itls = [model.itl(n) for n in (1, 2, 16, 64, 256)]
    assert itls == sorted(itls) and len(set(itls)) == len(itls)
    ttfts = [model.ttft(512, n) for n in (1, 16, 256)]
    assert ttfts == sorted(ttfts) and model.ttft(4096, 1) > model.ttft(512, 1)
    assert model.ttft(15_000, 1) == pytest.approx(1.0 + model.ttft_base_s + model.itl(1))  # 15k prefill tokens/s
    fast = LatencyModel(speed=40.0)
    assert fast.itl(64) == pytest.approx(model.itl(64) / 40)
    assert fast.ttft(300, 8) == pytest.approx(model.ttft(300, 8) / 40)
    assert fast.weight_load() == pytest.approx(model.weight_load() / 40)
    with pytest.raises(ValueError):
        LatencyModel(speed=0)


async def _generate(engine: SimulatedEngine, params: SamplingParams, prompt=(5, 6, 7)) -> tuple[list, list, str]:
    ids, logprobs, finish = [], [], None
    async for chunk in engine.generate(list(prompt), params):
        ids += chunk.token_ids
        logprobs += chunk.logprobs
        finish = chunk.finish_reason
    return ids, logprobs, finish


def test_concurrent_generations_run_as_one_batch(tiny_model):
    engine = SimulatedEngine(tiny_model, max_running=12)  # real time: ~0.17 s per wave of 12
    seen: list[int] = []

    async def main():
        async def watch():
            while True:
                seen.append(engine.stats.running)
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        started = time.perf_counter()
        results = await asyncio.gather(*(_generate(engine, SamplingParams(max_tokens=20, seed=i)) for i in range(30)))
        watcher.cancel()
        return results, time.perf_counter() - started

    results, elapsed = asyncio.run(main())
    assert max(seen) == engine.stats.max_running == 12  # the rest waited for a slot, as in vLLM
    assert engine.stats.running == engine.stats.waiting == 0 and engine.stats.finished_requests == 30
    # 30 requests of <= 20 tokens, 12 at a time: about 3 waves' time, far less than 30 one after the other
    one_wave = engine.latency.ttft(3, 12) + 19 * engine.latency.itl(12)
    assert elapsed < 5 * one_wave
    assert engine.stats.generated_tokens == sum(len(ids) for ids, _, _ in results)


def test_generated_ids_logprobs_and_seeds(tiny_model):
    engine = SimulatedEngine(tiny_model, latency=LatencyModel(speed=1000.0), mean_completion_tokens=8)
    special = set(engine.tokenizer.all_special_ids) | engine.eos_token_ids

    async def main():
        return await asyncio.gather(*(_generate(engine, SamplingParams(max_tokens=24, seed=i)) for i in range(40)))

    results = asyncio.run(main())
    assert {finish for _, _, finish in results} == {"stop", "length"}
    for ids, logprobs, finish in results:
        assert len(ids) == len(logprobs) and all(lp < 0 for lp in logprobs)
        assert not special & set(ids[:-1])
        assert (ids[-1] in engine.eos_token_ids) == (finish == "stop")
        assert finish == "stop" or len(ids) == 24
    again = asyncio.run(_generate(engine, SamplingParams(max_tokens=24, seed=3)))
    assert again == results[3]  # seeded: the same prompt and seed give the same generation
    with pytest.raises(ValueError, match="adapter"):
        asyncio.run(_generate(engine, SamplingParams(max_tokens=4, adapter="nope")))


def test_a_generation_nobody_streams_comes_whole_at_the_streamed_ones_time(tiny_model):
    engine = SimulatedEngine(tiny_model, mean_completion_tokens=1000)  # real time; max_tokens ends every generation

    async def chunks(stream: bool) -> tuple[list, float]:
        started, got = time.perf_counter(), []
        async for chunk in engine.generate([5, 6, 7], SamplingParams(max_tokens=40, seed=1, stream=stream)):
            got.append(chunk)
        return got, time.perf_counter() - started

    streamed, streamed_s = asyncio.run(chunks(True))
    whole, whole_s = asyncio.run(chunks(False))
    assert len(streamed) == 40 and len(whole) == 1  # one wake-up per token against one chunk at the end
    assert whole[0].token_ids == [i for c in streamed for i in c.token_ids]
    assert whole[0].logprobs == [lp for c in streamed for lp in c.logprobs]
    assert whole[0].finish_reason == streamed[-1].finish_reason == "length"
    # both take the latency model's time (sleeps are never shorter than asked): the first token's, then 39 steps
    least = engine.latency.ttft(3, 1) + 39 * engine.latency.itl(1)
    assert whole_s >= 0.95 * least and streamed_s >= 0.95 * least


def test_waiting_requests_get_freed_slots_in_order_and_a_cancelled_one_loses_none(tiny_model):
    engine = SimulatedEngine(tiny_model, max_running=1, latency=LatencyModel(speed=20.0))
    order: list[int] = []

    async def one(i: int) -> None:
        await _generate(engine, SamplingParams(max_tokens=8, seed=i))
        order.append(i)

    async def main():
        tasks = []
        for i in range(4):
            tasks.append(asyncio.create_task(one(i)))
            while engine.stats.running + engine.stats.waiting < i + 1:  # each has asked for its slot
                await asyncio.sleep(0.001)
        tasks[2].cancel()  # it waits behind 0 and 1
        await asyncio.gather(*tasks, return_exceptions=True)
        await _generate(engine, SamplingParams(max_tokens=2))  # no slot was lost to the cancelled one

    asyncio.run(main())
    assert order == [0, 1, 3]
    assert engine.stats.running == engine.stats.waiting == 0 and engine.stats.max_running == 1

    async def closed_while_waiting():
        # the holder keeps the one slot while it is not pulled on: at speed 20 its 50 tokens took 17 ms, and on a
        # loaded machine the waiter could find the slot free again and never wait (this test then hung)
        holder = engine.generate([5, 6, 7], SamplingParams(max_tokens=50))
        await holder.__anext__()
        waiter = asyncio.create_task(_generate(engine, SamplingParams(max_tokens=2)))
        while engine.stats.waiting == 0:
            await asyncio.sleep(0.001)
        engine.close()
        with pytest.raises(RuntimeError, match="closed"):
            await waiter
        await holder.aclose()

    asyncio.run(closed_while_waiting())


def test_weight_load_waits_for_running_generations(tiny_model):
    engine = SimulatedEngine(tiny_model, latency=LatencyModel(speed=100.0, weight_load_s=1.0))
    events: list[str] = []

    async def main():
        first = asyncio.create_task(_generate(engine, SamplingParams(max_tokens=100, seed=0), prompt=[9] * 40))
        while engine.stats.running == 0:
            await asyncio.sleep(0.001)
        load = asyncio.create_task(asyncio.to_thread(lambda: (engine.load_weights([]), events.append("loaded"))))
        while not engine._swapping:
            await asyncio.sleep(0.001)
        later = asyncio.create_task(_generate(engine, SamplingParams(max_tokens=2)))
        await first
        events.append("first done")
        await later
        events.append("later done")
        await load

    asyncio.run(main())
    assert events == ["first done", "loaded", "later done"] and engine.stats.weight_loads == 1
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(_generate(engine, SamplingParams(max_tokens=2)))


EPISODES, CONCURRENCY, GROUP = 256, 32, 4  # 64 tasks of 4 episodes: 16 steps of batch_size 4


async def _episode(client: httpx.AsyncClient, task: int, rng: random.Random) -> str | None:
    """Begin (waiting out 503s while a step trains), one chat call, end; the episode id once ended."""
    while (r := await client.post("/episodes/begin", json={"client_id": "bench"})).status_code == 503:
        await asyncio.sleep(0.05)
    assert r.status_code == 200, r.text
    lease = r.json()
    call = await client.post(f"{lease['base_url']}/chat/completions",
                             headers={"Authorization": f"Bearer {lease['api_key']}"},
                             json={"model": lease["model"], "max_tokens": 16, "messages": [
                                 {"role": "user", "content": f"task {task}: say something"}]})  # fmt: skip
    assert call.status_code == 200, call.text
    end = await client.post(f"/episodes/{lease['episode_id']}/end",
                            json={"client_id": "bench", "task_id": f"task-{task}", "reward": rng.random()})
    assert end.status_code == 200, end.text
    return lease["episode_id"]


async def _play(url: str) -> list[str]:
    rng, gate = random.Random(0), asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60,
                                 limits=httpx.Limits(max_connections=CONCURRENCY * 2)) as client:  # fmt: skip
        async def one(i: int) -> str | None:
            async with gate:
                return await _episode(client, i // GROUP, rng)

        return await asyncio.gather(*(one(i) for i in range(EPISODES)))


def test_trainable_server_on_the_simulated_engine_and_trainer(tiny_model, tmp_path):
    data_dir = tmp_path / "server"
    proc = ServerProcess(model=str(tiny_model), admin_token=ADMIN, data_dir=data_dir, device="cpu",
                         served_name="tiny", engine="simulated", simulated_speed=1000.0,
                         log_path=tmp_path / "server.log").start()  # fmt: skip
    try:
        proc.wait_healthy(timeout=60)
        http = admin_http(proc.url)
        start_rolling(http, batch_size=4, num_repeat=GROUP, max_staleness=16, save_freq=4, keep_checkpoints=2)
        started = time.perf_counter()
        ended = asyncio.run(_play(proc.url))
        status = wait_version(http, EPISODES // GROUP // 4)
        print(f"{EPISODES} episodes, {status['policy_version']} steps in {time.perf_counter() - started:.1f} s")

        db = sqlite3.connect(data_dir / "ledger.sqlite")
        recorded = {row[0] for row in db.execute("SELECT episode_id FROM episodes")}
        db.close()
        assert len(ended) == EPISODES and recorded == set(ended)  # every ended episode is in the ledger
        rows = [json.loads(line) for line in (data_dir / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == list(range(1, 17))
        assert all(row["samples"] == 16 and row["trained"] == 1 and "reward_mean" in row for row in rows)

        page = httpx.get(f"{proc.url}/metrics").text  # the engine's counters reach /metrics as the torch engine's do
        assert 'marl_engine_prompt_tokens_total{' in page and 'kind="prefilled"' in page

        assert http.post("/control/stop").status_code == 200  # resume from the newest checkpoint (step 16)
        wait_state(http, "OFFLINE")
        assert http.post("/control/start").status_code == 200
        assert wait_state(http, "ROLLING")["policy_version"] == 16
    finally:
        proc.kill()
