"""What does committing one game cost the coordinator? Per-game commit timing on real tiny-model servers.

Two trainable swarm servers (the tiny random model on the CPU, built as `marl serve` builds them) on 127.0.0.1, and
N games of each kind, each episode holding one real chat call:
  1. a game across both servers, committed as the coordinator commits it: the two-phase commit
     (`marl.transaction.two_phase.commit_game`: prepare on both, the decision fsynced, commit on both) on the
     coordinator's one executor;
  2. a game on one server, ended with `end` (`SwarmClient.end_episode`).
Only the commit is timed (not the begins, not the calls). Prints the median and p90 milliseconds per commit. The batch
never fills, so no training step runs meanwhile; the pool grows by one episode per game, as in a run between steps.

    python bench/commit_timing.py [--games 200] [--processes]
    python bench/commit_timing.py --smoke          # a few games: checks that the bench runs (seconds)

Servers run in this process (uvicorn threads, as tests/conftest.py's LocalServer) unless `--processes` starts each
as a `marl serve` subprocess (slower to start; no GIL shared with the timing thread).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from marl.client import SwarmClient  # noqa: E402  (after the path is set)
from marl.transaction.decision_log import DecisionLog  # noqa: E402
from marl.transaction.two_phase import Part, commit_game  # noqa: E402

ADMIN = "bench-admin"
CONFIG = {"batch_size": 100_000, "num_repeat": 2, "max_leases": 1_000, "save_freq": 0}  # never trains
TASKS = 16  # task ids cycle through this many GRPO groups


# --- servers ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def in_process_server(model_dir: Path, data_dir: Path) -> Iterator[str]:
    """A server built as `marl serve` builds it, served by uvicorn in a thread of this process; yields its URL."""
    import uvicorn

    from marl.runner.launch import free_port
    from servers.entrypoint import ServeOptions, build_server
    from servers.http.routes import create_app

    port = free_port()
    options = ServeOptions(model=str(model_dir), port=port, admin_token=ADMIN, data_dir=data_dir,
                           served_model_name="tiny", device="cpu")
    server, token = build_server(options)
    uv = uvicorn.Server(uvicorn.Config(create_app(server, token), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=15)


@contextlib.contextmanager
def process_server(model_dir: Path, data_dir: Path) -> Iterator[str]:
    """`marl serve` as a subprocess; yields its URL."""
    from marl.runner.launch import ServerProcess

    proc = ServerProcess(model=str(model_dir), admin_token=ADMIN, data_dir=data_dir, device="cpu", served_name="tiny",
                         log_path=data_dir.parent / f"{data_dir.name}.log").start()
    try:
        proc.wait_healthy(timeout=120)
        yield proc.url
    finally:
        proc.kill()


# --- games -----------------------------------------------------------------------------------------------------------


def played(client: SwarmClient) -> str:
    """A leased episode with one real chat call in it; its id."""
    episode_id, lease = client.begin_episode()
    oai = client.openai_client(lease, agent="player", max_retries=0)
    oai.chat.completions.create(model=lease.model, messages=[{"role": "user", "content": "Pick a number."}],
                                max_tokens=2)
    return episode_id


def two_server_commits(clients: list[SwarmClient], decisions: DecisionLog, io: ThreadPoolExecutor,
                       games: int, warmup: int) -> list[float]:
    """Milliseconds of each game's two-phase commit across `clients` (after the warm-up games)."""
    times = []
    for game in range(warmup + games):
        parts = {f"s{i}": Part(client, f"task-{game % TASKS}", played(client), 1.0) for i, client in enumerate(clients)}
        start = time.perf_counter()
        outcome = commit_game(decisions, f"game-{game}", parts, io=io)  # as the coordinator commits a game
        elapsed_ms = (time.perf_counter() - start) * 1e3
        assert outcome.committed, outcome.prepare_errors
        if game >= warmup:
            times.append(elapsed_ms)
    return times


def one_server_ends(client: SwarmClient, games: int, warmup: int) -> list[float]:
    """Milliseconds of each game's `end` on one server (after the warm-up games)."""
    times = []
    for game in range(warmup + games):
        episode_id = played(client)
        start = time.perf_counter()
        client.end_episode(f"task-{game % TASKS}", episode_id, 1.0, timeout=60)
        if game >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def report(what: str, times: list[float]) -> None:
    p90 = statistics.quantiles(times, n=10)[-1] if len(times) >= 2 else times[0]
    print(f"{what:<34} {len(times):>4} games   median {statistics.median(times):7.2f} ms   p90 {p90:7.2f} ms",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", type=int, default=200, help="timed games of each kind")
    parser.add_argument("--warmup", type=int, default=5, help="games of each kind played first, not timed")
    parser.add_argument("--processes", action="store_true", help="servers as `marl serve` subprocesses")
    parser.add_argument("--smoke", action="store_true", help="3 games of each kind: checks that the bench runs")
    args = parser.parse_args()
    games, warmup = (3, 1) if args.smoke else (args.games, args.warmup)
    serve = process_server if args.processes else in_process_server

    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model_dir = build_tiny_model(Path(tmp) / "model")
        urls = [stack.enter_context(serve(model_dir, Path(tmp) / f"server-{i}")) for i in range(2)]
        clients = [stack.enter_context(SwarmClient(url, ADMIN)) for url in urls]
        for client in clients:  # one boot at a time: two model loads in one process at once can trip transformers
            client.auto_sync_train_config_and_start_engine(CONFIG)
        decisions = DecisionLog(Path(tmp) / "decisions.sqlite")
        io = stack.enter_context(ThreadPoolExecutor(16, thread_name_prefix="coordinator-io"))
        where = "as processes" if args.processes else "in this process"
        print(f"{games} games of each kind after {warmup} untimed; servers {where}")
        report("two-phase commit, 2 servers", two_server_commits(clients, decisions, io, games, warmup))
        report("end, 1 server", one_server_ends(clients[0], games, warmup))
        decisions.close()


if __name__ == "__main__":
    main()
