"""Werewolves' two learners as two LoRA policies of one base, against two full-weight servers: one training step each
(issue 21).

    python bench/lora_werewolves.py                      # SmolLM2-135M, Werewolves-length episodes
    python bench/lora_werewolves.py --out DIR            # also DIR/lora_werewolves.json
    python bench/lora_werewolves.py --smoke              # a tiny random model, short episodes

The servers and their settings are the shipped topologies' (`werewolves-lora.yaml`: one server, policies wolves and
seer; `werewolves-local.yaml`: wolves_model and seer_model), run as `marl serve` subprocesses on this CPU as `marl
run` starts them. A real game on this CPU takes most of an hour per step (docs/running.md, "Shipped topologies"), so
the episodes are synthetic but Werewolves-shaped: each learner plays one group of `num_repeat` episodes whose one
call carries a `--prompt-tokens` prompt (the env's rules and a day's talk, repeated: a late-game Werewolves
conversation is 3-6k tokens) and a short reply, rewards 0/1 alternating, then takes its training step. Measured per
side: the peak resident memory (VmHWM) of its server processes, summed, and each learner's step time (`seconds` in
its metrics.jsonl: the step alone). The learners step one after the other on both sides, so nothing else runs during
a step.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from bench.lora_memory import TOKEN, memory_mb  # noqa: E402
from envs.werewolves import Werewolves  # noqa: E402
from marl.client import SwarmClient  # noqa: E402
from marl.protocol import TrainConfig  # noqa: E402
from marl.runner.launch import ServerProcess  # noqa: E402
from marl.topology import Topology  # noqa: E402
from servers.model_files import load_tokenizer, resolve_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LORA, FULL = ROOT / "topologies" / "werewolves-lora.yaml", ROOT / "topologies" / "werewolves-local.yaml"


def werewolves_prompt(model_dir: Path, tokens: int) -> str:
    """About `tokens` tokens of a Werewolves conversation: the rules, then a day's talk over and over."""
    env = Werewolves()
    env.reset(seed=0)
    rules = env.system_prompt(env.agents[0])
    talk = " ".join(f"Player {i}: I watched Player {i % 9 + 1} last night, and I vote them out." for i in range(1, 10))
    tokenizer = load_tokenizer(model_dir)
    text = rules
    while len(tokenizer.encode(text)) < tokens:
        text += "\n" + talk
    return text


def one_step(client: SwarmClient, config: TrainConfig, prompt: str, max_tokens: int) -> None:
    """One group of `num_repeat` episodes, then wait until the learner has stepped."""
    client.auto_sync_train_config_and_start_engine(config)
    for i in range(config.num_repeat):
        with client.episode("werewolves-task") as ep:
            ep.openai().chat.completions.create(model=ep.model, max_tokens=max_tokens,
                                                messages=[{"role": "user", "content": f"{prompt}\nYour vote ({i}):"}])
            ep.reward = float(i % 2)
    deadline = time.monotonic() + 3600
    while client.status().policy_version < 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{client} took no step in an hour")
        time.sleep(0.5)


def measure(topology: Path, model: str, scratch: Path, prompt: str, max_tokens: int, overrides: list[str]) -> dict:
    """Start the topology's trainable servers, step each learner once, read peaks and step times."""
    spec = Topology.load(topology, overrides, check_env=False).spec
    side, servers, learners = topology.stem, [], []
    for name, server in spec.servers.items():
        if not server.trainable:
            continue
        policies = {p: policy.lora for p, policy in server.policies.items()} if server.policies else None
        process = ServerProcess(model=model, admin_token=TOKEN, data_dir=scratch / side / name, device="cpu",
                                log_path=scratch / f"{side}-{name}.log", policies=policies)
        servers.append(process)
        learners += ([(process, p, server.policy_train(p)) for p in server.policies] if server.policies
                     else [(process, None, server.train)])  # fmt: skip
    try:
        for process in servers:
            process.start().wait_healthy(timeout=600)
        for process, policy, config in learners:
            one_step(SwarmClient(process.url, admin_token=TOKEN, policy=policy), config, prompt, max_tokens)
        peaks = [memory_mb(process.proc.pid)["VmHWM"] for process in servers]
    finally:
        for process in servers:
            process.kill()
    steps = {str(path.parent.relative_to(scratch / side)): json.loads(path.read_text().splitlines()[0])["seconds"]
             for path in sorted((scratch / side).rglob("metrics.jsonl"))}  # fmt: skip
    return {"processes": len(servers), "peak_rss_mb": sum(peaks), "step_s": steps, "step_s_total": sum(steps.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=32, help="each reply (the topologies' run.max_tokens)")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model, short episodes")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lora-werewolves-") as tmp:
        scratch, model, overrides = Path(tmp), "smollm2-135m", []
        if args.smoke:
            from tests.tiny_model import build_tiny_model

            model, args.prompt_tokens, args.max_tokens = str(build_tiny_model(scratch / "tiny")), 200, 8
        prompt = werewolves_prompt(resolve_model(model), args.prompt_tokens)
        report = {"model": "tiny" if args.smoke else model, "prompt_tokens": args.prompt_tokens,
                  "lora": measure(LORA, model, scratch, prompt, args.max_tokens, overrides),
                  "full": measure(FULL, model, scratch, prompt, args.max_tokens, overrides)}
    lora, full = report["lora"], report["full"]
    report["peak_ratio"] = lora["peak_rss_mb"] / full["peak_rss_mb"]
    report["step_ratio"] = lora["step_s_total"] / full["step_s_total"] if full["step_s_total"] else None
    print(f"Werewolves' wolves and seer on {report['model']}, one step each on {args.prompt_tokens}-token episodes:")
    print(f"{'':30}{'processes':>10}{'peak RSS MB':>13}  step seconds (per learner)")
    for label, row in (("1 server, 2 LoRA policies", lora), ("2 full-weight servers", full)):
        steps = ", ".join(f"{name} {s:.1f}" for name, s in row["step_s"].items())
        print(f"{label:30}{row['processes']:>10}{row['peak_rss_mb']:>13.0f}  {steps}")
    step = "-" if report["step_ratio"] is None else f"{report['step_ratio']:.2f}x"
    print(f"LoRA / full: peak memory {report['peak_ratio']:.2f}x, training step time {step}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lora_werewolves.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
