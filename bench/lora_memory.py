"""Memory of k roles on one base model: one server of k LoRA policies against k full-weight servers (issue 21).

    python bench/lora_memory.py                          # SmolLM2-135M, 3 roles, one training step each
    python bench/lora_memory.py --roles 3 --out DIR      # also DIR/lora_memory.json
    python bench/lora_memory.py --smoke                  # a tiny random model and 2 roles, in seconds

Each side runs as `marl serve` subprocesses on this CPU, as `marl run` starts them. Every role (a policy, or a
server) plays two episodes of one group and takes one training step, so the optimizer state exists; then the
resident memory (RSS) of each server process is read, and its peak (VmHWM). The ratio is the LoRA side's total over
the full side's. The goal in the issue: at most 0.4x.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

import openai  # noqa: E402

from marl.client import SwarmClient  # noqa: E402
from marl.protocol import LoraSpec, TrainConfig  # noqa: E402
from marl.runner.launch import ServerProcess  # noqa: E402

TOKEN = "bench-token"
CONFIG = TrainConfig(batch_size=1, num_repeat=2, save_freq=0, grpo={"micro_batch_tokens": 1024})


def memory_mb(pid: int) -> dict[str, float]:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {key: int(status[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


def one_step(client: SwarmClient) -> None:
    """Two episodes of one task (one group), then wait for the step."""
    client.auto_sync_train_config_and_start_engine(CONFIG)
    for reward in (0.0, 1.0):
        with client.episode("t") as ep:
            reply = ep.openai().chat.completions.create(model=ep.model, max_tokens=16,
                                                        messages=[{"role": "user", "content": "Name a colour."}])
            assert isinstance(reply, openai.types.chat.ChatCompletion)
            ep.reward = reward
    deadline = time.monotonic() + 600
    while client.status().policy_version < 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{client} took no step in 600 s")
        time.sleep(0.2)


def measure(model: str, roles: int, lora: bool, scratch: Path) -> dict:
    names = [f"role{i}" for i in range(roles)]
    policies = {name: LoraSpec() for name in names} if lora else None
    servers = [ServerProcess(model=model, admin_token=TOKEN, data_dir=scratch / f"{lora}-{name}", device="cpu",
                             log_path=scratch / f"{lora}-{name}.log", policies=policies)
               for name in (["team"] if lora else names)]  # fmt: skip
    try:
        for server in servers:
            server.start().wait_healthy(timeout=300)
        clients = ([SwarmClient(servers[0].url, admin_token=TOKEN, policy=name) for name in names] if lora
                   else [SwarmClient(server.url, admin_token=TOKEN) for server in servers])  # fmt: skip
        for client in clients:
            one_step(client)
        each = [memory_mb(server.proc.pid) for server in servers]
        return {"processes": len(servers), "rss_mb": sum(m["VmRSS"] for m in each),
                "peak_rss_mb": sum(m["VmHWM"] for m in each)}
    finally:
        for server in servers:
            server.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--roles", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a tiny random model and 2 roles")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lora-memory-") as tmp:
        scratch = Path(tmp)
        model = args.model
        if args.smoke:
            from tests.tiny_model import build_tiny_model

            model, args.roles = str(build_tiny_model(scratch / "tiny")), 2  # 3 server processes, not 4
        lora = measure(model, args.roles, True, scratch)
        full = measure(model, args.roles, False, scratch)
    report = {"model": args.model if not args.smoke else "tiny", "roles": args.roles, "lora": lora, "full": full,
              "rss_ratio": lora["rss_mb"] / full["rss_mb"], "peak_ratio": lora["peak_rss_mb"] / full["peak_rss_mb"]}
    print(f"{args.roles} roles on {report['model']}, after one training step each (MB):")
    print(f"{'':28}{'processes':>10}{'RSS':>10}{'peak RSS':>10}")
    for label, row in ((f"1 server, {args.roles} LoRA policies", lora), (f"{args.roles} full-weight servers", full)):
        print(f"{label:28}{row['processes']:>10}{row['rss_mb']:>10.0f}{row['peak_rss_mb']:>10.0f}")
    print(f"LoRA / full: RSS {report['rss_ratio']:.2f}x, peak {report['peak_ratio']:.2f}x (goal <= 0.4x)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lora_memory.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
