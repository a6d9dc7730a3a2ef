"""What one recorded episode costs the ledger: an fsynced SQLite transaction (synchronous=FULL, WAL) per `end`,
and the train loop's look at the pool that follows it.

    python bench/ledger_commit.py                 # 2,000 episodes of 1 sample of 600 tokens, in the project's runs/
    python bench/ledger_commit.py --dir /data     # on the disk a server's data directory will use
    python bench/ledger_commit.py --recount       # each look counts the pool in SQLite (as before the kept counts)
    python bench/ledger_commit.py --smoke         # 50 episodes

`Ledger.record_episode` is what `end` runs on the ledger's own thread; a server records at most 1 / (its time)
episodes per second through it. After every end the train loop reads the pool's groups (`pool_groups`, and with
`overlap` `pending_episodes`) on the same thread. The figures are wall time per episode (p50, p99), on the disk of
`--dir`, and the look's time once the pool holds all the episodes (nothing is trained here).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from servers.episodes.ledger import Ledger  # noqa: E402
from servers.episodes.samples import Sample  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def record(ledger: Ledger, index: int, tokens: int) -> float:
    sample = Sample(episode_id=f"ep-{index}", agent="player", token_ids=list(range(tokens)), loss_mask=[1] * tokens,
                    logprobs=[-0.5] * tokens, reward=1.0, policy_version=0, num_calls=3, versions=[(0, tokens)])
    started = time.perf_counter()
    ledger.record_episode(episode_id=f"ep-{index}", job="bench", task_id=f"task-{index // 8}", client_id="bench",
                          reward=1.0, agent_rewards=None, metadata={}, num_calls=3, samples=[sample])
    return time.perf_counter() - started


def look(ledger: Ledger, recount: bool) -> float:
    """The train loop's read after an end: the pool's groups and pending episodes (`recount`: counted in SQLite)."""
    started = time.perf_counter()
    if recount:
        ledger.count_pool_groups()
        ledger.count_pending_episodes()
    else:
        ledger.pool_groups()
        ledger.pending_episodes()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=600, help="tokens of each episode's one sample")
    parser.add_argument("--dir", type=Path, default=ROOT / "runs", help="where the ledger file lives (its disk)")
    parser.add_argument("--recount", action="store_true", help="count the pool in SQLite at every look")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.episodes = 50
    args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        ledger = Ledger(Path(scratch) / "ledger.sqlite")
        seconds, looks = [], []
        for i in range(args.episodes):
            seconds.append(record(ledger, i, args.tokens))
            looks.append(look(ledger, args.recount))
        ledger.close()
    seconds, last_looks = sorted(seconds), sorted(looks[-max(1, len(looks) // 10):])
    p50, p99 = statistics.median(seconds), seconds[int(0.99 * (len(seconds) - 1))]
    print(f"{args.episodes} episodes of {args.tokens} tokens, fsynced, on {args.dir}: {p50 * 1e3:.2f} ms p50,"
          f" {p99 * 1e3:.2f} ms p99 per episode; {1 / statistics.fmean(seconds):.0f} episodes/s on one thread")
    print(f"the look at the pool after an end ({'counted in SQLite' if args.recount else 'kept counts'}), with"
          f" {args.episodes} episodes pending: {statistics.median(last_looks) * 1e3:.3f} ms p50")


if __name__ == "__main__":
    main()
