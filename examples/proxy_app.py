"""Train SmolLM2-135M on an app's traffic through `marl proxy`, on a laptop CPU.

    python examples/proxy_app.py                   # starts `marl serve --model smollm2-135m` and the proxy itself
    python examples/proxy_app.py --url URL         # or uses a running server (admin token: $MARL_ADMIN_TOKEN)

The "app" is a script that asks short questions through the unmodified openai SDK, as any app would, at the proxy's
URL with the proxy's own API key. It knows nothing of training. Behind the proxy, every question is answered
`--num-repeat` times by SmolLM2, the built-in `rule` reward (max_words=1: 1.0 for a one-word answer, 1/words
otherwise) scores the answers against each other, the episodes become a GRPO group on the swarm server, and the
best answer goes back to the app. Every `batch_size` questions make a training step.

The reward is read back from the proxy's /metrics (`marl_proxy_candidate_reward` per policy version: every
candidate, i.e. what the model does before the proxy picks the best) and printed per policy version; the curve is
written to runs/proxy_app/curve.json.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from marl import ADMIN_TOKEN_ENV, TrainConfig

QUESTIONS = [
    "What color is the sky on a clear day?", "Which animal says moo?", "What is the opposite of hot?",
    "Name a fruit that is yellow.", "What do bees make?", "Which planet do we live on?",
    "What is frozen water called?", "What color is grass?", "Which season comes after winter?",
    "What do you call a baby dog?", "What is the capital of France?", "Which animal has a trunk?",
    "How many legs does a spider have?", "What is the largest ocean?", "What shape is a ball?",
    "Which bird is a symbol of peace?", "What do cows drink?", "What gas do plants breathe in?",
    "Which metal is liquid at room temperature?", "What do you use to write on a blackboard?",
]
SYSTEM = "Answer the question in exactly one word."
PROXY_KEY_ENV = "MARL_PROXY_API_KEY"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    log = open(log_path, "ab")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})


def wait_healthy(url: str, process: subprocess.Popen, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{what} exited with code {process.returncode}; see its log")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"{what} did not come up within {timeout_s:.0f}s; see its log")


def proxy_command(args: argparse.Namespace, port: int) -> list[str]:
    """`marl proxy` (as `python -m marl.proxy`) on `port`, with the train config it syncs."""
    config = TrainConfig(job="proxy-app", batch_size=args.batch_size, num_repeat=args.num_repeat,
                         grpo={"learning_rate": args.learning_rate}, save_freq=0, lease_patience_s=900)
    return [sys.executable, "-m", "marl.proxy", "--server", args.url, "--port", str(port),
            "--reward", "rule", "--reward-option", "max_words=1", "--num-repeat", str(args.num_repeat),
            "--conversation-idle-s", "0", "--max-wait-s", "900",
            "--train-config", config.model_dump_json(exclude_unset=True)]


def start_proxy(args: argparse.Namespace, run_dir: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """`marl proxy`: syncs the config, starts the engine, serves the app."""
    port = free_port()
    proxy = start(proxy_command(args, port), run_dir / "proxy.log", env)
    print(f"started the proxy on port {port} (log: {run_dir / 'proxy.log'}); it boots the engine first (the first"
          " run converts SmolLM2: about a minute)", flush=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proxy, "the proxy", timeout_s=1800)
    return proxy, url


def ask(app: openai.OpenAI, question: str, max_tokens: int) -> str:
    """What the app does: one chat completion, as with any OpenAI endpoint."""
    reply = app.chat.completions.create(model="smollm2", max_tokens=max_tokens, temperature=1.0,
                                        messages=[{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": question}])
    return reply.choices[0].message.content or ""


def rewards_by_version(proxy_url: str) -> dict[int, dict[str, float]]:
    """{policy version: {"candidates": n, "candidate": mean reward, "returned": mean reward}} from /metrics."""
    curve: dict[int, dict[str, float]] = {}
    text = httpx.get(proxy_url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name not in ("marl_proxy_candidate_reward", "marl_proxy_returned_reward"):
            continue
        which = family.name.split("_")[2]
        for sample in family.samples:
            point = curve.setdefault(int(sample.labels["policy_version"]), {})
            point[f"{which}_{sample.name.rsplit('_', 1)[1]}"] = sample.value
    return {v: {"candidates": p["candidate_count"], "candidate": p["candidate_sum"] / p["candidate_count"],
                "returned": p["returned_sum"] / p["returned_count"]} for v, p in sorted(curve.items())}


def drive(app: openai.OpenAI, proxy_url: str, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """Ask `--prompts` questions, `batch_size` at a time (one training step each), printing the reward as it goes."""
    start_time = time.monotonic()
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.prompts)]
    with ThreadPoolExecutor(args.batch_size) as pool:
        for first in range(0, len(questions), args.batch_size):
            wave = questions[first:first + args.batch_size]
            answers = list(pool.map(lambda q: ask(app, q, args.max_tokens), wave))
            curve = rewards_by_version(proxy_url)
            version = max(curve)
            print(f"questions {first + 1:3d}-{first + len(wave):3d}  version {version:3d}  candidate reward"
                  f" {curve[version]['candidate']:.3f}  returned {curve[version]['returned']:.3f}"
                  f"  {time.monotonic() - start_time:5.0f}s  e.g. {wave[0]!r} -> {answers[0][:40]!r}", flush=True)
    return rewards_by_version(proxy_url)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running swarm server (default: start one)")
    parser.add_argument("--prompts", type=int, default=48, help="questions the app asks")
    parser.add_argument("--batch-size", type=int, default=4, help="questions per training step")
    parser.add_argument("--num-repeat", type=int, default=4, help="candidates per question")
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--run-dir", default="runs/proxy_app")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()

    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {ADMIN_TOKEN_ENV: os.environ.get(ADMIN_TOKEN_ENV) or "proxy-app-demo",
           PROXY_KEY_ENV: f"app-{secrets.token_urlsafe(16)}"}  # the app's key: not the admin token
    processes = []
    try:
        if args.url is None:
            port = free_port()
            processes.append(start([sys.executable, "-m", "marl.cli", "serve", "--model", "smollm2-135m", "--port",
                                    str(port), "--data-dir", str(run_dir / "server")], run_dir / "server.log", env))
            args.url = f"http://127.0.0.1:{port}"
            wait_healthy(args.url, processes[0], "marl serve", timeout_s=300)
        proxy, proxy_url = start_proxy(args, run_dir, env)
        processes.append(proxy)
        app = openai.OpenAI(base_url=proxy_url + "/v1", api_key=env[PROXY_KEY_ENV], timeout=1800)
        curve = drive(app, proxy_url, args)
    finally:
        for process in reversed(processes):  # the proxy first: it ends what it holds, then the server stops
            process.terminate()
            process.wait(timeout=60)
    (run_dir / "curve.json").write_text(json.dumps(curve, indent=1))
    print("\npolicy version  candidates  mean candidate reward  mean returned reward")
    for version, point in curve.items():
        print(f"{version:14d}  {point['candidates']:10.0f}  {point['candidate']:21.3f}  {point['returned']:20.3f}")


if __name__ == "__main__":
    main()
