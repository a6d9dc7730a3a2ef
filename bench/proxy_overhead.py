"""What does the swarm server's data plane cost on top of a bare HTTP endpoint?

Runs, in one go and on the same machine:
  1. a bare FastAPI app that parses a chat request and returns a fixed chat completion (the floor: uvicorn + JSON);
  2. the real swarm server (lease auth, chat template, recording, the OpenAI reply) with a zero-work engine that
     "generates" one token instantly, so only the proxy's own work is measured;
and reports requests/s and p50/p99 latency for each under the same closed-loop load (N concurrent clients).

    python bench/proxy_overhead.py [--requests 2000] [--concurrency 16]
    python bench/proxy_overhead.py --smoke      # seconds: 40 requests, 4 clients (does the bench run?)

Each server runs in its own process; the load generator (httpx, asyncio) runs here.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from marl.protocol import ChatCompletionRequest  # noqa: E402  (after the path is set)
from servers.backends import Trainer  # noqa: E402

ADMIN = "bench-admin"
REQUEST = {"model": "tiny", "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 1}


# --- the two servers (run in subprocesses) ----------------------------------------------------------------------


def serve_bare(port: int) -> None:
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> dict:
        return {"id": "x", "object": "chat.completion", "created": 0, "model": body.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "5"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def serve_marl(port: int, model_dir: str, data_dir: str) -> None:
    import uvicorn
    from transformers import AutoTokenizer

    from servers.backends import GenerationChunk, InferenceEngine
    from servers.entrypoint import ServeOptions, build_app

    class ZeroWorkEngine(InferenceEngine):
        """Answers every prompt with one token, instantly: the benchmark measures the proxy, not a model."""

        def __init__(self, directory: Path):
            self.tokenizer = AutoTokenizer.from_pretrained(directory)
            self.context_length = 2048
            self.eos_token_ids = frozenset({self.tokenizer.eos_token_id})
            self.token = self.tokenizer.encode("5", add_special_tokens=False)[0]

        async def generate(self, prompt_ids, params):
            yield GenerationChunk([self.token], [-0.5], "length")

    options = ServeOptions(model=model_dir, port=port, admin_token=ADMIN, data_dir=Path(data_dir),
                           served_model_name="tiny")
    app = build_app(options, engine_factory=ZeroWorkEngine, trainer_factory=lambda model, config: _NoTrainer())
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


class _NoTrainer(Trainer):
    """Never trains (the benchmark's batch never fills); boots like a fresh trainer, closes like one."""

    step_count = 0

    def step(self, batch):
        raise RuntimeError("the benchmark's batch never fills: no step")

    def export_weights(self, directory):
        raise RuntimeError("never trained: no weights to export")

    def save(self, directory) -> None:
        raise RuntimeError("never trained: nothing to save")

    def load(self, directory) -> None:
        pass


# --- load generation ---------------------------------------------------------------------------------------------


async def load(url: str, auth_for, requests: int, concurrency: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    remaining = iter(range(requests))
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=concurrency)) as http:

        async def worker(worker_id: int) -> None:
            for i in remaining:
                headers = await auth_for(http, worker_id, i)
                start = time.perf_counter()
                r = await http.post("/v1/chat/completions", json=REQUEST, headers=headers)
                latencies.append(time.perf_counter() - start)
                r.raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        return time.perf_counter() - start, latencies


def wait_healthy(url: str, path: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=1).status_code < 500:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(name: str, elapsed: float, latencies: list[float]) -> dict:
    q = statistics.quantiles(latencies, n=100)
    row = {"name": name, "rps": len(latencies) / elapsed, "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3}
    print(f"{name:<28} {row['rps']:>9.0f} req/s   p50 {row['p50_ms']:>7.2f} ms   p99 {row['p99_ms']:>7.2f} ms")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--calls-per-lease", type=int, default=20, help="calls an agent makes per episode")
    parser.add_argument("--smoke", action="store_true", help="a few seconds: does the bench run?")
    parser.add_argument("--serve", choices=["bare", "marl"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.concurrency, args.calls_per_lease = 40, 4, 5
    if args.serve == "bare":
        return serve_bare(args.port)
    if args.serve == "marl":
        return serve_marl(args.port, args.model_dir, args.data_dir)

    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model")
        print(f"{args.requests} requests, {args.concurrency} concurrent clients, one process per server\n")
        rows = []
        for kind in ("bare", "marl"):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port),
                                     "--model-dir", str(model_dir), "--data-dir", f"{tmp}/data"])
            try:
                wait_healthy(url, "/health" if kind == "marl" else "/docs")
                auth_for = no_auth
                if kind == "marl":
                    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
                    admin.post("/control/config", json={"max_leases": 10_000, "batch_size": 10_000}).raise_for_status()
                    admin.post("/control/start").raise_for_status()
                    while (status := admin.get("/control/status").json())["state"] != "ROLLING":
                        if status["last_error"]:
                            raise RuntimeError(f"the marl server failed to start: {status['last_error']}")
                        time.sleep(0.1)
                    auth_for = lease_auth(args.calls_per_lease)
                asyncio.run(load(url, auth_for, args.concurrency * 5, args.concurrency))  # warm-up
                elapsed, latencies = asyncio.run(load(url, auth_for, args.requests, args.concurrency))
                label = "bare FastAPI echo" if kind == "bare" else "marl data plane (zero-work)"
                rows.append(report(label, elapsed, latencies))
            finally:
                proc.terminate()
                proc.wait(timeout=20)
        bare, marl = rows
        print(f"\nmarl / bare: throughput {marl['rps'] / bare['rps']:.2f}x,"
              f" p50 latency {marl['p50_ms'] / bare['p50_ms']:.2f}x,"
              f" p99 latency {marl['p99_ms'] / bare['p99_ms']:.2f}x")


async def no_auth(http, worker_id, i) -> dict:
    return {}


def lease_auth(calls_per_lease: int):
    """Each client works like an agent: a lease per episode, `calls_per_lease` calls in it, then end."""
    leases: dict[int, tuple[str, str, int]] = {}
    admin = {"Authorization": f"Bearer {ADMIN}"}

    async def auth_for(http: httpx.AsyncClient, worker_id: int, i: int) -> dict:
        held = leases.get(worker_id)
        if held and held[2] >= calls_per_lease:
            await http.post(f"/episodes/{held[0]}/end", headers=admin,
                            json={"client_id": "bench", "task_id": f"t{worker_id}", "reward": 1.0})
            held = None
        if held is None:
            lease = (await http.post("/episodes/begin", headers=admin, json={"client_id": "bench"})).json()
            held = (lease["episode_id"], lease["api_key"], 0)
        leases[worker_id] = (held[0], held[1], held[2] + 1)
        return {"Authorization": f"Bearer {held[1]}"}

    return auth_for


if __name__ == "__main__":
    main()
