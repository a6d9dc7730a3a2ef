"""The prefix cache: a prompt that extends a finished generation reuses its keys/values, with the same result."""

from __future__ import annotations

import asyncio
import functools
import random
import time
from pathlib import Path

import pytest
import torch

from servers.backends import SamplingParams
from servers.engines.prefix_cache import PrefixCache
from servers.engines.torch_engine import TorchEngine
from tests.servers.test_torch_engine import build_lively_model, collect

GREEDY = SamplingParams(max_tokens=12, temperature=0)
STORY = "The seer checks one player each night; the witch holds a potion to save and a potion to poison. " * 2


def synchronously(test):
    """Run an async test body with asyncio.run (the engine's requests need a running event loop)."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return wrapper


def kv(n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.zeros(1, n, 2)], [torch.zeros(1, n, 2)]


# ---------------------------------------------------------------------------------------------- the cache alone


def test_lookup_picks_the_longest_shared_prefix_and_leaves_the_last_prompt_token_to_compute():
    cache = PrefixCache(budget_tokens=1000, min_reuse=4)
    cache.insert(list(range(10)), *kv(10))
    cache.insert([0, 1, 2, 3, 4, 50, 51, 52], *kv(8))
    entry, reused = cache.lookup(list(range(20)))
    assert entry.tokens.tolist() == list(range(10)) and reused == 10
    entry, reused = cache.lookup([0, 1, 2, 3, 4, 50, 51, 52, 53])
    assert entry.tokens.tolist()[5:] == [50, 51, 52] and reused == 8
    _, reused = cache.lookup(list(range(10)))  # the whole prompt is cached: its last token is still computed
    assert reused == 9
    assert cache.lookup([0, 1, 2, 9, 9, 9, 9]) is None  # 3 shared tokens < min_reuse
    assert cache.lookup([7] * 30) is None


def test_an_entry_that_a_newer_one_extends_is_dropped():
    cache = PrefixCache(budget_tokens=1000, min_reuse=4)
    cache.insert(list(range(10)), *kv(10))
    cache.insert(list(range(16)), *kv(16))  # the conversation moved on
    assert len(cache) == 1 and cache.tokens == 16
    cache.insert([0, 1, 2, 3, 99, 98], *kv(6))  # a branch: both stay
    assert len(cache) == 2 and cache.tokens == 22


def test_the_least_recently_used_entries_leave_first_and_the_budget_holds():
    cache = PrefixCache(budget_tokens=25, min_reuse=4)
    for first in (100, 200, 300):
        cache.insert([first, *range(9)], *kv(10))
        assert cache.tokens <= 25
    assert len(cache) == 2  # 100 went first
    assert cache.lookup([100, *range(9)]) is None
    cache.lookup([200, *range(9), 5])  # 200 is now the most recently used
    cache.insert([400, *range(9)], *kv(10))
    assert cache.lookup([200, *range(9), 5]) is not None and cache.lookup([300, *range(9), 5]) is None
    cache.insert(list(range(26)), *kv(26))  # larger than the whole budget: not kept, nothing evicted for it
    assert len(cache) == 2 and cache.tokens == 20


class ScanningCache:
    """The cache as it was before its radix tree: every lookup and insert compares the prompt with every entry.
    Of entries sharing equally long prefixes, the most recently used is taken (the tree's rule)."""

    def __init__(self, budget_tokens: int, min_reuse: int) -> None:
        self.budget_tokens, self.min_reuse = budget_tokens, min_reuse
        self.entries: list[list[int]] = []  # least recently used first

    def lookup(self, prompt: list[int]) -> tuple[list[int], int] | None:
        if not self.entries or len(prompt) <= self.min_reuse:
            return None
        best_i, best = None, 0
        for i, entry in enumerate(self.entries):
            shared = common_prefix(entry, prompt)
            if shared and shared >= best:
                best_i, best = i, shared
        best = min(best, len(prompt) - 1)
        if best_i is None or best < self.min_reuse:
            return None
        self.entries.append(self.entries.pop(best_i))
        return self.entries[-1], best

    def insert(self, tokens: list[int]) -> None:
        if not self.min_reuse <= len(tokens) <= self.budget_tokens:
            return
        self.entries = [e for e in self.entries if not (len(e) <= len(tokens) and tokens[: len(e)] == e)]
        while sum(map(len, self.entries)) + len(tokens) > self.budget_tokens:
            self.entries.pop(0)
        self.entries.append(tokens)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("seed", range(12))
def test_the_tree_finds_what_scanning_every_entry_finds_on_random_conversations(seed: int):
    """Conversations that grow, branch, repeat and restart over a 3-token vocabulary (so prefixes are shared a
    lot): each lookup returns the same entry and length as the scan, and both hold the same entries in the same
    order of use."""
    rng = random.Random(seed)
    budget, min_reuse = rng.choice([(60, 2), (200, 4), (1000, 3)])
    tree, scan = PrefixCache(budget, min_reuse), ScanningCache(budget, min_reuse)
    for _ in range(400):
        base = rng.choice(scan.entries) if scan.entries and rng.random() < 0.7 else []
        prompt = base[: rng.randint(0, len(base))] + [rng.randrange(3) for _ in range(rng.randint(0, 12))]
        found, expected = tree.lookup(prompt), scan.lookup(prompt)
        assert (found and (found[0].tokens.tolist(), found[1])) == expected
        if rng.random() < 0.6:
            tree.insert(prompt, *kv(len(prompt)))
            scan.insert(prompt)
        assert [e.tokens.tolist() for e in tree._entries.values()] == scan.entries
        assert tree.tokens == sum(map(len, scan.entries))


def seconds_per_call(call, args: list) -> float:
    """The best of five passes over `args` (the least disturbed by whatever else the machine runs)."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for a in args:
            call(a)
        best = min(best, time.perf_counter() - start)
    return best / len(args)


def conversations(n: int, rng: random.Random) -> list[list[int]]:
    """`n` conversations of 100 tokens that share a 40-token system prompt, as a GRPO group's do."""
    system = [rng.randrange(50_000) for _ in range(40)]
    return [system + [rng.randrange(50_000) for _ in range(60)] for _ in range(n)]


def test_lookup_and_insert_take_no_longer_with_5000_entries_than_with_100():
    rng = random.Random(0)
    keys, values = kv(1)  # the tensors are never read here: one pair serves every entry
    per_call = {}
    for n in (100, 5000):
        cache = PrefixCache(budget_tokens=100 * n, min_reuse=32)
        held = conversations(n, rng)
        for tokens in held:
            cache.insert(tokens, keys, values)
        assert len(cache) == n
        follow_ups = [rng.choice(held) + [7, 8, 9] for _ in range(500)]
        lookup = seconds_per_call(cache.lookup, follow_ups)
        assert all(cache.lookup(p)[1] == 100 for p in follow_ups[:20])
        fresh = conversations(500, rng)  # each evicts the least recently used entry: the cache stays full
        insert = seconds_per_call(functools.partial(cache.insert, keys=keys, values=values), fresh)
        assert len(cache) == n
        per_call[n] = (lookup, insert)
    lookup_ratio = per_call[5000][0] / per_call[100][0]
    insert_ratio = per_call[5000][1] / per_call[100][1]
    assert lookup_ratio < 3 and insert_ratio < 3, per_call  # the scan it replaced: about 50x


# ---------------------------------------------------------------------------------------------- in the engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lively_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def engines(model_dir: Path):
    """The same model with and without a prefix cache; neither samples an eos, so lengths are exact."""
    with TorchEngine(model_dir) as cached, TorchEngine(model_dir, prefix_cache_bytes=0) as plain:
        cached.eos_token_ids = plain.eos_token_ids = frozenset()
        yield cached, plain


def assert_same(a: tuple[list[int], list[float], str], b: tuple[list[int], list[float], str]) -> None:
    assert a[0] == b[0]
    assert max(abs(x - y) for x, y in zip(a[1], b[1], strict=True)) < 1e-4


@synchronously
async def test_a_prompt_extending_a_finished_generation_prefills_only_its_new_tokens(engines):
    cached, plain = engines
    prompt = cached.tokenizer.encode(STORY)
    first = await collect(cached, prompt, GREEDY)
    assert cached.stats.cached_tokens == 0 and cached.stats.prefilled_tokens == len(prompt)

    turn = cached.tokenizer.encode(" Then the wolves woke up and voted.")
    follow_up = prompt + first[0] + turn
    assert_same(await collect(cached, follow_up, GREEDY), await collect(plain, follow_up, GREEDY))
    # Reused: the prompt and all generated tokens but the last (sampled, never fed back); prefilled: the rest.
    assert cached.stats.cached_tokens == len(prompt) + len(first[0]) - 1
    assert cached.stats.prefilled_tokens == len(prompt) + 1 + len(turn)
    assert len(cached.prefix_cache) == 1  # the first call's entry gave way to the longer conversation
    assert plain.prefix_cache is None and plain.stats.cached_tokens == 0


@synchronously
async def test_cached_and_fresh_prompts_in_one_batch_match_an_engine_without_cache(engines):
    cached, plain = engines
    base = cached.tokenizer.encode(STORY)
    reply = (await collect(cached, base, GREEDY))[0]
    await collect(plain, base, GREEDY)
    conversation = base + reply
    prompts = [conversation + [5] * i for i in range(1, 4)] + [base[:40], base[3:], conversation[: len(base) // 2]]
    ours = await asyncio.gather(*(collect(cached, p, GREEDY) for p in prompts))
    theirs = await asyncio.gather(*(collect(plain, p, GREEDY) for p in prompts))
    for a, b in zip(ours, theirs, strict=True):
        assert_same(a, b)
    assert cached.stats.cached_tokens > 3 * len(conversation) - 3  # the three extensions at least


@synchronously
async def test_new_weights_empty_the_cache(engines, model_dir: Path):
    cached, plain = engines
    prompt = cached.tokenizer.encode(STORY)
    reply = (await collect(cached, prompt, GREEDY))[0]
    assert len(cached.prefix_cache) == 1
    other = build_lively_model(model_dir.parent / "other", seed=1)
    from transformers import AutoModelForCausalLM

    new_weights = AutoModelForCausalLM.from_pretrained(other).state_dict()
    for engine in (cached, plain):
        await asyncio.to_thread(engine.load_weights, new_weights.items())
    assert len(cached.prefix_cache) == 0 and cached.prefix_cache.tokens == 0
    reused = cached.stats.cached_tokens
    follow_up = prompt + reply + [7, 8, 9]
    assert_same(await collect(cached, follow_up, GREEDY), await collect(plain, follow_up, GREEDY))
    assert cached.stats.cached_tokens == reused  # nothing computed by the old weights was used


@synchronously
async def test_the_cache_keeps_to_its_byte_budget(model_dir: Path):
    with TorchEngine(model_dir, prefix_cache_bytes=1) as engine:
        assert engine.prefix_cache is not None and engine.prefix_cache.budget_tokens == 0
    with TorchEngine(model_dir, prefix_cache_bytes=0) as engine:
        assert engine.prefix_cache is None
    config = engine.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # keys and values, fp32
    with TorchEngine(model_dir, prefix_cache_bytes=100 * per_token) as engine:
        engine.eos_token_ids = frozenset()
        assert engine.prefix_cache.budget_tokens == 100
        for i in range(5):
            await collect(engine, [10 + i] * 30, GREEDY)
            assert engine.prefix_cache.tokens <= 100
        assert len(engine.prefix_cache) == 2  # 30 + 11 tokens each: two fit in 100
        entries = engine.prefix_cache._entries.values()
        held = sum(t.numel() * t.element_size() for e in entries for t in e.keys + e.values)
        assert held == engine.prefix_cache.tokens * per_token


# ---------------------------------------------------------------------------------------------- over HTTP


def test_an_agents_next_turn_over_the_sdk_reuses_its_conversation(local_server):
    """The server splices each turn onto the last call's exact ids, so the engine finds it in the cache."""
    import openai

    from tests.conftest import admin_http, start_rolling
    from tests.marl.test_overwatch import scrape

    with local_server() as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=1, num_repeat=2, max_leases=4)
        lease = http.post("/episodes/begin", json={"client_id": "c"}).json()
        client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"])
        messages = [{"role": "system", "content": STORY}, {"role": "user", "content": "Who do you vote for?"}]
        prompt_tokens, completion_tokens = [], []
        for turn in range(3):
            out = client.chat.completions.create(model="tiny", max_tokens=4, messages=messages)
            prompt_tokens.append(out.usage.prompt_tokens)
            completion_tokens.append(out.usage.completion_tokens)
            messages += [{"role": "assistant", "content": out.choices[0].message.content},
                         {"role": "user", "content": f"Night {turn} is over. Who do you vote for now?"}]  # fmt: skip
        m = scrape(http)
        tiny = (("model", "tiny"), ("policy", "default"))
        cached = m["marl_engine_prompt_tokens_total", (("kind", "cached"), *tiny)]
        prefilled = m["marl_engine_prompt_tokens_total", (("kind", "prefilled"), *tiny)]
        assert cached + prefilled == sum(prompt_tokens)
        # Turns 2 and 3 reuse all of the previous turn but its last generated token (sampled, never fed back).
        assert cached == sum(prompt_tokens[t] + completion_tokens[t] - 1 for t in (0, 1))
