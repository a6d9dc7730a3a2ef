"""What does `marl proxy` add to a request's latency, for N=1, against calling a lease directly?

Starts, on this machine, `marl serve` on a tiny random model (CPU) and `marl proxy` in front of it (N=1, rule reward,
no held conversations), then times, one request at a time and interleaved so that drift hits all paths alike:

  lease    a chat call on a lease begun beforehand (begin and abort untimed): the floor
  episode  begin + the same call + end, all timed: what a `SwarmClient` script pays per episode
  proxy    the same request to the proxy, which begins, calls, scores, answers, and ends after answering

    python bench/proxy_latency.py [--requests 300] [--max-tokens 1]
    python bench/proxy_latency.py --smoke      # seconds: 5 requests per path after 2 warm-ups (does it run?)

Reports the median and p90 of each, and the proxy's added latency over `lease` and over `episode`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from marl import SwarmClient  # noqa: E402  (after the path is set)
from marl.runner.launch import free_port  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402

ADMIN = "bench-admin-token"
APP_KEY = "bench-app-key"
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def start(command: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "MARL_ADMIN_TOKEN": ADMIN, "MARL_PROXY_API_KEY": APP_KEY}
    return subprocess.Popen(command, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, cwd=REPO)


def wait_healthy(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not come up")


def timed(call: Callable[[], None]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(client: SwarmClient, proxy: httpx.Client, requests: int, max_tokens: int,
            warmup: int) -> dict[str, list[float]]:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": max_tokens}
    times: dict[str, list[float]] = {"lease": [], "episode": [], "proxy": []}
    direct = httpx.Client(timeout=60)  # keep-alive, as the proxy's own connections are

    def chat(lease) -> None:
        response = direct.post(lease.base_url + "/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {lease.api_key}"})
        response.raise_for_status()

    def episode() -> None:
        episode_id, lease = client.begin_episode()
        chat(lease)
        client.end_episode("bench", episode_id, 0.0)

    def via_proxy() -> None:
        proxy.post("/v1/chat/completions", json=body).raise_for_status()

    for i in range(warmup + requests):
        episode_id, lease = client.begin_episode()
        lease_s = timed(lambda lease=lease: chat(lease))
        client.abort_episode(episode_id)
        sample = {"lease": lease_s, "episode": timed(episode), "proxy": timed(via_proxy)}
        if i >= warmup:
            for path, seconds in sample.items():
                times[path].append(seconds)
    direct.close()
    return times


def report(times: dict[str, list[float]]) -> None:
    def p90(values: list[float]) -> float:
        return statistics.quantiles(values, n=10)[-1]

    print(f"{'path':8s} {'median ms':>10s} {'p90 ms':>8s}")
    for path, values in times.items():
        print(f"{path:8s} {statistics.median(values) * 1e3:10.2f} {p90(values) * 1e3:8.2f}")
    for base in ("lease", "episode"):
        added = [p - b for p, b in zip(times["proxy"], times[base])]
        print(f"proxy - {base:7s}: median {statistics.median(added) * 1e3:+.2f} ms, p90 {p90(added) * 1e3:+.2f} ms"
              " (paired per iteration)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=20, help="untimed iterations first")
    parser.add_argument("--smoke", action="store_true", help="a few seconds: does the bench run?")
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.warmup = 5, 2
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = build_tiny_model(tmp / "model")
        server_port, proxy_port = free_port(), free_port()
        server_url, proxy_url = f"http://127.0.0.1:{server_port}", f"http://127.0.0.1:{proxy_port}"
        processes = [start([sys.executable, "-m", "marl.cli", "serve", "--model", str(model), "--port",
                            str(server_port), "--device", "cpu", "--served-model-name", "tiny", "--data-dir",
                            str(tmp / "server"), "--log-level", "warning"], tmp / "server.log")]
        try:
            wait_healthy(server_url)
            client = SwarmClient(server_url, admin_token=ADMIN)
            client.auto_sync_train_config_and_start_engine({"batch_size": 100_000, "num_repeat": 1, "save_freq": 0})
            processes.append(start([sys.executable, "-m", "marl.proxy", "--server", server_url, "--port",
                                    str(proxy_port), "--num-repeat", "1", "--reward", "rule", "--reward-option",
                                    "min_words=1", "--conversation-idle-s", "0", "--log-level", "warning"],
                                   tmp / "proxy.log"))
            wait_healthy(proxy_url)
            with httpx.Client(base_url=proxy_url, headers={"Authorization": f"Bearer {APP_KEY}"}, timeout=60) as proxy:
                times = measure(client, proxy, args.requests, args.max_tokens, args.warmup)
        finally:
            for process in reversed(processes):
                process.terminate()
                process.wait(timeout=30)
            if args.smoke:  # the servers' own errors (a failed shutdown, say) are part of what a smoke run checks
                for log in ("server.log", "proxy.log"):
                    print(f"--- {log}\n{(tmp / log).read_text(errors='replace').strip()}")
    print(f"{args.requests} requests per path, N=1, max_tokens={args.max_tokens}, tiny model on CPU")
    report(times)


if __name__ == "__main__":
    main()
