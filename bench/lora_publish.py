"""Publishing a trained policy to the engine: a LoRA adapter against the full weights (issue 21, bench 2).

    python bench/lora_publish.py                         # SmolLM2-135M, rank 16, the torch engine
    python bench/lora_publish.py --out DIR               # also DIR/lora_publish.json
    python bench/lora_publish.py --smoke                 # a tiny random model, in seconds
    python bench/lora_publish.py --engine vllm           # the same on vLLM (`make vllm`): through the disk only

What the train loop does after a step (`servers.training.lifecycle.EngineLifecycle.publish_weights`), timed: the
full-weight trainer's tensors into the torch engine (`Trainer.named_weights` -> `InferenceEngine.load_weights`),
against one policy's adapter (`PolicyTrainer.adapter_weights` -> `InferenceEngine.load_adapter`), each after one
training step so the weights really changed; and the same through the disk (export, then the engine's load from the
directory), the path of an engine in another process. The median of `--repeats` publishes. On vLLM (`--engine vllm`,
the CPU build here) weights only travel through the disk: the full weights are reloaded in place between a pause and a
resume, the adapter is loaded at runtime (`/v1/load_lora_adapter`) while everything else keeps generating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from bench.plan_accuracy import _batch  # noqa: E402
from marl.protocol import GRPOConfig, LoraSpec  # noqa: E402
from servers.backends import InferenceEngine  # noqa: E402
from servers.engines.torch_engine import TorchEngine  # noqa: E402
from servers.engines.vllm_lora import lora_slots  # noqa: E402
from servers.model_files import resolve_model  # noqa: E402
from servers.trainers.grpo import GRPOTrainer  # noqa: E402
from servers.trainers.lora_grpo import LoraGRPOTrainer  # noqa: E402


def median_s(publish: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        publish()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def trained_batch(vocab: int):
    return _batch(1, vocab, 128, 64)


def build_engine(kind: str, model_dir: Path, spec: LoraSpec, scratch: Path) -> InferenceEngine:
    if kind == "vllm":
        from servers.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, device="cpu", work_dir=scratch / "vllm", lora=lora_slots([spec]))
    return TorchEngine(model_dir, device="cpu")


def full_weights(model_dir: Path, engine: InferenceEngine, repeats: int, scratch: Path) -> dict:
    trainer = GRPOTrainer(model_dir, GRPOConfig(micro_batch_tokens=1024), device="cpu")
    trainer.step(trained_batch(trainer.policy.get_input_embeddings().num_embeddings))
    in_process = (median_s(lambda: engine.load_weights(trainer.named_weights()), repeats)
                  if engine.takes_tensors else None)
    disk = median_s(lambda: engine.load_weights_from(trainer.export_weights(scratch / "full")), repeats)
    trainer.close()
    return {"in_process_s": in_process, "through_disk_s": disk}


def adapter(model_dir: Path, engine: InferenceEngine, spec: LoraSpec, repeats: int, scratch: Path) -> dict:
    trainer = LoraGRPOTrainer(model_dir, {"speaker": (spec, GRPOConfig(micro_batch_tokens=1024))}, device="cpu")
    trainer.step("speaker", trained_batch(trainer.model.get_input_embeddings().num_embeddings))
    in_process = (median_s(lambda: engine.load_adapter("speaker", trainer.adapter_weights("speaker"), spec), repeats)
                  if engine.takes_tensors else None)
    disk = median_s(lambda: engine.load_adapter_from("speaker", trainer.export_adapter("speaker",
                                                                                       scratch / "adapter")), repeats)
    size = sum(t.numel() * t.element_size() for t in trainer.adapter_weights("speaker").values())
    trainer.close()
    return {"in_process_s": in_process, "through_disk_s": disk, "adapter_mb": size / 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--engine", choices=("torch", "vllm"), default="torch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a tiny random model")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lora-publish-") as tmp:
        scratch = Path(tmp)
        if args.smoke:
            from tests.tiny_model import build_tiny_model

            model_dir, name = build_tiny_model(scratch / "tiny", num_heads=2), "tiny"  # head_dim 32, as vLLM needs
        else:
            model_dir, name = resolve_model(args.model), args.model
        spec = LoraSpec(rank=args.rank, alpha=2 * args.rank)
        engine = build_engine(args.engine, model_dir, spec, scratch)
        try:
            full = full_weights(model_dir, engine, args.repeats, scratch)
            lora = adapter(model_dir, engine, spec, args.repeats, scratch)
        finally:
            engine.close()
    report = {"model": name, "rank": args.rank, "engine": args.engine, "full": full, "adapter": lora,
              "ratio_in_process": ratio(lora["in_process_s"], full["in_process_s"]),
              "ratio_through_disk": ratio(lora["through_disk_s"], full["through_disk_s"])}
    print_report(report, args.repeats)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lora_publish.json").write_text(json.dumps(report, indent=2))
    return 0


def ratio(part: float | None, whole: float | None) -> float | None:
    return None if part is None or whole is None else part / whole


def print_report(report: dict, repeats: int) -> None:
    full, lora = report["full"], report["adapter"]
    print(f"publishing one trained policy to the {report['engine']} engine, {report['model']}, median of"
          f" {repeats} (s):")
    print(f"{'':34}{'in process':>12}{'through disk':>14}")
    label = f"LoRA adapter, rank {report['rank']} ({lora['adapter_mb']:.1f} MB)"
    for name, row in (("full weights", full), (label, lora)):
        in_process = "-" if row["in_process_s"] is None else f"{row['in_process_s']:.3f}"
        print(f"{name:34}{in_process:>12}{row['through_disk_s']:>14.3f}")
    goal = "<= 0.5 s" if report["engine"] == "vllm" else "<= 0.1 s"
    in_process = "-" if report["ratio_in_process"] is None else f"{report['ratio_in_process']:.3f}x"
    print(f"adapter / full: {in_process} in process, {report['ratio_through_disk']:.3f}x through the disk (goal on"
          f" the {report['engine']} engine: {goal})")


if __name__ == "__main__":
    sys.exit(main())
