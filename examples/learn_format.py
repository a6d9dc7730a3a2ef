"""Teach SmolLM2-135M to answer in exactly one word, over the swarm server's HTTP path, on a laptop CPU.

    python examples/learn_format.py                 # starts `marl serve --model smollm2-135m` itself
    python examples/learn_format.py --url URL       # or uses a running server (admin token: $MARL_ADMIN_TOKEN)

Reward: 1 / (number of words in the reply), so "Blue." scores 1.0 and "The sky is blue." 0.25. Each training
step is `batch_size` questions x `num_repeat` answers (GRPO groups). The reward curve is printed per policy version
and written to runs/learn_format/curve.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from marl import ADMIN_TOKEN_ENV, SwarmClient, TrainConfig

QUESTIONS = [
    "What color is the sky on a clear day?", "Which animal says moo?", "What is the opposite of hot?",
    "Name a fruit that is yellow.", "What do bees make?", "Which planet do we live on?",
    "What is frozen water called?", "What color is grass?", "Which season comes after winter?",
    "What do you call a baby dog?", "What is the capital of France?", "Which animal has a trunk?",
    "What do cows drink?", "How many legs does a spider have?", "What is the largest ocean?",
    "What gas do plants breathe in?", "Which metal is liquid at room temperature?", "What shape is a ball?",
    "What do you use to write on a blackboard?", "Which bird is a symbol of peace?",
]
SYSTEM = "Answer the question in exactly one word."


def reward(reply: str) -> float:
    words = re.findall(r"[A-Za-z0-9']+", reply)
    return 1.0 / len(words) if words else 0.0


def play(client: SwarmClient, question: str, max_tokens: int) -> float:
    with client.episode(question) as ep:
        reply = ep.openai(agent="answerer").chat.completions.create(
            model=ep.model, max_tokens=max_tokens, temperature=1.0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
        ep.reward = reward(reply.choices[0].message.content or "")
    return ep.reward


def start_server(run_dir: Path, token: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(run_dir / "server.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "marl.cli", "serve", "--model", "smollm2-135m", "--port", str(port),
         "--admin-token", token, "--data-dir", str(run_dir / "server")],
        stdout=log, stderr=subprocess.STDOUT)
    print(f"started marl serve on port {port} (log: {run_dir / 'server.log'})", flush=True)
    return proc, f"http://127.0.0.1:{port}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running swarm server (default: start one)")
    parser.add_argument("--steps", type=int, default=24, help="training steps to run")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-repeat", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--run-dir", default="runs/learn_format")
    return parser.parse_args(argv)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """What the server trains: `batch_size` questions x `num_repeat` answers a step, a checkpoint every 8 steps."""
    return TrainConfig(job="learn-format", batch_size=args.batch_size, num_repeat=args.num_repeat,
                       grpo={"learning_rate": args.learning_rate}, save_freq=8)


def main() -> None:
    args = parse_args()
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    token = os.environ.get(ADMIN_TOKEN_ENV) or "learn-format-demo"
    proc = None
    if args.url is None:
        proc, args.url = start_server(run_dir, token)
    try:
        with SwarmClient(args.url, admin_token=token, max_wait_s=1800) as client:
            print("syncing config and starting the engine (the first run converts SmolLM2: about a minute)...",
                  flush=True)
            client.auto_sync_train_config_and_start_engine(train_config(args))
            curve = train(client, args)
        (run_dir / "curve.json").write_text(json.dumps(curve, indent=1))
        first, last = curve[0]["reward"], sum(p["reward"] for p in curve[-3:]) / len(curve[-3:])
        print(f"\nmean reward: first step {first:.3f}, last three steps {last:.3f};"
              f" {curve[-1]['seconds']:.0f}s in all. Curve: {run_dir / 'curve.json'}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


def train(client: SwarmClient, args: argparse.Namespace) -> list[dict]:
    """Play one batch of episodes per policy version; print and return the reward curve."""
    rng = random.Random(0)
    curve: list[dict] = []
    start = time.monotonic()
    episodes = args.batch_size * args.num_repeat
    with ThreadPoolExecutor(episodes) as pool:
        for step in range(args.steps):
            version = client.status().policy_version
            questions = [q for q in rng.sample(QUESTIONS, args.batch_size) for _ in range(args.num_repeat)]
            rewards = list(pool.map(lambda q: play(client, q, args.max_tokens), questions))
            while client.status().policy_version == version:  # the server trains on this batch, then rolls on
                time.sleep(0.5)
            point = {"step": step, "policy_version": version, "reward": sum(rewards) / len(rewards),
                     "seconds": time.monotonic() - start}
            curve.append(point)
            bar = "#" * round(point["reward"] * 40)
            print(f"step {step:3d}  version {version:3d}  reward {point['reward']:.3f}  {bar:<40}"
                  f"  {point['seconds']:6.0f}s", flush=True)
    return curve


if __name__ == "__main__":
    main()
