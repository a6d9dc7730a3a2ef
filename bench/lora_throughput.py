"""Generated tokens/s of the torch engine serving LoRA policies: 16 agents over 3 adapters vs 16 on the bare base.

Every agent of the LoRA run names one of the adapters (round robin), so each forward of the batch mixes all of them
(servers.engines.multi_lora); the base run is the same engine, same prompts, seeds and token budget, with no
adapter. Both sides generate exactly `--max-tokens` per agent (eos is ignored) at temperature 1 with the prefix
cache off, so the ratio is the cost of the adapters alone. Each side runs `--repeats` times, alternating, and the
best run of each counts (shared CPUs); everything is warmed up first.

    python bench/lora_throughput.py                                   # SmolLM2-135M-Instruct, 16 agents, rank 16
    python bench/lora_throughput.py --max-tokens 64 --out lora.json   # the JSON of the table too
    python bench/lora_throughput.py --smoke                           # a tiny random model, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from bench.engine_throughput import prompts
from marl.protocol import LORA_DEFAULT_TARGETS, LoraSpec
from servers.backends import SamplingParams
from servers.engines.torch_engine import TorchEngine
from servers.model_files import resolve_model
from tests.tiny_model import build_tiny_model


def random_adapter(engine: TorchEngine, spec: LoraSpec, seed: int) -> dict[str, torch.Tensor]:
    """A LoRA adapter of `spec` over the engine's model, in PEFT's names, A and B random (B non-zero)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, module in engine.model.named_modules():
        if isinstance(module, torch.nn.Linear) and path.rsplit(".", 1)[-1] in spec.target_modules:
            prefix = f"base_model.model.{path}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(spec.rank, module.in_features, generator=generator) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(module.out_features, spec.rank, generator=generator) * 0.01
    return tensors


def run_agents(engine: TorchEngine, batch: list[list[int]], adapters: list[str | None], max_tokens: int):
    """All agents at once, agent i on adapters[i % len(adapters)]; (tokens generated, seconds)."""

    async def one(i: int, ids: list[int]) -> int:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, adapter=adapters[i % len(adapters)])
        n = 0
        async for chunk in engine.generate(ids, params):
            n += len(chunk.token_ids)
        return n

    async def run() -> int:
        return sum(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(batch))))

    start = time.perf_counter()
    tokens = asyncio.run(run())
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - start


def bench(args: argparse.Namespace, model_dir: Path, label: str) -> dict:
    spec = LoraSpec(rank=args.rank, alpha=2.0 * args.rank, target_modules=LORA_DEFAULT_TARGETS)
    names = [f"policy{i}" for i in range(args.adapters)]
    with TorchEngine(model_dir, device=args.device, max_batch_size=args.agents, prefix_cache_bytes=0) as engine:
        engine.eos_token_ids = frozenset()  # every agent generates exactly max_tokens: equal work on both sides
        for i, name in enumerate(names):
            engine.load_adapter(name, random_adapter(engine, spec, seed=i), spec)
        params = sum(p.numel() for p in engine.model.parameters())
        print(f"model: {label}, {params / 1e6:.1f}M parameters, {engine.device} {engine.dtype}, "
              f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}", flush=True)
        batch = prompts(engine.tokenizer, args.agents)
        print(f"{args.agents} agents, prompts {min(map(len, batch))}-{max(map(len, batch))} tokens, "
              f"{args.max_tokens} new tokens each; {args.adapters} adapters of rank {args.rank} on "
              f"{', '.join(LORA_DEFAULT_TARGETS)}", flush=True)
        sides = {"base": [None], "lora": names}
        for adapters in sides.values():  # warm-up
            run_agents(engine, batch, adapters, 8)
        best: dict[str, tuple[int, float]] = {}
        for _ in range(args.repeats):
            for side, adapters in sides.items():
                tokens, seconds = run_agents(engine, batch, adapters, args.max_tokens)
                if side not in best or tokens / seconds > best[side][0] / best[side][1]:
                    best[side] = (tokens, seconds)
        device = str(torch.cuda.get_device_name()) if engine.device.type == "cuda" else "cpu"
    rates = {side: tokens / seconds for side, (tokens, seconds) in best.items()}
    return {"model": label, "device": device, "agents": args.agents, "adapters": args.adapters, "rank": args.rank,
            "max_tokens": args.max_tokens, "repeats": args.repeats,
            "runs": {side: {"tokens": t, "seconds": s, "tokens_per_s": rates[side]} for side, (t, s) in best.items()},
            "lora_over_base": rates["lora"] / rates["base"]}  # fmt: skip


def report(result: dict) -> None:
    print(f"\n{'run':<36} {'tokens':>7} {'seconds':>8} {'tok/s':>9}")
    for side, run in result["runs"].items():
        name = (f"{result['agents']} agents, bare base" if side == "base"
                else f"{result['agents']} agents over {result['adapters']} adapters")  # fmt: skip
        print(f"{name:<36} {run['tokens']:>7} {run['seconds']:>8.2f} {run['tokens_per_s']:>9.1f}")
    print(f"\nLoRA / base throughput: {result['lora_over_base']:.2f}x")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="model directory or alias (default: smollm2-135m)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating; the best counts")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    parser.add_argument("--smoke", action="store_true", help="a few seconds on a tiny random model: does it run?")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            args.agents, args.max_tokens, args.rank, args.repeats = 4, 4, 4, 1
            result = bench(args, build_tiny_model(Path(tmp) / "tiny"), "tiny random llama")
        else:
            result = bench(args, resolve_model(args.model), args.model)
    report(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
