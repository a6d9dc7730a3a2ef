"""The GPU checklist: what a person with a GPU box runs first (`make gpu-check`), before any real topology.

    python bench/gpu_check.py                 # on a GPU box: every check; a report; exit 1 if one failed
    python bench/gpu_check.py --out DIR       # also write DIR/gpu_check-SHAPE.json
    python bench/gpu_check.py --shape 3b      # Qwen2.5-3B widths instead of 0.5B's
    python bench/gpu_check.py --smoke         # the same code on this CPU with a tiny model (seconds; CI runs it)

Checks, in order (each one's failure is reported and the next still runs):
1. the device: name, memory, compute capability, bf16, torch and CUDA versions;
2. a Qwen2.5-0.5B-shaped random model (its widths, heads and layers; a small vocabulary, because the tokenizer is
   built here and no hub is needed) in a temporary directory;
3. the torch engine on the device: tokens/s at batch 1 and 32, and its peak memory against `marl plan`'s figure;
4. a GRPO step (one process, fp32) and an FSDP step (bf16 mixed precision, one rank per visible GPU): seconds and
   peak memory against the plan (the ranks' peak is read from the device's used memory while the step runs), and
   what the allocator reserved after the step and after the trainer emptied its cache (`device_reserved_gb`,
   `device_reserved_freed_gb`: what an engine waking on the same GPU finds taken; the torch engine has no sleep
   mode, so there is no wake beside a rank to show without vLLM);
5. with vLLM's CUDA build in .venv-vllm (`make vllm`): a boot, a weight sync through the weight-transfer engine
   (the disk path as fallback, reported), sleep and wake, tokens/s at batch 32.

Checks 1-4 ran on one H200 and on one H100 on 2026-11-26 (docs/backends.md, "On a GPU"); check 5 has not run on a
GPU yet. The smoke run proves the code paths on the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

import torch  # noqa: E402

#: Qwen2.5-0.5B's widths (marl/plan/architecture.py), with the vocabulary of the tokenizer built here.
HALF_B_SHAPE = {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "intermediate_size": 4864}
#: Qwen2.5-3B's widths: big enough that the weights, not the CUDA context and allowances, dominate the plan.
THREE_B_SHAPE = {"hidden_size": 2048, "num_layers": 36, "num_heads": 16, "intermediate_size": 11008}
SHAPES = {"0.5b": HALF_B_SHAPE, "3b": THREE_B_SHAPE}
TINY_SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128}


def device_report(device: str) -> dict:
    report = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        report.update(name=props.name, memory_gb=props.total_memory / 1e9, gpus=torch.cuda.device_count(),
                      capability=f"{props.major}.{props.minor}", bf16=torch.cuda.is_bf16_supported(),
                      cuda=torch.version.cuda)  # fmt: skip
    return report


class PeakMemory:
    """Peak device memory of a block: this process's allocator peak (`in_process`) and, sampled every 10 ms, the
    device's used memory (`device_used`, which counts other processes, e.g. FSDP ranks, and CUDA contexts)."""

    def __init__(self, device: str) -> None:
        self.device, self.in_process, self.device_used = device, 0, 0
        self._stop = threading.Event()

    def __enter__(self) -> PeakMemory:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            threading.Thread(target=self._sample, daemon=True).start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.device_used = max(self.device_used, total - free)
            time.sleep(0.01)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.in_process = torch.cuda.max_memory_allocated()


def check_engine(model_dir: Path, device: str, batch: int, new_tokens: int) -> dict:
    from marl.plan.architecture import architecture_of
    from marl.plan.memory import engine_torch
    from servers.backends import SamplingParams
    from servers.engines.torch_engine import TorchEngine

    with PeakMemory(device) as memory:
        engine = TorchEngine(model_dir, device=device, max_batch_size=batch, prefix_cache_bytes=0)
        rates = {n: _tokens_per_s(engine, SamplingParams, n, new_tokens) for n in (1, batch)}
        engine.close()
    dtype_bytes = 2 if device == "cuda" else 4
    parts = engine_torch(architecture_of(str(model_dir)), weight_bytes=dtype_bytes, sequences=batch,
                         tokens_per_sequence=128 + new_tokens, prompt_tokens=128, prefix_cache_bytes=0,
                         on_gpu=device == "cuda")  # fmt: skip
    allocated = parts.total - dict(parts.items).get("CUDA context", 0)  # the allocator does not count the context
    return {"tokens_per_s": rates, **_against(allocated, memory.in_process)}


def _tokens_per_s(engine, sampling, batch: int, new_tokens: int) -> float:
    async def one(i: int) -> int:
        count = 0
        async for chunk in engine.generate([(31 * t + i) % 100 + 10 for t in range(128)],
                                           sampling(max_tokens=new_tokens, seed=i)):  # fmt: skip
            count += len(chunk.token_ids)
        return count

    async def all_of_them() -> int:
        return sum(await asyncio.gather(*(one(i) for i in range(batch))))

    asyncio.run(all_of_them())  # warm-up
    started = time.perf_counter()
    tokens = asyncio.run(all_of_them())
    return tokens / (time.perf_counter() - started)


def check_grpo(model_dir: Path, device: str, tokens: int) -> dict:
    from bench.plan_accuracy import _batch
    from marl.plan.architecture import architecture_of
    from marl.plan.memory import TrainerSetting, trainer_rank
    from marl.protocol import GRPOConfig
    from servers.trainers.grpo import GRPOTrainer

    trainer = GRPOTrainer(model_dir, GRPOConfig(micro_batch_tokens=tokens), device=device)
    vocab = trainer.policy.get_input_embeddings().num_embeddings
    trainer.step(_batch(1, vocab, tokens, tokens // 2))
    with PeakMemory(device) as memory:
        started = time.perf_counter()
        trainer.step(_batch(2, vocab, tokens, tokens // 2))
        seconds = time.perf_counter() - started
    released = trainer.release_memory()
    setting = TrainerSetting(micro_batch_tokens=tokens, trained_tokens=tokens // 2)
    plan = trainer_rank(architecture_of(str(model_dir)), setting)[1].total
    return {"step_s": seconds, **_against(plan, memory.in_process), **released}


def check_fsdp(model_dir: Path, device: str, tokens: int) -> dict:
    from bench.plan_accuracy import _batch
    from marl.plan.architecture import architecture_of
    from marl.plan.memory import TrainerSetting, trainer_rank
    from marl.protocol import FSDPConfig
    from servers.trainers.fsdp import FSDPTrainer

    ranks = torch.cuda.device_count() if device == "cuda" else 2
    before = _device_used(device)  # this process's context and cache: not the ranks'
    trainer = FSDPTrainer(model_dir, FSDPConfig(ranks=ranks, micro_batch_tokens=tokens), device=device)
    try:
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        trainer.step(_batch(1, vocab, tokens, tokens // 2))
        with PeakMemory(device) as memory:
            started = time.perf_counter()
            trainer.step(_batch(2, vocab, tokens, tokens // 2))
            seconds = time.perf_counter() - started
        released = trainer.release_memory()  # what each rank reserved after the step, and after emptying its cache
    finally:
        trainer.close()
    setting = TrainerSetting(ranks=ranks, compute_bytes=2 if device == "cuda" else 4, micro_batch_tokens=tokens,
                             trained_tokens=tokens // 2, sharded=True, on_gpu=device == "cuda")  # fmt: skip
    plan = trainer_rank(architecture_of(str(model_dir)), setting)[1].total
    # GPU 0 holds rank 0 (its CUDA context too, which the plan counts); mem_get_info sees GPU 0 only.
    measured = memory.device_used - before
    return {"ranks": ranks, "step_s": seconds, **_against(plan, measured), **released}


def check_vllm(model_dir: Path, device: str) -> dict:
    from servers.engines.vllm_process import vllm_python

    if not vllm_python().exists():
        return {"skipped": "no vLLM: run `make vllm` on this box"}
    if device != "cuda":
        return {"skipped": "vLLM's weight transfer and sleep mode are CUDA only (the CPU build is tested in make test)"}
    from servers.engines.vllm_engine import VLLMEngine
    from servers.trainers.grpo import GRPOTrainer

    work = Path(tempfile.mkdtemp(prefix="gpu-check-vllm-"))
    started = time.perf_counter()
    engine = VLLMEngine(model_dir, device="cuda", work_dir=work, shares_gpu=True)
    report: dict = {"boot_s": time.perf_counter() - started}
    from servers.backends import SamplingParams

    report["tokens_per_s_batch_32"] = _tokens_per_s(engine, SamplingParams, 32, 64)
    trainer = GRPOTrainer(model_dir, device="cuda")
    engine.before_training_step()  # sleep
    started = time.perf_counter()
    engine.load_weights_from(trainer.export_weights(work / "export"))  # wakes; the disk path
    report["sleep_wake_disk_sync_s"] = time.perf_counter() - started
    started = time.perf_counter()
    report["weight_transfer_served"] = engine.push_weights(trainer.push_weights)  # False: it fell back to the disk
    report["weight_transfer_sync_s"] = time.perf_counter() - started
    report["weight_transfer_off"] = engine.transfer_off
    report["stats"] = {k: v for k, v in vars(engine.stats).items() if isinstance(v, int | float | str)}
    engine.close()
    return report


def _device_used(device: str) -> int:
    if device != "cuda":
        return 0
    gc.collect()
    torch.cuda.empty_cache()  # the cache of an earlier check's tensors would count as the ranks'
    free, total = torch.cuda.mem_get_info()
    return total - free


def _against(plan: float, measured: float) -> dict:
    return {"planned_gb": plan / 1e9, "measured_gb": measured / 1e9,
            "planned_over_measured": plan / measured if measured else None}


def run_checks(device: str, shape: dict, *, tokens: int, batch: int, vllm: bool) -> dict:
    from tests.tiny_model import build_tiny_model

    report: dict = {"device": device_report(device)}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = build_tiny_model(Path(scratch) / "model", max_position_embeddings=4096, **shape)
        checks: dict[str, Callable[[], dict]] = {
            "torch_engine": lambda: check_engine(model_dir, device, batch, 64),
            "grpo_step": lambda: check_grpo(model_dir, device, tokens),
            "fsdp_step": lambda: check_fsdp(model_dir, device, tokens),
        }
        if vllm:
            checks["vllm"] = lambda: check_vllm(model_dir, device)
        for name, check in checks.items():
            print(f"{name} ...", flush=True)
            try:
                report[name] = check()
            except Exception:  # noqa: BLE001 - every check reports; one failing must not hide the others
                report[name] = {"failed": traceback.format_exc(limit=8)}
            print(f"{name}: {json.dumps(report[name], default=str)[:400]}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write gpu_check-SHAPE.json here")
    parser.add_argument("--smoke", action="store_true", help="on the CPU, a tiny model: do the code paths run?")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM checks")
    parser.add_argument("--shape", choices=SHAPES, default="0.5b", help="the model's widths on a GPU (default 0.5b)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not args.smoke:
        print("no GPU visible: running the CPU smoke instead (--smoke)")
    shape = SHAPES[args.shape] if device == "cuda" else TINY_SHAPE
    report = run_checks(device, shape, tokens=2048 if device == "cuda" else 128, batch=32 if device == "cuda" else 4,
                        vllm=not args.no_vllm and not args.smoke)  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"gpu_check-{args.shape}.json").write_text(json.dumps(report, indent=2, default=str))
    failed = [name for name, value in report.items() if isinstance(value, dict) and "failed" in value]
    print("failed: " + ", ".join(failed) if failed else "every check ran")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
