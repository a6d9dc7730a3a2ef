"""TorchEngine on tiny random models: batching, exact logprobs, sampling, stops, weight swaps, cancellation."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from tiny_model import build_tiny_model

from servers.backends import GenerationChunk, SamplingParams
from servers.engines.torch_engine import TorchEngine

TEXTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog. A werewolf hides among the villagers at night.",
    "What is 2 + 3?",
    "The seer checks one player each night; the witch holds a potion to save and a potion to poison. Player 1",
]


def build_lively_model(directory: Path, seed: int = 0, **kwargs) -> Path:
    """A tiny model whose greedy outputs vary from token to token.

    At the default init scale a random tiny model repeats one token forever, which would let a wrong token order
    or a wrong row pass the comparisons below; weights 8x larger give sharp, varied predictions.
    """
    from transformers import AutoModelForCausalLM

    build_tiny_model(directory, seed=seed, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" not in name:
                weight.mul_(8)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lively_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    with TorchEngine(model_dir) as engine:
        yield engine


@pytest.fixture
def own_engine(model_dir: Path):
    """A private engine, for tests that change its weights or state. It never samples an eos (lengths are exact)."""
    with TorchEngine(model_dir) as engine:
        engine.eos_token_ids = frozenset()
        yield engine


def prompts(engine: TorchEngine) -> list[list[int]]:
    return [engine.tokenizer.encode(text) for text in TEXTS]


async def collect(engine: TorchEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float], str]:
    ids: list[int] = []
    logprobs: list[float] = []
    finish = None
    async for chunk in engine.generate(prompt, params):
        assert isinstance(chunk, GenerationChunk) and finish is None  # nothing after the last chunk
        ids += chunk.token_ids
        logprobs += chunk.logprobs
        finish = chunk.finish_reason
    assert finish in ("stop", "length") and len(ids) == len(logprobs)
    return ids, logprobs, finish


def ended_properly(engine: TorchEngine, ids: list[int], finish: str, max_tokens: int) -> bool:
    """Ended at max_tokens with "length", or earlier at an eos (the shared engine keeps the model's eos)."""
    if finish == "length":
        return len(ids) == max_tokens
    return finish == "stop" and len(ids) <= max_tokens and ids[-1] in engine.eos_token_ids


def run_all(engine: TorchEngine, requests: list[tuple[list[int], SamplingParams]]):
    async def main():
        return await asyncio.gather(*(collect(engine, p, params) for p, params in requests))

    return asyncio.run(main())


def hf_greedy(model, prompt: list[int], n: int, eos: frozenset[int]) -> list[int]:
    """`model.generate` without sampling, stopping at the same eos tokens as the engine under test."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=sorted(eos) or None)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_concurrent_requests_share_forward_passes(own_engine: TorchEngine) -> None:
    engine = own_engine
    n, tokens = 8, 12
    results = run_all(engine, [(prompts(engine)[i % 4], SamplingParams(max_tokens=tokens, seed=i)) for i in range(n)])
    assert all(len(ids) == tokens and finish == "length" for ids, _, finish in results)
    assert engine.stats.generated_tokens == n * tokens
    assert engine.stats.forwards <= tokens + n  # at worst one prefill per request plus one decode step per token
    assert engine.stats.forwards < n * tokens / 4  # one request after the other would take n * tokens forwards
    assert engine.stats.max_batch == n


def test_logprobs_match_a_full_forward_pass_across_a_mixed_length_batch(engine: TorchEngine) -> None:
    params = [
        SamplingParams(max_tokens=24, temperature=1.0, seed=1),
        SamplingParams(max_tokens=17, temperature=0.0),
        SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, seed=2),  # logprobs stay raw: T=1, no top-p
        SamplingParams(max_tokens=9, temperature=1.3, seed=3),
    ]
    batch = list(zip(prompts(engine), params, strict=True))
    results = run_all(engine, batch)
    for (prompt, _), (ids, logprobs, _) in zip(batch, results, strict=True):
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt + ids])).logits[0].float()
        expected = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1].gather(1, torch.tensor(ids)[:, None])
        torch.testing.assert_close(torch.tensor(logprobs), expected.squeeze(1), atol=1e-4, rtol=0)


def test_requests_joining_and_leaving_a_running_batch_stay_exact(engine: TorchEngine) -> None:
    """Continuous batching: newcomers longer and shorter than the batch join mid-flight, rows leave in any order."""
    generator = torch.Generator().manual_seed(0)
    lengths = [4, 50, 9, 33, 2, 70, 15, 5]
    max_tokens = [40, 5, 30, 8, 25, 6, 12, 20]
    batch = [
        (torch.randint(3, engine.vocab_size, (n,), generator=generator).tolist(),
         SamplingParams(max_tokens=m, temperature=0.0 if i % 2 else 1.0, seed=i))
        for i, (n, m) in enumerate(zip(lengths, max_tokens, strict=True))
    ]  # fmt: skip
    before = engine.stats.prefill_forwards

    async def main():
        tasks = []
        for prompt, params in batch:  # each one arrives after the batch has made a few more tokens
            start = engine.stats.generated_tokens
            tasks.append(asyncio.create_task(collect(engine, prompt, params)))
            while engine.stats.generated_tokens < start + 3:
                await asyncio.sleep(0.0005)
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert engine.stats.prefill_forwards - before >= 4  # they really joined a running batch
    for (prompt, params), (ids, logprobs, finish) in zip(batch, results, strict=True):
        assert ended_properly(engine, ids, finish, params.max_tokens)
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt + ids])).logits[0].float()
        expected = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1].gather(1, torch.tensor(ids)[:, None])
        torch.testing.assert_close(torch.tensor(logprobs), expected.squeeze(1), atol=1e-4, rtol=0)
        if params.temperature == 0:
            assert ids == hf_greedy(engine.model, prompt, params.max_tokens, engine.eos_token_ids)


def test_greedy_equals_hf_generate(engine: TorchEngine) -> None:
    batch = [(p, SamplingParams(max_tokens=20, temperature=0.0)) for p in prompts(engine)]
    for (prompt, _), (ids, _, _) in zip(batch, run_all(engine, batch), strict=True):
        assert ids == hf_greedy(engine.model, prompt, 20, engine.eos_token_ids)


def test_seeded_requests_reproduce(engine: TorchEngine) -> None:
    prompt = prompts(engine)[2]
    params = SamplingParams(max_tokens=25, temperature=1.0, top_p=0.95, seed=1234)
    alone = run_all(engine, [(prompt, params)])[0][0]
    assert run_all(engine, [(prompt, params)])[0][0] == alone
    # Same seed inside a batch of other (unseeded and seeded) requests: same tokens.
    others = [(p, SamplingParams(max_tokens=40, temperature=1.0)) for p in prompts(engine)]
    in_batch = run_all(engine, [*others, (prompt, params)])[-1][0]
    assert in_batch == alone
    different = run_all(engine, [(prompt, SamplingParams(max_tokens=25, temperature=1.0, seed=99))])[0][0]
    assert different != alone


def test_max_tokens_stop_strings_and_eos(own_engine: TorchEngine) -> None:
    engine = own_engine
    prompt = prompts(engine)[1]
    greedy = run_all(engine, [(prompt, SamplingParams(max_tokens=12, temperature=0.0))])[0]
    assert len(greedy[0]) == 12 and greedy[2] == "length"

    # A stop string: generation ends at the first token whose decoded completion contains it (token included).
    text = engine.tokenizer.decode(greedy[0])
    stop = text[3:6]
    expected = next(n for n in range(1, 13) if stop in engine.tokenizer.decode(greedy[0][:n]))
    ids, logprobs, finish = run_all(engine, [(prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                                     stop=("never there", stop)))])[0]  # fmt: skip
    assert (ids, logprobs, finish) == (greedy[0][:expected], greedy[1][:expected], "stop")

    # An eos token ends the generation with "stop" and is part of the completion.
    eos = greedy[0][4]
    engine.eos_token_ids = frozenset({eos})
    ids, _, finish = run_all(engine, [(prompt, SamplingParams(max_tokens=12, temperature=0.0))])[0]
    assert finish == "stop" and ids == greedy[0][: greedy[0].index(eos) + 1]


def test_load_weights_drains_running_requests_and_queues_new_ones(own_engine: TorchEngine, tmp_path: Path) -> None:
    engine = own_engine
    from transformers import AutoModelForCausalLM

    new_model = AutoModelForCausalLM.from_pretrained(build_lively_model(tmp_path / "new", seed=1))
    new_weights = list(new_model.state_dict().items())
    long_prompt, short_prompt = prompts(engine)[1], prompts(engine)[2]
    no_eos = frozenset[int]()
    old_long = hf_greedy(engine.model, long_prompt, 200, no_eos)
    new_short = hf_greedy(new_model, short_prompt, 10, no_eos)
    assert old_long != hf_greedy(new_model, long_prompt, 200, no_eos)

    async def main():
        running = asyncio.create_task(collect(engine, long_prompt, SamplingParams(max_tokens=200, temperature=0.0)))
        while engine.stats.generated_tokens == 0 or engine.running_requests == 0:
            await asyncio.sleep(0.001)
        loader = threading.Thread(target=engine.load_weights, args=(new_weights,))
        loader.start()
        while engine._swap_requests == 0:  # the swap is now waiting for the running request to finish
            await asyncio.sleep(0.001)
        arriving = asyncio.create_task(collect(engine, short_prompt, SamplingParams(max_tokens=10, temperature=0.0)))
        results = await asyncio.gather(running, arriving)
        await asyncio.to_thread(loader.join)
        return results

    (long_ids, _, _), (short_ids, _, _) = asyncio.run(main())
    assert long_ids == old_long  # finished on the weights it started with
    assert short_ids == new_short  # waited for the swap, then ran on the new weights
    assert engine.stats.weight_loads == 1
    for name, tensor in new_model.state_dict().items():
        torch.testing.assert_close(engine.model.state_dict()[name], tensor, atol=0, rtol=0)


def test_load_weights_from_a_directory_serves_exactly_those_weights(own_engine: TorchEngine, tmp_path: Path) -> None:
    """The route for a trainer in another process: HF safetensors in a directory (what Trainer.export_weights
    writes), loaded by the engine itself; tied weights (the tiny model ties lm_head to the embeddings) follow."""
    from transformers import AutoModelForCausalLM

    new_dir = build_lively_model(tmp_path / "new", seed=1)
    new_model = AutoModelForCausalLM.from_pretrained(new_dir)
    prompt = prompts(own_engine)[2]
    own_engine.load_weights_from(new_dir)
    ids = run_all(own_engine, [(prompt, SamplingParams(max_tokens=10, temperature=0.0))])[0][0]
    assert ids == hf_greedy(new_model, prompt, 10, frozenset())
    for name, tensor in new_model.state_dict().items():
        torch.testing.assert_close(own_engine.model.state_dict()[name], tensor, atol=0, rtol=0)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        own_engine.load_weights_from(tmp_path)  # nothing there: nothing changes


def test_load_weights_rejects_unknown_names_and_shapes_without_changes(own_engine: TorchEngine) -> None:
    before = {k: v.clone() for k, v in own_engine.model.state_dict().items()}
    name, tensor = next(iter(before.items()))
    with pytest.raises(ValueError, match="no tensor named"):
        own_engine.load_weights([(name, tensor + 1), ("nope.weight", tensor)])
    with pytest.raises(ValueError, match="shape"):
        own_engine.load_weights([(name, tensor + 1), (name, tensor[:1])])
    for k, v in own_engine.model.state_dict().items():
        assert torch.equal(v, before[k])


def test_a_consumer_that_stops_reading_leaves_the_batch(own_engine: TorchEngine) -> None:
    engine = own_engine
    prompt = prompts(engine)[0]
    endless = SamplingParams(max_tokens=100_000, temperature=1.0)  # capped by the context length (2048)

    async def main():
        stream = engine.generate(prompt, endless)
        for _ in range(3):
            await anext(stream)
        await stream.aclose()  # what `break` in `async for` or a closed HTTP stream leads to

        task = asyncio.create_task(collect(engine, prompt, endless))
        while engine.stats.generated_tokens < 10:
            await asyncio.sleep(0.001)
        task.cancel()  # a client disconnect cancels the handler's task
        with pytest.raises(asyncio.CancelledError):
            await task

        deadline = time.monotonic() + 5
        while engine.running_requests or engine.waiting_requests:
            assert time.monotonic() < deadline, "cancelled requests still hold the batch"
            await asyncio.sleep(0.005)

    asyncio.run(main())
    assert engine.stats.generated_tokens < 1000
    # The engine still serves.
    assert len(run_all(engine, [(prompt, SamplingParams(max_tokens=3))])[0][0]) == 3


def test_a_worker_error_fails_the_requests_and_the_engine_recovers(
    own_engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = own_engine

    def broken(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(engine.model, "forward", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        run_all(engine, [(p, SamplingParams(max_tokens=5)) for p in prompts(engine)])
    monkeypatch.undo()
    assert len(run_all(engine, [(prompts(engine)[0], SamplingParams(max_tokens=5))])[0][0]) == 5


def test_a_failed_prefill_fails_only_the_newcomers(own_engine: TorchEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = own_engine
    poisoned = [7, 7, 7]
    prefill = engine._prefill

    def failing_prefill(group):
        if any(r.prompt_ids == poisoned for r in group):
            raise torch.OutOfMemoryError("simulated prefill failure")
        return prefill(group)

    monkeypatch.setattr(engine, "_prefill", failing_prefill)

    async def main():
        running = asyncio.create_task(collect(engine, [5, 6], SamplingParams(max_tokens=60)))
        while engine.stats.generated_tokens < 5:
            await asyncio.sleep(0.001)
        with pytest.raises(RuntimeError, match="simulated prefill failure"):
            await collect(engine, poisoned, SamplingParams(max_tokens=5))
        return await running

    ids, _, finish = asyncio.run(main())
    assert len(ids) == 60 and finish == "length"


def test_bad_requests_fail_before_queueing(engine: TorchEngine) -> None:
    async def first(prompt, params):
        return await anext(engine.generate(prompt, params))

    too_long = [1] * engine.context_length
    for prompt, params, match in [
        ([], SamplingParams(max_tokens=3), "empty"),
        ([engine.vocab_size], SamplingParams(max_tokens=3), "out of range"),
        (too_long, SamplingParams(max_tokens=3), "context length"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(max_tokens=3, top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(max_tokens=3, temperature=-1.0), "temperature"),
    ]:
        with pytest.raises(ValueError, match=match):
            asyncio.run(first(prompt, params))
    assert engine.waiting_requests == 0


def test_generation_stops_at_the_context_length(tmp_path: Path) -> None:
    with TorchEngine(build_lively_model(tmp_path, max_position_embeddings=32)) as engine:
        assert engine.context_length == 32
        ids, _, finish = run_all(engine, [([5] * 30, SamplingParams(max_tokens=50, temperature=0.0))])[0]
        assert len(ids) == 2 and finish == "length"


def test_close_fails_waiting_requests_and_refuses_new_ones(model_dir: Path) -> None:
    engine = TorchEngine(model_dir)
    engine.eos_token_ids = frozenset()

    async def main():
        task = asyncio.create_task(collect(engine, [5, 6, 7], SamplingParams(max_tokens=100_000)))
        while engine.stats.generated_tokens == 0:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.close)
        with pytest.raises(RuntimeError, match="closed"):
            await task
        with pytest.raises(RuntimeError, match="closed"):
            await collect(engine, [5], SamplingParams(max_tokens=1))

    asyncio.run(main())
