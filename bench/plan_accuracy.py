"""`marl plan`'s memory model against measured peaks on this CPU: the torch engine, GRPO steps, a 2-rank FSDP step.

The GRPO cases: plain, with gradient checkpointing (`+ckpt`), with the entropy bonus (`+entropy`).

    python bench/plan_accuracy.py                        # SmolLM2-135M and a 150M random model (minutes)
    python bench/plan_accuracy.py --smoke                # seconds: a small random model, small shapes
    python bench/plan_accuracy.py --model DIR --json     # one model, machine-readable (tests use this)

Each case runs in a fresh process with `MALLOC_MMAP_THRESHOLD_` fixed at 64 KiB, so every tensor of any size is its
own mapping that goes back to the OS when freed: the resident size then follows the live tensors. The measured peak
is the process's resident high-water mark (`VmHWM`, reset through /proc/self/clear_refs once everything is loaded
and one warm-up pass ran) minus its resident size right after the imports, before any model existed. The plan's
figure is `marl/plan/memory.py`'s for the same shapes. The FSDP case reads both ranks' high-water marks from the
parent, against the resident size of a process that made the same imports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
_MB = 2**20


def _status(field: str, pid: int | str = "self") -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _reset_peak(pid: int | str = "self") -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def _samples(vocab: int, tokens: int, count: int, trained: int) -> list:
    """`count` samples of `tokens` ids, the last `trained` of each trained (a group with rewards 0 and 1)."""
    from servers.backends import Sample

    return [Sample(episode_id=f"e{i}", agent="a", token_ids=[(7919 * (t + 1000 * i)) % vocab for t in range(tokens)],
                   loss_mask=[int(t >= tokens - trained) for t in range(tokens)],
                   logprobs=[-1.0 * (t >= tokens - trained) for t in range(tokens)], reward=float(i % 2),
                   policy_version=0, num_calls=1) for i in range(count)]  # fmt: skip


def _batch(step: int, vocab: int, tokens: int, trained: int, samples: int = 2):
    """A step's batch: one group of `samples` (each its own micro-batch). Two or more micro-batches per process, as
    in a real step: from the second on, the gradients of the first are alive during the passes."""
    from servers.backends import Group, TrainBatch

    group = Group(job="bench", task_id=f"t{step}", agent="a", samples=_samples(vocab, tokens, samples, trained))
    return TrainBatch(step=step, groups=[group])


def measure_grpo(model_dir: str, tokens: int, trained: int, checkpointing: bool, entropy: bool = False,
                 warmup_dir: str = "") -> int:  # fmt: skip
    from marl.protocol import GRPOConfig
    from servers.trainers.grpo import GRPOTrainer

    def two_steps(directory: str, tokens: int, trained: int) -> None:
        config = GRPOConfig(micro_batch_tokens=tokens, gradient_checkpointing=checkpointing,
                            entropy_coef=0.01 if entropy else 0.0)  # fmt: skip
        trainer = GRPOTrainer(Path(directory), config)
        vocab = trainer.policy.get_input_embeddings().num_embeddings
        trainer.step(_batch(1, vocab, tokens, trained))  # AdamW's moments exist from here on
        _reset_peak()
        trainer.step(_batch(2, vocab, tokens, trained))

    if warmup_dir:  # libraries, kernels and thread pools load on first use: not the model's memory
        two_steps(warmup_dir, 64, 16)
    baseline = _status("VmRSS")
    two_steps(model_dir, tokens, trained)
    return _status("VmHWM") - baseline


def measure_engine(model_dir: str, sequences: int, prompt_tokens: int, new_tokens: int, warmup_dir: str = "") -> int:
    if warmup_dir:  # libraries, kernels and thread pools load on first use: not the model's memory
        _two_batches(warmup_dir, 2, 16, 8)
    baseline = _status("VmRSS")
    _two_batches(model_dir, sequences, prompt_tokens, new_tokens)
    return _status("VmHWM") - baseline


def _two_batches(model_dir: str, sequences: int, prompt_tokens: int, new_tokens: int) -> None:
    from servers.backends import SamplingParams
    from servers.engines.torch_engine import TorchEngine

    engine = TorchEngine(model_dir, device="cpu", max_batch_size=sequences, prefix_cache_bytes=0)
    vocab = engine.vocab_size

    async def generate(i: int) -> None:
        prompt = [(7919 * (t + 97 * i)) % vocab for t in range(prompt_tokens)]
        async for _ in engine.generate(prompt, SamplingParams(max_tokens=new_tokens, seed=i)):
            pass

    async def batch() -> None:
        await asyncio.gather(*(generate(i) for i in range(sequences)))

    asyncio.run(batch())  # warm-up: the first batch sizes the cache buffers
    _reset_peak()
    asyncio.run(batch())
    engine.close()


def measure_fsdp(model_dir: str, tokens: int, trained: int, checkpointing: bool) -> list[int]:
    from marl.protocol import FSDPConfig
    from servers.trainers.fsdp import FSDPTrainer

    config = FSDPConfig(ranks=2, micro_batch_tokens=tokens, gradient_checkpointing=checkpointing)
    trainer = FSDPTrainer(Path(model_dir), config, device="cpu", threads_per_rank=1)
    try:
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        trainer.step(_batch(1, vocab, tokens, trained, samples=4))  # two micro-batches per rank
        pids = trainer.ranks.pids
        for pid in pids:
            _reset_peak(pid)
        trainer.step(_batch(2, vocab, tokens, trained, samples=4))
        return [_status("VmHWM", pid) for pid in pids]
    finally:
        trainer.close()


def _rank_baseline() -> int:
    """Resident size of a fresh process that made a rank's imports (a rank's before it builds its shard)."""
    code = "import torch.distributed, transformers, servers.trainers.fsdp_worker, re, pathlib; " \
           "print(re.search(r'VmRSS:\\s+(\\d+)', pathlib.Path('/proc/self/status').read_text()).group(1))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, **_MALLOC_ENV}, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    return int(out.stdout.split()[-1]) * 1024


def _child(case: str, **kwargs) -> object:
    """Run one measurement in a fresh process (its own peak), with the malloc setting above."""
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps({"case": case, **kwargs})],
                         capture_output=True, text=True, env={**os.environ, **_MALLOC_ENV})  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{case} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def planned(case: str, model_dir: str, **shape) -> float:
    """The plan's peak for one case (marl/plan/memory.py), in bytes."""
    from marl.plan.architecture import architecture_of
    from marl.plan.memory import TrainerSetting, engine_torch, trainer_rank

    arch = architecture_of(model_dir)
    if case == "engine":
        return engine_torch(arch, weight_bytes=4, sequences=shape["sequences"], prefix_cache_bytes=0, on_gpu=False,
                            tokens_per_sequence=shape["prompt_tokens"] + shape["new_tokens"],
                            prompt_tokens=shape["prompt_tokens"]).total  # fmt: skip
    setting = TrainerSetting(ranks=2 if case == "fsdp" else 1, micro_batch_tokens=shape["tokens"],
                             trained_tokens=shape["trained"], checkpointing=shape["checkpointing"],
                             entropy_bonus=shape.get("entropy", False), sharded=case == "fsdp")  # fmt: skip
    return trainer_rank(arch, setting)[1].total


CASES = ("engine", "grpo", "grpo+ckpt", "grpo+entropy", "fsdp")


def compare(model_dir: str, warmup_dir: str, *, tokens: int, trained: int, sequences: int, prompt_tokens: int,
            new_tokens: int, cases: tuple[str, ...] = CASES) -> list[dict]:  # fmt: skip
    """Planned vs measured peak (bytes) of each case on the model in `model_dir` (`warmup_dir`: a tiny model that
    runs first in each process)."""
    rows = []
    for case in cases:
        if case == "engine":
            shape = {"sequences": sequences, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens}
            measured = _child("engine", model_dir=model_dir, warmup_dir=warmup_dir, **shape)
        else:
            base = case.split("+")[0]
            shape = {"tokens": tokens, "trained": trained, "checkpointing": case.endswith("+ckpt")}
            if case.endswith("+entropy"):  # train.grpo.entropy_coef > 0: the entropy's backward over the vocabulary
                shape["entropy"] = True
            warmup = {"warmup_dir": warmup_dir} if base == "grpo" else {}
            measured = _child(base, model_dir=model_dir, **warmup, **shape)
            if base == "fsdp":
                measured = max(measured) - _rank_baseline()
        plan = planned(case.split("+")[0], model_dir, **shape)
        rows.append({"case": case, "model": model_dir, **shape, "planned": plan, "measured": measured,
                     "ratio": plan / measured})  # fmt: skip
    return rows


def _build_random_model(directory: Path, *, hidden: int, layers: int, intermediate: int, heads: int) -> str:
    from tests.tiny_model import build_tiny_model

    return str(build_tiny_model(directory, hidden_size=hidden, num_layers=layers, intermediate_size=intermediate,
                                num_heads=heads, max_position_embeddings=4096))  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory or alias (default: SmolLM2-135M and a 150M random model)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per training sample (= micro-batch)")
    parser.add_argument("--trained", type=int, default=1024, help="trained tokens per sample")
    parser.add_argument("--sequences", type=int, default=8, help="concurrent generations of the engine case")
    parser.add_argument("--prompt-tokens", type=int, help="prompt tokens of the engine case (default: tokens / 4)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"which of {', '.join(CASES)} (default: all)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--smoke", action="store_true", help="seconds: a small random model and small shapes")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        measure = {"grpo": measure_grpo, "engine": measure_engine, "fsdp": measure_fsdp}[spec.pop("case")]
        print(json.dumps(measure(**spec)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        warmup = _build_random_model(Path(scratch) / "warmup", hidden=64, layers=2, intermediate=128, heads=4)
        if args.smoke:
            models = [_build_random_model(Path(scratch) / "small", hidden=256, layers=4, intermediate=704, heads=4)]
            args.tokens, args.trained, args.sequences = 512, 256, 4
        elif args.model:
            from servers.model_files import resolve_model

            models = [str(resolve_model(args.model))]
        else:
            from servers.model_files import resolve_model

            models = [str(resolve_model("smollm2-135m")),
                      _build_random_model(Path(scratch) / "random-150m", hidden=1024, layers=12, intermediate=2816,
                                          heads=16)]  # fmt: skip
        shapes = {"tokens": args.tokens, "trained": args.trained, "sequences": args.sequences,
                  "prompt_tokens": args.prompt_tokens or args.tokens // 4, "new_tokens": 64}
        cases = ("engine", "grpo") if args.smoke else tuple(args.cases.split(","))  # smoke: no rank processes
        rows = [row for model in models for row in compare(model, warmup, cases=cases, **shapes)]
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'case':12}{'model':>28}{'planned MB':>12}{'measured MB':>13}{'planned/measured':>18}")
    for row in rows:
        print(f"{row['case']:12}{Path(row['model']).name[-28:]:>28}{row['planned'] / _MB:12.0f}"
              f"{row['measured'] / _MB:13.0f}{row['ratio']:18.2f}")


if __name__ == "__main__":
    main()
