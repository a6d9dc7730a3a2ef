"""Publishing a trained policy to the engine: a LoRA adapter against the full weights (issue 21, bench 2).

    python bench/lora_publish.py                         # SmolLM2-135M, rank 16, the torch engine
    python bench/lora_publish.py --out DIR               # also DIR/lora_publish.json
    python bench/lora_publish.py --smoke                 # a tiny random model, in seconds

What the train loop does after a step (`servers.lifecycle.EngineLifecycle.publish_weights`), timed: the full-weight
trainer's tensors into the torch engine (`Trainer.named_weights` -> `InferenceEngine.load_weights`), against one
policy's adapter (`PolicyTrainer.adapter_weights` -> `InferenceEngine.load_adapter`), each after one training step so
the weights really changed; and the same through the disk (export, then the engine's load from the directory), the
path of an engine in another process. The median of `--repeats` publishes. vLLM's runtime LoRA load is not in here:
`make vllm` and bench/engine_throughput.py --engine vllm time vLLM's own reload.
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
from servers.engines.torch_engine import TorchEngine  # noqa: E402
from servers.models import resolve_model  # noqa: E402
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


def full_weights(model_dir: Path, engine: TorchEngine, repeats: int, scratch: Path) -> dict:
    trainer = GRPOTrainer(model_dir, GRPOConfig(micro_batch_tokens=1024), device="cpu")
    trainer.step(trained_batch(trainer.policy.get_input_embeddings().num_embeddings))
    in_process = median_s(lambda: engine.load_weights(trainer.named_weights()), repeats)
    disk = median_s(lambda: engine.load_weights_from(trainer.export_weights(scratch / "full")), repeats)
    trainer.close()
    return {"in_process_s": in_process, "through_disk_s": disk}


def adapter(model_dir: Path, engine: TorchEngine, rank: int, repeats: int, scratch: Path) -> dict:
    spec = LoraSpec(rank=rank, alpha=2 * rank)
    trainer = LoraGRPOTrainer(model_dir, {"speaker": (spec, GRPOConfig(micro_batch_tokens=1024))}, device="cpu")
    trainer.step("speaker", trained_batch(trainer.model.get_input_embeddings().num_embeddings))
    in_process = median_s(lambda: engine.load_adapter("speaker", trainer.adapter_weights("speaker"), spec), repeats)
    disk = median_s(lambda: engine.load_adapter_from("speaker", trainer.export_adapter("speaker",
                                                                                       scratch / "adapter")), repeats)
    size = sum(t.numel() * t.element_size() for t in trainer.adapter_weights("speaker").values())
    trainer.close()
    return {"in_process_s": in_process, "through_disk_s": disk, "adapter_mb": size / 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a tiny random model")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lora-publish-") as tmp:
        scratch = Path(tmp)
        if args.smoke:
            from servers.tiny_model import build_tiny_model

            model_dir, name = build_tiny_model(scratch / "tiny"), "tiny"
        else:
            model_dir, name = resolve_model(args.model), args.model
        engine = TorchEngine(model_dir, device="cpu")
        try:
            full = full_weights(model_dir, engine, args.repeats, scratch)
            lora = adapter(model_dir, engine, args.rank, args.repeats, scratch)
        finally:
            engine.close()
    report = {"model": name, "rank": args.rank, "engine": "torch", "full": full, "adapter": lora,
              "ratio_in_process": lora["in_process_s"] / full["in_process_s"],
              "ratio_through_disk": lora["through_disk_s"] / full["through_disk_s"]}
    print(f"publishing one trained policy to the torch engine, {name}, median of {args.repeats} (s):")
    print(f"{'':34}{'in process':>12}{'through disk':>14}")
    print(f"{'full weights':34}{full['in_process_s']:>12.3f}{full['through_disk_s']:>14.3f}")
    label = f"LoRA adapter, rank {args.rank} ({lora['adapter_mb']:.1f} MB)"
    print(f"{label:34}{lora['in_process_s']:>12.3f}{lora['through_disk_s']:>14.3f}")
    print(f"adapter / full: {report['ratio_in_process']:.3f}x in process, {report['ratio_through_disk']:.3f}x"
          " through the disk (goal on the torch engine: <= 0.1 s)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lora_publish.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
