"""Prefix-cache hit rate of multi-turn chats on two engine replicas: sticky routing (a chat's calls on one replica,
`SamplingParams.affinity`) against routing each call to the least loaded replica, in turn on ties.

    python bench/prefix_routing.py                       # two CPU vLLM replicas of a tiny model, 16 chats x 4 turns
    python bench/prefix_routing.py --engine torch        # two torch engines instead
    python bench/prefix_routing.py --out routing.json    # the JSON of the table too
    python bench/prefix_routing.py --smoke               # seconds: two torch engines, 4 chats x 2 turns

Each chat's prompt grows every turn by a new user message of about `--turn-tokens` tokens and its own reply (greedy,
up to `--max-tokens`), built as the server builds prompts: the previous prompt's and reply's exact ids, then the new
turn; the chats of a turn call concurrently, in a new order each turn (without that, routing by load would give a
chat the same replica every turn by chance). Hit rate = prompt tokens the prefix cache supplied / prompt tokens (vLLM's
`usage.prompt_tokens_details.cached_tokens`, counted in `VLLMStats`; the torch engine's own prefix-cache counts). vLLM
caches whole 32-token blocks only, so even sticky routing misses each prompt's last partial block. The vLLM side is
one `VLLMEngine` with `data_parallel_size: 2` (servers.engines.vllm_replicas), its prefix caches emptied between the
two routings; the torch side routes over two engines with the same `AffinityRouter`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from servers.backends import SamplingParams
from servers.engines.torch_engine import TorchEngine
from servers.engines.vllm_replicas import AffinityRouter
from servers.model_files import resolve_model
from tests.tiny_model import build_tiny_model

WORDS = ("the village met at dawn and player_3 said that player_7 acted strangely last night so watch closely and "
         "vote with care because the wolves are still among us").split()


class RoutedTorchEngines:
    """Two (or more) torch engines behind the vLLM engine's router: what `VLLMEngine` does with its replicas."""

    def __init__(self, engines: list[TorchEngine]) -> None:
        self.engines, self.tokenizer = engines, engines[0].tokenizer
        self.router = AffinityRouter(len(engines))
        self.running = [0] * len(engines)

    async def generate(self, prompt_ids: list[int], params: SamplingParams):
        index = self.router.pick(params.affinity, self.running, [True] * len(self.engines))
        self.running[index] += 1
        try:
            async for chunk in self.engines[index].generate(prompt_ids, params):
                yield chunk
        finally:
            self.running[index] -= 1

    def counts(self) -> tuple[int, int]:
        """(prompt tokens computed, prompt tokens from the prefix cache) over every engine."""
        return (sum(e.stats.prefilled_tokens for e in self.engines), sum(e.stats.cached_tokens for e in self.engines))


def user_turn(tokenizer, chat: int, turn: int, tokens: int, run: str) -> list[int]:
    """About `tokens` tokens of a user message, different for every run, chat and turn."""
    words, i = [f"{run} round {turn} for chat {chat}:"], chat * 7 + turn * 3
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < tokens:
        words.append(WORDS[i % len(WORDS)])
        i += 1
    text = f"<|im_start|>user\n{' '.join(words)}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(text, add_special_tokens=False)


async def play(engine, run: str, sticky: bool, args: argparse.Namespace) -> float:
    """The chats, turn by turn; wall seconds."""
    tok = engine.tokenizer
    system = "<|im_start|>system\nYou are a player of Werewolves. Keep your replies short.<|im_end|>\n"
    ids = [tok.encode(system, add_special_tokens=False) for _ in range(args.chats)]

    async def call(chat: int) -> list[int]:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, stream=False,
                                affinity=f"{run}-{chat}" if sticky else None)
        return [t for chunk in [c async for c in engine.generate(ids[chat], params)] for t in chunk.token_ids]

    start = time.perf_counter()
    for turn in range(args.turns):
        for chat in range(args.chats):
            ids[chat] += user_turn(tok, chat, turn, args.turn_tokens, run)
        order = random.Random(turn).sample(range(args.chats), args.chats)  # calls arrive in any order
        replies = await asyncio.gather(*(call(chat) for chat in order))
        for chat, reply in zip(order, replies):
            ids[chat] += reply + tok.encode("<|im_end|>\n", add_special_tokens=False)
    return time.perf_counter() - start


def measure_torch(model_dir: Path, args: argparse.Namespace) -> dict[str, dict]:
    rows = {}
    for label, sticky in (("least loaded", False), ("sticky", True)):
        engines = [TorchEngine(model_dir, device="cpu") for _ in range(2)]
        try:
            routed = RoutedTorchEngines(engines)
            seconds = asyncio.run(play(routed, label, sticky, args))
            rows[label] = row(*routed.counts(), seconds)
        finally:
            for engine in engines:
                engine.close()
    return rows


def measure_vllm(model_dir: Path, args: argparse.Namespace) -> dict[str, dict]:
    from servers.engines.vllm_engine import VLLMEngine
    from servers.engines.vllm_http import reset_prefix_cache
    from servers.engines.vllm_process import VLLMSettings

    settings = VLLMSettings(data_parallel_size=2, kv_cache_gb=args.kv_cache_gb, max_model_len=args.max_model_len)
    engine = VLLMEngine(model_dir, device="cpu", settings=settings)
    rows = {}
    try:
        asyncio.run(play(engine, "warm-up", True, argparse.Namespace(**{**vars(args), "chats": 2, "turns": 1})))
        for label, sticky in (("least loaded", False), ("sticky", True)):
            for url in engine.replica_urls:
                reset_prefix_cache(url)
            engine.stats.prefilled_tokens = engine.stats.cached_tokens = 0
            seconds = asyncio.run(play(engine, label, sticky, args))
            rows[label] = row(engine.stats.prefilled_tokens, engine.stats.cached_tokens, seconds)
    finally:
        engine.close()
    return rows


def row(prefilled: int, cached: int, seconds: float) -> dict:
    prompt = prefilled + cached
    return {"prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
            "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("vllm", "torch"), default="vllm")
    parser.add_argument("--model", help="model directory or alias (default: a tiny random model, head size 32)")
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-gb", type=float, default=0.25, help="each vLLM replica's KV cache")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    parser.add_argument("--smoke", action="store_true", help="seconds: two torch engines, 4 chats x 2 turns")
    args = parser.parse_args(argv)
    if args.smoke:
        args.engine, args.model, args.chats, args.turns, args.turn_tokens, args.max_tokens = "torch", None, 4, 2, 16, 4
    with tempfile.TemporaryDirectory() as scratch:
        # head_dim 32: the smallest vLLM's CPU attention takes
        model_dir = resolve_model(args.model) if args.model else build_tiny_model(Path(scratch) / "tiny", num_heads=2)
        measure = measure_vllm if args.engine == "vllm" else measure_torch
        rows = measure(model_dir, args)
    result = {"engine": args.engine, "model": args.model or "tiny random", "replicas": 2, "chats": args.chats,
              "turns": args.turns, "turn_tokens": args.turn_tokens, "max_tokens": args.max_tokens, "routings": rows}
    print(f"{args.chats} chats x {args.turns} turns on 2 {args.engine} replicas, ~{args.turn_tokens} new prompt tokens"
          f" and <= {args.max_tokens} generated per call; model {result['model']}")
    print(f"{'routing':14}{'prompt tok':>12}{'cached tok':>12}{'hit rate':>10}{'seconds':>9}")
    for label, r in rows.items():
        print(f"{label:14}{r['prompt_tokens']:12d}{r['cached_tokens']:12d}{r['hit_rate']:10.1%}{r['seconds']:9.1f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
