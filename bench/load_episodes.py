"""1000 concurrent episodes against one `marl serve` (tiny model, CPU): every end acknowledged, each exactly once.

    python bench/load_episodes.py                      # 1000 episodes at once
    python bench/load_episodes.py --episodes 200       # fewer
    python bench/load_episodes.py --rounds 5           # 5 rounds of 1000 on the same server: does a round slow down?
    python bench/load_episodes.py --rounds 5 --lockstep   # the same, each step of a round a burst of its own
    python bench/load_episodes.py --smoke              # seconds: 20 episodes (does the bench run?)

Starts a trainable server on a tiny random model (max_leases and batch big enough that every episode runs at once
and no training step interferes), then runs one thread per episode, all released together: begin (a SwarmClient per
50 episodes, default settings), one chat completion on the lease (max_tokens 4), end. Reports how many ends were
acknowledged, how many SwarmClient retries happened (transport errors and "wait" answers) and how many ends were
answered from the ledger (`replayed`: a retried end whose first try the server had acted on), checks the ledger
holds every acknowledged episode exactly once and nothing else, and reads the server's resident memory (VmRSS, and
its peak VmHWM) from /proc before and after. Exit code 1 if an end was not acknowledged or the ledger disagrees.
With `--rounds N` the same server plays N such rounds one after the other, and each round's seconds (from the
release of its threads, all started and waiting, to the last one's end; with `--lockstep` the sum of its three
bursts') and the RSS after it are reported: a server that keeps work or memory per finished episode (a prefix cache
scanned whole, a table never pruned) shows it as rounds that grow (`slowest_round_vs_first`). Without `--lockstep`
an episode calls as soon as its own begin is answered, so how 1,000 threads happen to interleave on the machine's
cores decides what overlaps what; `--lockstep` joins every step's threads before the next step starts, so each round
asks the server the same thing in the same order.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import logging
import sqlite3
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

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


def run_episodes(url: str, count: int, max_tokens: int, lockstep: bool = False) -> dict:
    """`count` episodes at once, one thread each. With `lockstep` every step is a burst of its own: all begins, then
    all calls, then all ends (the threads of one step joined before the next starts).

    Begins and ends go through SwarmClients, as a coordinator's would, one per `EPISODES_PER_CLIENT` episodes: a
    SwarmClient pools at most 100 connections, and 1,000 threads queued on one pool were this bench's own limit
    (begins and ends 8-9 s at the median, 22-26 s at p99, rounds 11.5-28.9 s). Each chat call opens a connection
    of its own (the standard library's `http.client`): one httpx client shared by 1,000 threads was also this
    bench's limit, 27-48 s per call at the median while the server spent at most 0.4 s on any (its `Server-Timing`).
    """
    from marl import SwarmClient

    # SwarmClient's defaults: timeout 30 s, max_wait_s 600 s
    clients = [SwarmClient(url, ADMIN) for _ in range(-(-count // EPISODES_PER_CLIENT))]
    episodes = [_Episode(i) for i in range(count)]
    phases: dict[str, list[float]] = {"begin": [], "call": [], "end": []}  # seconds each step of each episode took
    steps = {"begin": lambda e: e.begin(clients[e.i // EPISODES_PER_CLIENT]), "call": lambda e: e.call(max_tokens),
             "end": lambda e: e.end(clients[e.i // EPISODES_PER_CLIENT])}
    if lockstep:
        seconds = sum(_burst(episodes, lambda e, phase=phase, step=step: e.run([(phase, step)], phases))
                      for phase, step in steps.items())
    else:
        seconds = _burst(episodes, lambda e: e.run(list(steps.items()), phases))
    for client in clients:
        client.close()
    outcomes = collections.Counter(e.outcome.split(":")[0] for e in episodes)
    return {"seconds": round(seconds, 1), "outcomes": dict(outcomes),
            "errors": [e.outcome for e in episodes if e.outcome != "acknowledged"][:10],
            "acknowledged": [e.episode_id for e in episodes if e.outcome == "acknowledged"],
            "replayed_ends": sum(e.replayed for e in episodes),
            "phase_seconds": {phase: _spread(times) for phase, times in phases.items()}}


#: Episodes per SwarmClient: half its pool (`marl.client.connection_limits`), so no thread waits for a connection.
EPISODES_PER_CLIENT = 50


class _Episode:
    """One episode's steps (begin, one chat call, end) and how far it got: `outcome`."""

    _lock = threading.Lock()

    def __init__(self, i: int) -> None:
        self.i, self.episode_id, self.lease, self.replayed = i, "", None, False
        self.outcome = "not begun"

    def run(self, steps: list[tuple[str, Callable[[_Episode], None]]], phases: dict[str, list[float]]) -> None:
        for phase, step in steps:
            if self.outcome not in ("not begun", "begun", "called"):
                return  # an earlier step failed: counted, nothing more to do
            at = time.monotonic()
            try:
                step(self)
            except Exception as exc:  # noqa: BLE001 - counted and reported, not raised
                self.outcome = f"{phase} failed: {type(exc).__name__}: {str(exc)[:200]}"
                return
            with self._lock:
                phases[phase].append(time.monotonic() - at)

    def begin(self, client) -> None:
        self.episode_id, self.lease = client.begin_episode()
        self.outcome = "begun"

    def call(self, max_tokens: int) -> None:
        """One chat completion on the lease, on a connection of its own (see `run_episodes`)."""
        url = urllib.parse.urlsplit(self.lease.base_url)
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
        try:
            connection.request("POST", url.path + "/chat/completions", headers={
                "Authorization": f"Bearer {self.lease.api_key}", "Content-Type": "application/json"},
                body=json.dumps({"model": self.lease.model, "max_tokens": max_tokens,
                                 "messages": [{"role": "user", "content": f"Episode {self.i}: say yes."}]}))
            reply = connection.getresponse()
            body = reply.read()
        finally:
            connection.close()
        if reply.status != 200:
            raise RuntimeError(f"chat completion answered {reply.status}: {body[:200]!r}")
        self.outcome = "called"

    def end(self, client) -> None:
        self.replayed = client.end_episode(f"task-{self.i % 50}", self.episode_id, float(self.i % 2)).replayed
        self.outcome = "acknowledged"


def _burst(episodes: list[_Episode], work: Callable[[_Episode], None]) -> float:
    """`work` on every episode, one thread each, all released together; returns when all are done, with the seconds
    from their release to the last one's end (starting 1,000 threads takes this machine seconds, and varies: not
    the server's time)."""
    released_at: list[float] = []
    start = threading.Barrier(len(episodes), action=lambda: released_at.append(time.monotonic()))

    def released(episode: _Episode) -> None:
        start.wait()
        work(episode)

    threads = [threading.Thread(target=released, args=(e,), name=f"episode-{e.i}") for e in episodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.monotonic() - released_at[0]


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
        rounds.append(run_episodes(proc.url, args.episodes, args.max_tokens, args.lockstep))
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
    parser.add_argument("--lockstep", action="store_true",
                        help="each step of a round as a burst of its own: all begins, then all calls, then all ends")
    parser.add_argument("--smoke", action="store_true", help="a few seconds: does the bench run?")
    args = parser.parse_args()
    if args.smoke:
        args.episodes = 20
    from marl import SwarmClient
    from marl.runner.launch import ServerProcess
    from tests.tiny_model import build_tiny_model

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
