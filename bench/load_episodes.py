"""1000 concurrent episodes against one `marl serve` (tiny model, CPU): every end acknowledged, each exactly once.

    python bench/load_episodes.py                      # 1000 episodes at once
    python bench/load_episodes.py --episodes 200       # fewer
    python bench/load_episodes.py --rounds 5           # 5 rounds of 1000 on the same server: does a round slow down?
    python bench/load_episodes.py --smoke              # seconds: 20 episodes (does the bench run?)

Starts a trainable server on a tiny random model (max_leases and batch big enough that every episode runs at once
and no training step interferes), then runs one thread per episode, all released together: begin (SwarmClient,
default settings), one chat completion on the lease (max_tokens 4), end. Reports how many ends were acknowledged,
how many SwarmClient retries happened (transport errors and "wait" answers) and how many ends were answered from
the ledger (`replayed`: a retried end whose first try the server had acted on), checks the ledger holds every
acknowledged episode exactly once and nothing else, and reads the server's resident memory (VmRSS, and its peak
VmHWM) from /proc before and after. Exit code 1 if an end was not acknowledged or the ledger disagrees.
With `--rounds N` the same server plays N such rounds one after the other, and each round's seconds and the RSS after
it are reported: a server that keeps work or memory per finished episode (a prefix cache scanned whole, a table
never pruned) shows it as rounds that grow (`slowest_round_vs_first`).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ADMIN = "load-admin-token"


class RetryCounter(logging.Handler):
    """Counts SwarmClient's retries (it logs each at DEBUG) by call."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "retrying in" in message:
            with self._lock:
                self.counts[message.split(":", 1)[0]] += 1


def memory_mb(pid: int) -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {key: round(int(fields[key].split()[0]) / 1024, 1) for key in ("VmRSS", "VmHWM")}


def run_episodes(url: str, count: int, max_tokens: int) -> dict:
    from marl import SwarmClient
    from marl.client import connection_limits

    client = SwarmClient(url, ADMIN)  # SwarmClient's defaults: timeout 30 s, max_wait_s 600 s
    chat = httpx.Client(timeout=600, limits=connection_limits(count))  # pooled as SwarmClient pools its own
    start = threading.Barrier(count)
    results: list[tuple[str, str, bool]] = []  # (episode id, outcome, replayed)
    phases: dict[str, list[float]] = {"begin": [], "call": [], "end": []}  # seconds each step of each episode took
    lock = threading.Lock()

    def timed(phase: str, started: float) -> float:
        now = time.monotonic()
        with lock:
            phases[phase].append(now - started)
        return now

    def episode(i: int) -> None:
        start.wait()
        episode_id, outcome, replayed = "", "begin failed", False
        try:
            at = time.monotonic()
            episode_id, lease = client.begin_episode()
            at = timed("begin", at)
            outcome = "call failed"
            r = chat.post(lease.base_url + "/chat/completions", headers={"Authorization": f"Bearer {lease.api_key}"},
                          json={"model": lease.model, "max_tokens": max_tokens,
                                "messages": [{"role": "user", "content": f"Episode {i}: say yes."}]})
            r.raise_for_status()
            at = timed("call", at)
            outcome = "end failed"
            replayed = client.end_episode(f"task-{i % 50}", episode_id, float(i % 2)).replayed
            timed("end", at)
            outcome = "acknowledged"
        except Exception as exc:  # noqa: BLE001 - counted and reported, not raised
            outcome = f"{outcome}: {type(exc).__name__}: {str(exc)[:200]}"
        with lock:
            results.append((episode_id, outcome, replayed))

    threads = [threading.Thread(target=episode, args=(i,), name=f"episode-{i}") for i in range(count)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.monotonic() - started
    client.close()
    chat.close()
    outcomes = collections.Counter(outcome.split(":")[0] for _, outcome, _ in results)
    return {"seconds": round(seconds, 1), "outcomes": dict(outcomes),
            "errors": [o for _, o, _ in results if o != "acknowledged"][:10],
            "acknowledged": [eid for eid, outcome, _ in results if outcome == "acknowledged"],
            "replayed_ends": sum(replayed for _, _, replayed in results),
            "phase_seconds": {phase: _spread(times) for phase, times in phases.items()}}


def _spread(times: list[float]) -> dict[str, float]:
    """p50, p99 and max of one step's seconds over a round's episodes: a round lasts as long as its slowest."""
    ordered = sorted(times) or [float("nan")]
    return {q: round(ordered[min(len(ordered) - 1, int(f * len(ordered)))], 2)
            for q, f in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))}


def run_rounds(proc, args) -> dict:
    """`args.rounds` rounds of `run_episodes` on one server: the first round's report, with the outcomes, errors and
    acknowledged ids of all, and each round's seconds and RSS after it."""
    rounds = []
    for _ in range(args.rounds):
        rounds.append(run_episodes(proc.url, args.episodes, args.max_tokens))
        rounds[-1]["rss_mb"] = memory_mb(proc.proc.pid)["VmRSS"]
        spread = rounds[-1]["phase_seconds"]
        steps = ", ".join(f"{phase} {t['p50']}/{t['p99']}/{t['max']}" for phase, t in spread.items())
        print(f"round {len(rounds)}: {rounds[-1]['seconds']} s, RSS {rounds[-1]['rss_mb']} MB; seconds p50/p99/max:"
              f" {steps}", flush=True)
    report = dict(rounds[0])
    report.update(outcomes=dict(sum((collections.Counter(r["outcomes"]) for r in rounds), collections.Counter())),
                  errors=[e for r in rounds for e in r["errors"]][:10],
                  acknowledged=[eid for r in rounds for eid in r["acknowledged"]],
                  replayed_ends=sum(r["replayed_ends"] for r in rounds))
    if args.rounds > 1:
        seconds = [r["seconds"] for r in rounds]
        report.update(round_seconds=seconds, round_rss_mb=[r["rss_mb"] for r in rounds],
                      round_phase_seconds=[r["phase_seconds"] for r in rounds],
                      slowest_round_vs_first=round(max(seconds) / seconds[0], 2))
    return report


def ledger_check(data_dir: Path, acknowledged: list[str]) -> dict:
    db = sqlite3.connect(f"file:{data_dir / 'ledger.sqlite'}?mode=ro", uri=True)
    try:
        counts = dict(db.execute("SELECT episode_id, COUNT(*) FROM episodes GROUP BY episode_id").fetchall())
    finally:
        db.close()
    return {"episodes_in_ledger": len(counts),
            "acknowledged_exactly_once": sum(counts.get(eid) == 1 for eid in acknowledged),
            "acknowledged_missing": sum(eid not in counts for eid in acknowledged),
            "recorded_twice": sum(n > 1 for n in counts.values()),
            "recorded_but_not_acknowledged": len(set(counts) - set(acknowledged))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="rounds of --episodes on the same server")
    parser.add_argument("--smoke", action="store_true", help="a few seconds: does the bench run?")
    args = parser.parse_args()
    if args.smoke:
        args.episodes = 20
    from marl import SwarmClient
    from marl.launch import ServerProcess
    from servers.tiny_model import build_tiny_model

    retries = RetryCounter()
    logging.getLogger("marl.client").addHandler(retries)
    logging.getLogger("marl.client").setLevel(logging.DEBUG)
    with tempfile.TemporaryDirectory(prefix="marl-load-") as scratch:
        root = Path(scratch)
        proc = ServerProcess(model=str(build_tiny_model(root / "tiny")), admin_token=ADMIN, data_dir=root / "server",
                             device="cpu", served_name="tiny", log_path=root / "server.log").start()
        try:
            proc.wait_healthy(timeout=120)
            with SwarmClient(proc.url, ADMIN) as admin:
                admin.auto_sync_train_config_and_start_engine(
                    {"batch_size": 10**6, "num_repeat": 4, "max_leases": args.episodes, "save_freq": 0})
            before = memory_mb(proc.proc.pid)
            report = run_rounds(proc, args)
            after = memory_mb(proc.proc.pid)
        finally:
            proc.kill()
        report.update(ledger_check(root / "server", report.pop("acknowledged")))
    report.update(episodes=args.episodes, client_retries=dict(retries.counts),
                  server_rss_mb={"before": before["VmRSS"], "after": after["VmRSS"], "peak": after["VmHWM"]})
    print(json.dumps(report, indent=2))
    total = args.episodes * args.rounds
    ok = report["outcomes"].get("acknowledged", 0) == total and report["recorded_twice"] == 0 and \
        report["acknowledged_exactly_once"] == total
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
