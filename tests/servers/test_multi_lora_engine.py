"""The torch engine serving many LoRA adapters in one batch: each row exact against PEFT, against itself alone, and
(a base row) against the engine without adapters; replacing one adapter; the prefix cache per adapter; bad input."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from marl.protocol import LoraSpec
from servers.backends import SamplingParams
from servers.engines.multi_lora import MultiLora
from servers.engines.prefix_cache import PrefixCache
from servers.engines.torch_engine import TorchEngine
from tests.servers.test_torch_engine import TEXTS, build_lively_model, collect, run_all

# Three adapters of different ranks, scalings and targets (PEFT's B starts at zero: here both A and B are random).
SPECS = {
    "alice": LoraSpec(rank=2, alpha=4),
    "bob": LoraSpec(rank=4, alpha=16, target_modules=("q_proj", "v_proj", "down_proj")),
    "carol": LoraSpec(rank=8, alpha=8),
}
SEEDS = {"alice": 1, "bob": 2, "carol": 3}


def peft_adapter(model_dir: Path, spec: LoraSpec, seed: int) -> PeftModel:
    """A PEFT model (fp32) of the base in `model_dir` with a random, non-zero adapter of `spec`."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, target_modules=list(spec.target_modules))
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_" in name:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.5)
    return model.eval()


def peft_logprobs(model: torch.nn.Module, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """Log softmax of one full forward over prompt + completion, at each generated token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1].gather(1, torch.tensor(ids)[:, None]).squeeze(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lively_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def peft_models(model_dir: Path) -> dict[str, PeftModel]:
    return {name: peft_adapter(model_dir, spec, SEEDS[name]) for name, spec in SPECS.items()}


def engine_with_adapters(model_dir: Path, peft_models: dict[str, PeftModel]) -> TorchEngine:
    engine = TorchEngine(model_dir)
    engine.eos_token_ids = frozenset()  # lengths are exact
    for name, model in peft_models.items():
        engine.load_adapter(name, get_peft_model_state_dict(model), SPECS[name])
    return engine


@pytest.fixture(scope="module")
def engine(model_dir: Path, peft_models: dict[str, PeftModel]):
    with engine_with_adapters(model_dir, peft_models) as engine:
        yield engine


@pytest.fixture
def own_engine(model_dir: Path, peft_models: dict[str, PeftModel]):
    with engine_with_adapters(model_dir, peft_models) as engine:
        yield engine


def mixed_requests(engine: TorchEngine) -> list[tuple[list[int], SamplingParams]]:
    """Every adapter and the base on one shared prompt and one of their own, greedy and sampled (seeded)."""
    shared = engine.tokenizer.encode(TEXTS[1])
    requests = []
    for i, adapter in enumerate([*SPECS, None]):
        own = engine.tokenizer.encode(TEXTS[(i + 2) % len(TEXTS)])
        requests.append((shared, SamplingParams(max_tokens=16, temperature=0.0, adapter=adapter)))
        requests.append((own, SamplingParams(max_tokens=12 + i, temperature=1.0, seed=10 + i, adapter=adapter)))
    return requests


def test_a_mixed_batch_is_each_request_alone_and_peft(engine: TorchEngine, peft_models, model_dir: Path) -> None:
    requests = mixed_requests(engine)
    together = run_all(engine, requests)
    assert engine.stats.max_batch >= len(requests)  # they really shared forwards
    for (prompt, params), (ids, logprobs, _) in zip(requests, together, strict=True):
        alone_ids, alone_logprobs, _ = run_all(engine, [(prompt, params)])[0]
        assert ids == alone_ids and len(ids) == params.max_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(alone_logprobs), atol=1e-4, rtol=0)
        if params.adapter is not None:
            expected = peft_logprobs(peft_models[params.adapter], prompt, ids)
            torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)
    # The adapters matter: on the shared greedy prompt, each one generates something else than the base.
    greedy = {params.adapter: ids for (_, params), (ids, _, _) in zip(requests, together, strict=True)
              if params.temperature == 0}  # fmt: skip
    assert len({tuple(ids) for ids in greedy.values()}) == len(greedy)

    with TorchEngine(model_dir) as bare:  # no adapter ever loaded
        bare.eos_token_ids = frozenset()
        base_requests = [(p, params) for p, params in requests if params.adapter is None]
        base_rows = [r for (_, params), r in zip(requests, together, strict=True) if params.adapter is None]
        for (prompt, params), (ids, logprobs, _) in zip(base_requests, base_rows, strict=True):
            bare_ids, bare_logprobs, _ = run_all(bare, [(prompt, params)])[0]
            assert ids == bare_ids
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(bare_logprobs), atol=1e-4, rtol=0)


def test_a_base_row_next_to_adapted_rows_is_bit_identical(model_dir: Path, peft_models) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.randint(3, 200, (4, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids).logits
        lora = MultiLora(model)
        for name, peft_model in peft_models.items():
            lora.load(name, get_peft_model_state_dict(peft_model), SPECS[name])
        with lora.rows(["alice", None, "carol", None]):
            mixed = model(ids).logits
        assert torch.equal(model(ids).logits, plain)  # outside `rows`: the base model
    assert torch.equal(mixed[1], plain[1]) and torch.equal(mixed[3], plain[3])
    assert not torch.allclose(mixed[0], plain[0], atol=1e-3)


def test_replacing_an_adapter_changes_only_its_outputs(own_engine: TorchEngine, model_dir: Path, tmp_path) -> None:
    engine = own_engine
    requests = [(p, params) for p, params in mixed_requests(engine) if params.temperature == 0]
    before = run_all(engine, requests)
    # bob again, of a higher rank than any loaded (every adapter's stack is re-padded), from a PEFT directory
    spec = LoraSpec(rank=12, alpha=6, target_modules=("k_proj", "o_proj", "up_proj"))
    new_bob = peft_adapter(model_dir, spec, seed=7)
    new_bob.save_pretrained(tmp_path / "bob")
    engine.load_adapter_from("bob", tmp_path / "bob")
    after = run_all(engine, requests)
    for (prompt, params), (ids, logprobs, _), (old_ids, old_logprobs, _) in zip(requests, after, before, strict=True):
        if params.adapter == "bob":
            assert ids != old_ids
            torch.testing.assert_close(torch.tensor(logprobs), peft_logprobs(new_bob, prompt, ids), atol=1e-4, rtol=0)
        else:
            assert ids == old_ids
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(old_logprobs), atol=1e-4, rtol=0)
    assert engine.stats.adapter_loads == len(SPECS) + 1


def test_a_load_waits_for_its_adapters_requests_only(own_engine: TorchEngine, peft_models) -> None:
    engine = own_engine
    prompt = engine.tokenizer.encode(TEXTS[0])
    long = SamplingParams(max_tokens=400, temperature=0.0)
    bob = get_peft_model_state_dict(peft_models["bob"])

    async def main():
        alice, base = (asyncio.create_task(collect(engine, prompt, replace(long, adapter=a))) for a in ("alice", None))
        while engine.stats.generated_tokens < 10:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.load_adapter, "bob", bob, SPECS["bob"])  # no bob request runs: at once
        assert not alice.done() and not base.done()
        alice_again = asyncio.create_task(collect(engine, prompt, replace(long, adapter="alice")))
        while engine.running_requests < 3:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.load_adapter, "alice", get_peft_model_state_dict(peft_models["alice"]),
                                SPECS["alice"])  # fmt: skip
        assert alice.done() and alice_again.done()  # it waited for alice's requests to finish
        return await asyncio.gather(alice, base, alice_again)

    alice, base, alice_again = asyncio.run(main())
    assert alice[0] == alice_again[0] != base[0]
    assert run_all(engine, [(prompt, long)])[0][0] == base[0]


def test_the_prefix_cache_keeps_each_adapters_keys_apart() -> None:
    cache = PrefixCache(budget_tokens=1000, min_reuse=4)
    layer = [torch.zeros(2, 10, 3)]
    cache.insert(list(range(10)), layer, layer, adapter="alice")
    cache.insert(list(range(10)), layer, layer, adapter=None)
    longer = list(range(12))
    assert cache.lookup(longer, "alice")[1] == 10 and cache.lookup(longer, "alice")[0].adapter == "alice"
    assert cache.lookup(longer, None)[0].adapter is None
    assert cache.lookup(longer, "bob") is None
    cache.forget("alice")
    assert cache.lookup(longer, "alice") is None and cache.lookup(longer, None) is not None and len(cache) == 1


def test_the_engine_reuses_a_prefix_only_under_its_own_adapter(own_engine: TorchEngine, peft_models) -> None:
    engine = own_engine
    prompt = engine.tokenizer.encode(TEXTS[3]) * 2  # longer than the cache's minimum reuse
    params = SamplingParams(max_tokens=8, temperature=0.0)
    (ids, _, _) = run_all(engine, [(prompt, replace(params, adapter="alice"))])[0]
    turn = prompt + ids + engine.tokenizer.encode(" Player 7")
    for adapter, reused in [("bob", False), (None, False), ("alice", True)]:
        cached = engine.stats.cached_tokens
        (next_ids, logprobs, _) = run_all(engine, [(turn, replace(params, adapter=adapter))])[0]
        assert (engine.stats.cached_tokens > cached) == reused
        if adapter is not None:
            expected = peft_logprobs(peft_models[adapter], turn, next_ids)
            torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)


def test_unknown_adapters_and_bad_tensors_are_refused(engine: TorchEngine, peft_models) -> None:
    async def first(params):
        return await anext(engine.generate([1, 2, 3], params))

    with pytest.raises(ValueError, match="'dave'"):
        asyncio.run(first(SamplingParams(max_tokens=3, adapter="dave")))
    assert engine.waiting_requests == 0

    good = get_peft_model_state_dict(peft_models["alice"])
    key = next(iter(good))  # ...layers.0.self_attn.q_proj.lora_A.weight
    bad_name = {**good, key.replace("layers.0", "layers.9"): good[key]}
    bad_shape = {**good, key: torch.zeros(3, 3)}
    unpaired = {k: v for k, v in good.items() if k != key}
    for tensors, spec, match in [
        (bad_name, SPECS["alice"], "layers.9"),
        (bad_shape, SPECS["alice"], "has shape"),
        (unpaired, SPECS["alice"], "not its pair"),
        (good, LoraSpec(rank=2, alpha=4, target_modules=("q_proj", "v_proj")), "k_proj.lora_A"),  # not a target
        (good, LoraSpec(rank=2, alpha=4, target_modules=("q_proj", "qkv_proj")), "qkv_proj"),
        ({}, SPECS["alice"], "no tensors"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.load_adapter("eve", tensors, spec)
    assert "eve" not in engine.lora


def test_loading_base_weights_keeps_the_adapters(own_engine: TorchEngine, peft_models, tmp_path: Path) -> None:
    engine = own_engine
    other = build_lively_model(tmp_path / "other", seed=1)
    engine.load_weights_from(other)
    carol = peft_adapter(other, SPECS["carol"], SEEDS["carol"])  # the same adapter (same seed) over the new base
    prompt = engine.tokenizer.encode(TEXTS[2])
    ids, logprobs, _ = run_all(engine, [(prompt, SamplingParams(max_tokens=10, temperature=0.0, adapter="carol"))])[0]
    torch.testing.assert_close(torch.tensor(logprobs), peft_logprobs(carol, prompt, ids), atol=1e-4, rtol=0)


def test_unloading_an_adapter_waits_for_it_frees_its_slot_and_leaves_the_others(own_engine: TorchEngine,
                                                                                peft_models) -> None:
    engine = own_engine
    requests = [(p, params) for p, params in mixed_requests(engine) if params.temperature == 0]
    before = run_all(engine, requests)
    prompt = engine.tokenizer.encode(TEXTS[0])
    long = SamplingParams(max_tokens=300, temperature=0.0, adapter="bob")

    async def main():
        generated = engine.stats.generated_tokens
        running = asyncio.create_task(collect(engine, prompt, long))
        while engine.stats.generated_tokens < generated + 5:  # it runs (not only waits, which an unload would fail)
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.unload_adapter, "bob")
        assert running.done()  # it waited for bob's running request, which finished on bob
        return await running

    ids, _, _ = asyncio.run(main())
    assert len(ids) == 300 and "bob" not in engine.lora.names
    with pytest.raises(ValueError, match="no LoRA adapter named 'bob'"):
        run_all(engine, [(prompt, long)])
    with pytest.raises(KeyError, match="bob"):
        engine.unload_adapter("bob")
    kept = run_all(engine, [r for r in requests if r[1].adapter != "bob"])
    others = [r for (_, params), r in zip(requests, before, strict=True) if params.adapter != "bob"]
    for (ids, logprobs, _), (old_ids, old_logprobs, _) in zip(kept, others, strict=True):  # the others: untouched
        assert ids == old_ids
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(old_logprobs), atol=1e-4, rtol=0)
    slots = engine.lora._count
    engine.load_adapter("dave", get_peft_model_state_dict(peft_models["bob"]), SPECS["bob"])  # takes bob's slot
    assert engine.lora._count == slots
    bob_before = [r for (_, params), r in zip(requests, before, strict=True) if params.adapter == "bob"]
    dave = run_all(engine, [(p, replace(params, adapter="dave")) for p, params in requests if params.adapter == "bob"])
    assert [r[0] for r in dave] == [r[0] for r in bob_before]
