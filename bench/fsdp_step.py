"""Step time of the FSDP2 trainer at 1 and at 2 ranks (and the one-process GRPO trainer), and their ratio.

    python bench/fsdp_step.py                                          # a tiny random model, built on the fly
    python bench/fsdp_step.py --model smollm2-135m --samples 8 --tokens 256
    python bench/fsdp_step.py --smoke                                  # seconds: tiny model, 2 samples x 32 tokens

Each trainer gets the same batch: one group of `--samples` synthetic samples of `--tokens` tokens (a quarter of
them trained, rewards 0 and 1 alternating, so the step trains). It takes `--steps` steps; the first is a warm-up
and the median of the others is reported. On the CPU the ranks split the cores between them (gloo), so the ratio
says what sharding costs or gains on this machine; on GPUs each rank has its own device (nccl).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere


def make_batch(step: int, samples: int, tokens: int, vocab: int):
    from servers.backends import Group, Sample, TrainBatch

    batch = []
    for i in range(samples):
        ids = [(7919 * (t + 1000 * i)) % vocab for t in range(tokens)]
        mask = [1 if t % 4 == 3 else 0 for t in range(tokens)]
        batch.append(Sample(episode_id=f"e{i}", agent="a", token_ids=ids, loss_mask=mask, reward=float(i % 2),
                            logprobs=[-1.0 * m for m in mask], policy_version=0, num_calls=1))  # fmt: skip
    return TrainBatch(step=step, groups=[Group(job="bench", task_id="t", agent="a", samples=batch)])


def time_steps(trainer, steps: int, samples: int, tokens: int, vocab: int) -> list[float]:
    seconds = []
    for step in range(1, steps + 1):
        batch = make_batch(step, samples, tokens, vocab)
        start = time.perf_counter()
        trainer.step(batch)
        seconds.append(time.perf_counter() - start)
    return seconds


def build(kind: str, model_dir: Path, micro_batch_tokens: int):
    from marl.protocol import GRPOConfig
    from servers.trainers.fsdp import FSDPConfig, FSDPTrainer
    from servers.trainers.grpo import GRPOTrainer

    knobs = dict(learning_rate=1e-5, micro_batch_tokens=micro_batch_tokens)
    if kind == "grpo":
        return GRPOTrainer(model_dir, GRPOConfig(**knobs), device="cpu")
    return FSDPTrainer(model_dir, FSDPConfig(ranks=int(kind), **knobs), device="cpu")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory or alias (default: a tiny random model)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sample")
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3, help="steps per trainer; the first is a warm-up")
    parser.add_argument("--smoke", action="store_true", help="a few seconds on the tiny model: does the bench run?")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.samples, args.tokens, args.micro_batch_tokens, args.steps = None, 2, 32, 64, 2

    from transformers import AutoConfig

    from servers.model_files import resolve_model
    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = resolve_model(args.model) if args.model else build_tiny_model(Path(scratch) / "tiny")
        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        medians = {}
        for kind in ("grpo", "1", "2"):
            trainer = build(kind, model_dir, args.micro_batch_tokens)
            try:
                seconds = time_steps(trainer, args.steps, args.samples, args.tokens, vocab)
            finally:
                getattr(trainer, "close", lambda: None)()
            medians[kind] = statistics.median(seconds[1:] or seconds)
            print(f"{kind:>5}: steps {' '.join(f'{s:.2f}' for s in seconds)} s", flush=True)
    print(f"one GRPO step on {args.samples} samples x {args.tokens} tokens (1/4 trained), micro-batches of "
          f"{args.micro_batch_tokens} tokens; model {args.model or 'tiny random'}; median of steps 2..{args.steps}")
    print(f"{'trainer':28}{'step s':>9}")
    print(f"{'GRPOTrainer (one process)':28}{medians['grpo']:9.2f}")
    print(f"{'FSDPTrainer, 1 rank':28}{medians['1']:9.2f}")
    print(f"{'FSDPTrainer, 2 ranks':28}{medians['2']:9.2f}")
    print(f"ratio 2 ranks / 1 rank: {medians['2'] / medians['1']:.2f}")


if __name__ == "__main__":
    main()
