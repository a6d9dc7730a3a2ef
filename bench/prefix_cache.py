"""Seconds per call of multi-turn agents on TorchEngine, with and without the prefix cache.

    python bench/prefix_cache.py                          # a tiny random model, built on the fly
    python bench/prefix_cache.py --model smollm2-135m     # the real SmolLM2-135M-Instruct (cached after first use)
    python bench/prefix_cache.py --model smollm2-135m --agents 3 --turns 16 --turn-tokens 120
    python bench/prefix_cache.py --smoke                  # seconds: the tiny model, 2 agents x 2 short turns
    python bench/prefix_cache.py --index 100,1000,5000    # no model: microseconds per lookup/insert by entries held

Like Werewolves players, each agent's conversation grows every turn by a new observation (a user message of about
`--turn-tokens` tokens) and its own reply (up to `--max-tokens`). Prompts are built the way the server builds them:
the previous prompt's and completion's exact token ids, then the new turn. The agents of a turn call concurrently.
Both engines see the same prompts (greedy, so the replies agree) and run one after the other, not side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

import torch

from servers.backends import SamplingParams
from servers.engines.prefix_cache import PrefixCache
from servers.engines.torch_engine import TorchEngine
from servers.model_files import resolve_model
from tests.tiny_model import build_tiny_model

SYSTEM = "You are player_{n} in a game of Werewolves. You are a werewolf. Keep your replies short."
NEWS = ("player_3 says they are a villager and that player_7 acted strangely last night, so the village should "
        "watch player_7 closely and vote carefully today because the wolves are still among us and")


def observation(turn: int, agent: int, tokens: int, tokenizer) -> str:
    """About `tokens` tokens of game news, different for every agent and turn."""
    vocabulary = NEWS.split()
    words, text = [f"Round {turn}, news for player_{agent}:"], ""
    i = turn * 7 + agent
    while len(tokenizer.encode(text)) < tokens:
        words.append(vocabulary[i % len(vocabulary)])
        i += 1
        text = " ".join(words)
    return text


async def replay(engine: TorchEngine, agents: int, turns: int, turn_tokens: int, max_tokens: int) -> list[float]:
    """Play the conversations; return the wall seconds of each turn (all agents' calls)."""
    tok = engine.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "system", "content": SYSTEM.format(n=a)}], tokenize=False)
        for a in range(agents)
    ]
    ids = [list(tok.encode(p, add_special_tokens=False)) for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    seconds = []
    for turn in range(turns):
        for a in range(agents):
            news = observation(turn, a, turn_tokens, tok)
            turn_text = f"<|im_start|>user\n{news}<|im_end|>\n<|im_start|>assistant\n"
            ids[a] += tok.encode(turn_text, add_special_tokens=False)

        async def call(a: int) -> list[int]:
            out: list[int] = []
            async for chunk in engine.generate(ids[a], params):
                out += chunk.token_ids
            return out

        start = time.perf_counter()
        replies = await asyncio.gather(*(call(a) for a in range(agents)))
        seconds.append(time.perf_counter() - start)
        for a, reply in enumerate(replies):
            ids[a] += reply + tok.encode("\n", add_special_tokens=False)
    return seconds


def index_bench(sizes: list[int], calls: int = 200) -> None:
    """Microseconds per lookup and per insert of the cache alone, holding `n` conversations of 100 tokens that
    share a 40-token system prompt; every insert evicts one (the cache stays full)."""
    rng = random.Random(0)
    kv = [torch.zeros(1, 1, 1)]  # never read: one tensor serves every entry

    def conversation(system: list[int]) -> list[int]:
        return system + [rng.randrange(50_000) for _ in range(60)]

    print(f"{'entries':>8}{'lookup us':>11}{'insert us':>11}")
    for n in sizes:
        system = [rng.randrange(50_000) for _ in range(40)]
        cache, held = PrefixCache(budget_tokens=100 * n), [conversation(system) for _ in range(n)]
        for tokens in held:
            cache.insert(tokens, kv, kv)
        prompts, fresh = [rng.choice(held) + [1, 2] for _ in range(calls)], [conversation(system) for _ in range(calls)]
        start = time.perf_counter()
        for p in prompts:
            cache.lookup(p)
        middle = time.perf_counter()
        for t in fresh:
            cache.insert(t, kv, kv)
        end = time.perf_counter()
        print(f"{n:8d}{(middle - start) / calls * 1e6:11.1f}{(end - middle) / calls * 1e6:11.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory or alias (default: a tiny random model)")
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--turn-tokens", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", default=None)
    parser.add_argument("--smoke", action="store_true", help="a few seconds on the tiny model: does the bench run?")
    parser.add_argument("--index", help="entry counts, e.g. 100,5000: time the cache's index alone, no model")
    args = parser.parse_args(argv)
    if args.index:
        return index_bench([int(n) for n in args.index.split(",")])
    if args.smoke:
        args.model, args.agents, args.turns, args.turn_tokens, args.max_tokens = None, 2, 2, 16, 4
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = resolve_model(args.model) if args.model else build_tiny_model(Path(scratch) / "tiny")
        rows = {}
        for label, budget in (("no prefix cache", 0), ("prefix cache", None)):
            kwargs = {} if budget is None else {"prefix_cache_bytes": budget}
            with TorchEngine(model_dir, device=args.device, **kwargs) as engine:
                asyncio.run(replay(engine, 1, 1, 16, 4))  # warm-up
                engine.stats.prefilled_tokens = engine.stats.cached_tokens = 0
                seconds = asyncio.run(replay(engine, args.agents, args.turns, args.turn_tokens, args.max_tokens))
                rows[label] = (seconds, engine.stats.prefilled_tokens, engine.stats.cached_tokens)
    print(f"{args.agents} agents x {args.turns} turns, ~{args.turn_tokens} new prompt tokens and <= {args.max_tokens} "
          f"generated per call; model {args.model or 'tiny random'}")
    print(f"{'':18}{'total s':>9}{'first turn s':>14}{'last turn s':>13}{'prefilled tok':>15}{'cached tok':>12}")
    for label, (seconds, prefilled, cached) in rows.items():
        print(f"{label:18}{sum(seconds):9.1f}{seconds[0]:14.2f}{seconds[-1]:13.2f}{prefilled:15d}{cached:12d}")
    plain, cached = (sum(rows[k][0]) for k in ("no prefix cache", "prefix cache"))
    print(f"speed-up over the whole replay: {plain / cached:.2f}x")


if __name__ == "__main__":
    main()
