"""Peak memory and time of one GRPO step on long merged conversations, with and without gradient checkpointing.

    python bench/train_memory.py                                   # a tiny random model, built on the fly
    python bench/train_memory.py --model smollm2-135m --tokens 5000 --samples 2
    python bench/train_memory.py --smoke                           # seconds: the tiny model, 2 samples x 256 tokens

A Werewolves player's episode is one merged sample of 3-6k tokens of which ~12% are its own (trained) replies. Each
setting runs in a fresh process (peak RSS is per process): load the trainer, then time one `step` on `--samples`
such samples (a group with rewards 0 and 1, so the step trains) and read the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def one_setting(model_dir: Path, tokens: int, samples: int, checkpointing: bool) -> dict[str, float]:
    from marl.protocol import GRPOConfig
    from servers.backends import Group, Sample, TrainBatch
    from servers.trainers.grpo import GRPOTrainer

    trainer = GRPOTrainer(model_dir, GRPOConfig(gradient_checkpointing=checkpointing, micro_batch_tokens=tokens))
    loaded = peak_rss_gb()
    vocab = trainer.policy.get_input_embeddings().num_embeddings
    batch = []
    for i in range(samples):
        ids = [(7919 * (t + 1000 * i)) % vocab for t in range(tokens)]
        mask = [1 if t % 200 >= 176 else 0 for t in range(tokens)]  # 24 trained tokens every 200: ~12%
        batch.append(Sample(episode_id=f"e{i}", agent="werewolf", token_ids=ids, loss_mask=mask,
                            logprobs=[-1.0 * m for m in mask], reward=float(i % 2), policy_version=0,
                            num_calls=25))
    start = time.perf_counter()
    trainer.step(TrainBatch(step=1, groups=[Group(job="bench", task_id="t", agent="werewolf", samples=batch)]))
    return {"seconds": time.perf_counter() - start, "peak_rss_gb": peak_rss_gb(), "rss_after_load_gb": loaded}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory or alias (default: a tiny random model)")
    parser.add_argument("--tokens", type=int, default=5000, help="tokens per sample")
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--one", choices=["on", "off"], help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="a few seconds on the tiny model: does the bench run?")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.tokens, args.samples = None, 256, 2
    if args.one:
        result = one_setting(Path(args.model_dir), args.tokens, args.samples, args.one == "on")
        print(json.dumps(result))
        return

    from servers.model_files import resolve_model
    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = resolve_model(args.model) if args.model else build_tiny_model(Path(scratch) / "tiny")
        rows = {}
        for setting in ("off", "on"):
            child = subprocess.run(
                [sys.executable, __file__, "--one", setting, "--model-dir", str(model_dir), "--tokens",
                 str(args.tokens), "--samples", str(args.samples)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            rows[setting] = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"one GRPO step on {args.samples} samples x {args.tokens} tokens (~12% trained); model "
          f"{args.model or 'tiny random'}")
    print(f"{'gradient checkpointing':24}{'step s':>9}{'peak RSS GB':>13}{'RSS after load GB':>19}")
    for setting, row in rows.items():
        print(f"{setting:24}{row['seconds']:9.1f}{row['peak_rss_gb']:13.2f}{row['rss_after_load_gb']:19.2f}")


if __name__ == "__main__":
    main()
