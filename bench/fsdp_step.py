"""Step time of the FSDP2 trainer at 1 and at 2 ranks (and the one-process GRPO trainer), and their ratio.

    python bench/fsdp_step.py                                          # a tiny random model, built on the fly
    python bench/fsdp_step.py --model smollm2-135m --samples 8 --tokens 256
    python bench/fsdp_step.py --model smollm2-135m --samples 36 --tokens 90 --micro-batch-tokens 4096 \
        --trainers grpo,1,1-bf16                                       # a Kuhn step, fp32 against bf16 compute
    python bench/fsdp_step.py --smoke                                  # seconds: tiny model, 2 samples x 32 tokens

Each trainer gets the same batch: one group of `--samples` synthetic samples of `--tokens` tokens (a quarter of
them trained, rewards 0 and 1 alternating, so the step trains). It takes `--steps` steps; the first is a warm-up
and the median of the others is reported. On the CPU the ranks split the cores between them (gloo), so the ratio
says what sharding costs or gains on this machine; on GPUs each rank has its own device (nccl). `--trainers` picks
the rows: `grpo` (one process, fp32), `N` (FSDP2 on N ranks, `mixed_precision: auto`), `N-bf16` (the same computing
in bf16 over fp32 master weights: on this AMX CPU 0.68x the fp32 rank's step alone, about half in the Kuhn runs).
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
    ranks, _, precision = kind.partition("-")
    return FSDPTrainer(model_dir, FSDPConfig(ranks=int(ranks), mixed_precision=precision or "auto", **knobs),
                       device="cpu")


def label(kind: str) -> str:
    if kind == "grpo":
        return "GRPOTrainer (one process)"
    ranks, _, precision = kind.partition("-")
    return f"FSDPTrainer, {ranks} rank{'s' if ranks != '1' else ''}" + (f", {precision}" if precision else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory or alias (default: a tiny random model)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sample")
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3, help="steps per trainer; the first is a warm-up")
    parser.add_argument("--trainers", default="grpo,1,2", help="rows, comma-separated: grpo, N, N-bf16")
    parser.add_argument("--smoke", action="store_true", help="a few seconds on the tiny model: does the bench run?")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.samples, args.tokens, args.micro_batch_tokens, args.steps = None, 2, 32, 64, 2
        args.trainers = "grpo,1,2,1-bf16"

    from transformers import AutoConfig

    from servers.model_files import resolve_model
    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = resolve_model(args.model) if args.model else build_tiny_model(Path(scratch) / "tiny")
        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        medians = {}
        for kind in args.trainers.split(","):
            trainer = build(kind, model_dir, args.micro_batch_tokens)
            try:
                seconds = time_steps(trainer, args.steps, args.samples, args.tokens, vocab)
            finally:
                getattr(trainer, "close", lambda: None)()
            medians[kind] = statistics.median(seconds[1:] or seconds)
            print(f"{kind:>6}: steps {' '.join(f'{s:.2f}' for s in seconds)} s", flush=True)
    print(f"one GRPO step on {args.samples} samples x {args.tokens} tokens (1/4 trained), micro-batches of "
          f"{args.micro_batch_tokens} tokens; model {args.model or 'tiny random'}; median of steps 2..{args.steps}")
    print(f"{'trainer':28}{'step s':>9}")
    for kind, median in medians.items():
        print(f"{label(kind):28}{median:9.2f}")
    if {"1", "2"} <= set(medians):
        print(f"ratio 2 ranks / 1 rank: {medians['2'] / medians['1']:.2f}")
    if {"1", "1-bf16"} <= set(medians):
        print(f"ratio bf16 / fp32 at 1 rank: {medians['1-bf16'] / medians['1']:.2f}")


if __name__ == "__main__":
    main()
