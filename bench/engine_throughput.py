"""Generated tokens/s of TorchEngine with 1, 4 and 16 concurrent requests, against sequential plain `generate`.

    python bench/engine_throughput.py                        # a tiny random model, built on the fly
    python bench/engine_throughput.py --model smollm2-135m   # the real SmolLM2-135M-Instruct (cached after first use)
    python bench/engine_throughput.py --shape qwen2.5-0.5b --device cuda --concurrency 1,16,64

Both sides sample at temperature 1 from the same chat prompts with the same token budget and stop at the model's
eos; tokens/s counts the tokens actually generated. Everything is warmed up before it is timed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from servers.engines.torch_engine import TorchEngine
from servers.interfaces import SamplingParams
from servers.models import resolve_model
from servers.tiny_model import build_tiny_model, build_tokenizer

# Open-ended requests, so that a chat model rarely stops before the token budget.
TOPICS = ["a fox", "a lighthouse", "the moon", "a village", "a river", "a robot", "winter", "a market",
          "a storm", "an old clock", "a dragon", "a garden", "a train", "the sea", "a forest", "a violin"]  # fmt: skip


def build_qwen_shaped(directory: Path) -> Path:
    """Qwen2.5-0.5B's shape with random weights, and the tiny tokenizer.

    The tokenizer is not Qwen's: `servers.models.load_tokenizer` loads it from tokenizer.json, not as the
    Qwen2Tokenizer that `AutoTokenizer` would pick for model_type qwen2 (the tokenizer trap in FACTS.md).
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1_000_000.0, tie_word_embeddings=True,
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


def sequential_generate(model, engine: TorchEngine, batch: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """Plain `model.generate`, one request after the other (what a server without batching does)."""
    tokens = 0
    eos = sorted(engine.eos_token_ids)
    start = time.perf_counter()
    for i, ids in enumerate(batch):
        torch.manual_seed(i)
        input_ids = torch.tensor([ids], device=engine.device)
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                                 do_sample=True, temperature=1.0, top_p=1.0, top_k=0, eos_token_id=eos,
                                 pad_token_id=engine.pad_token_id)  # fmt: skip
        tokens += out.shape[1] - len(ids)
    _sync(engine)
    return tokens, time.perf_counter() - start


def concurrent_engine(engine: TorchEngine, batch: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """All of `batch` submitted at once, each request streamed by its own asyncio task."""

    async def one(ids: list[int], seed: int) -> int:
        n = 0
        async for chunk in engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)):
            n += len(chunk.token_ids)
        return n

    async def run() -> int:
        return sum(await asyncio.gather(*(one(ids, i) for i, ids in enumerate(batch))))

    start = time.perf_counter()
    tokens = asyncio.run(run())
    _sync(engine)
    return tokens, time.perf_counter() - start


def _sync(engine: TorchEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory or alias (smollm2-135m); default: a tiny random model")
    parser.add_argument("--shape", choices=["qwen2.5-0.5b"], help="random weights of this shape (GPU benchmark)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrent request counts")
    parser.add_argument("--sequential-requests", type=int, default=4, help="requests timed for the baseline")
    args = parser.parse_args()
    if args.model and args.shape:
        parser.error("--model and --shape exclude each other")

    with tempfile.TemporaryDirectory() as tmp:
        if args.shape:
            model_dir, label = build_qwen_shaped(Path(tmp)), f"{args.shape} (random weights)"
        elif args.model:
            model_dir, label = resolve_model(args.model), args.model
        else:
            model_dir, label = build_tiny_model(Path(tmp)), "tiny random llama"
        levels = [int(c) for c in args.concurrency.split(",")]
        with TorchEngine(model_dir, device=args.device, max_batch_size=max(levels)) as engine:
            params = sum(p.numel() for p in engine.model.parameters())
            print(f"model: {label}, {params / 1e6:.1f}M parameters, {engine.device} {engine.dtype}, "
                  f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}, "
                  f"weight-major CPU matmul: {engine.weight_major_matmul}", flush=True)  # fmt: skip
            batch = prompts(engine.tokenizer, max(max(levels), args.sequential_requests))
            print(f"prompts: {min(map(len, batch))}-{max(map(len, batch))} tokens, max_tokens {args.max_tokens}")

            # The baseline gets its own untouched copy of the model (the engine may swap its CPU matmul variant).
            plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=engine.dtype).to(engine.device).eval()
            # Warm-up: first calls allocate, pick kernels (and on CUDA, initialise the context).
            sequential_generate(plain, engine, batch[:1], 8)
            concurrent_engine(engine, batch[: max(levels)], 8)

            rows = []
            tokens, seconds = sequential_generate(plain, engine, batch[: args.sequential_requests], args.max_tokens)
            baseline = tokens / seconds
            rows.append((f"plain generate, {args.sequential_requests} sequential", tokens, seconds, baseline))
            for level in levels:
                before = engine.stats.forwards
                tokens, seconds = concurrent_engine(engine, batch[:level], args.max_tokens)
                forwards = engine.stats.forwards - before
                name = f"TorchEngine, {level} concurrent ({forwards} forwards)"
                rows.append((name, tokens, seconds, tokens / seconds))

    print(f"\n{'run':<44} {'tokens':>7} {'seconds':>8} {'tok/s':>9} {'vs plain':>9}")
    for name, tokens, seconds, rate in rows:
        print(f"{name:<44} {tokens:>7} {seconds:>8.2f} {rate:>9.1f} {rate / baseline:>8.2f}x")


if __name__ == "__main__":
    main()
