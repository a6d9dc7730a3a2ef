"""What a `marl run` achieved, from its run directory: reward, valid replies and wins per role, by policy version.

    python bench/run_report.py runs/signalling-cpu                 # versions of the first trainable server
    python bench/run_report.py runs/werewolves-local --server wolves_model --buckets 2
    python bench/run_report.py runs/sweep/seed-4 --server team.listener --buckets 12 --actions listener
    python bench/run_report.py --smoke     # seconds: `marl run` 4 signalling games on a tiny model, report them

Rows are games grouped by the policy version the given server played them with (`--buckets N` merges versions into
N equal ranges, which smooths small steps); the last table is the whole run (games/hour from the first to the last
game). `--actions ROLE` adds what the role did in each row, as the env labels its moves (`action_labels`: a
signalling listener's "pick 2", "pick none"), in shares of its moves. Everything is read from games.jsonl, so it
works during a run too. Last, each trainable server's steps from its metrics.jsonl: how many, the median seconds a
step trained (its `seconds`), and the wall seconds from one step to the next (training, games and waiting).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from marl.games.record import GameRecord, read_games
from marl.watching.plot import percent, summarize_games, summarize_roles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, nargs="?")
    parser.add_argument("--server", help="whose policy version groups the games (default: the first one)")
    parser.add_argument("--buckets", type=int, default=0, help="merge versions into this many ranges")
    parser.add_argument("--actions", metavar="ROLE", help="also the shares of ROLE's labelled moves per row")
    parser.add_argument("--smoke", action="store_true", help="a few seconds: report on a short run of a tiny model")
    args = parser.parse_args()
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            args.run_dir = smoke_run(Path(tmp))
            report(args)
    elif args.run_dir is None:
        parser.error("the run directory is required (or --smoke)")
    else:
        report(args)


# One tiny trainable model plays the speaker, the env's scripted policy the listener: the fewest processes.
SMOKE_TOPOLOGY = """\
name: run-report-smoke
servers:
  model:
    model: {model}
    trainable: true
    device: cpu
    train:
      batch_size: 8  # more groups than 4 games make: no training step
      num_repeat: 2
roles:
  speaker:
    server: model
  listener:
    scripted: true
env:
  class: envs.signalling:SignallingGame
run:
  games: 4
  repeats: 2
  concurrency: 4
  max_tokens: 8
  run_dir: {run_dir}
"""


def smoke_run(directory: Path) -> Path:
    """`marl run` of 4 signalling games (SMOKE_TOPOLOGY, on a tiny model); its run directory."""
    from marl.cli import main as marl
    from tests.tiny_model import build_tiny_model

    run_dir = directory / "run"
    topology = directory / "topology.yaml"
    topology.write_text(SMOKE_TOPOLOGY.format(model=build_tiny_model(directory / "tiny"), run_dir=run_dir))
    marl(["run", str(topology)])
    return run_dir


def action_shares(rows: list[GameRecord], role: str | None) -> str:
    """`role`'s labelled moves in `rows` as shares, commonest first ("" without a role)."""
    if role is None:
        return ""
    moves = Counter(label for g in rows for label in g.actions.get(role, []))
    total = sum(moves.values()) or 1
    return "   " + ", ".join(f"{label} {n / total:.0%}" for label, n in moves.most_common())


def report(args: argparse.Namespace) -> None:
    games = read_games(args.run_dir / "games.jsonl")
    if not games:
        sys.exit(f"no games in {args.run_dir / 'games.jsonl'}")
    server = args.server or sorted(games[0].policy_versions)[0]
    roles = sorted({r for g in games for r in g.role_rewards})
    versions = sorted({g.policy_versions[server] for g in games})
    span = max(1, -(-len(versions) // args.buckets)) if args.buckets else 1
    bucket_of = {v: versions[(i // span) * span] for i, v in enumerate(versions)}
    groups: dict[int, list[GameRecord]] = defaultdict(list)
    for g in games:
        groups[bucket_of[g.policy_versions[server]]].append(g)

    print(f"{args.run_dir}: {len(games)} games, grouped by {server}'s policy version")
    print(f"{'versions':>10} {'games':>6} "
          + " ".join(f"{role[:12] + ' reward':>20} {'valid':>6} {'won':>5}" for role in roles))
    for start in sorted(groups):
        rows = groups[start]
        end = max(g.policy_versions[server] for g in rows)
        stats = summarize_roles(rows)
        cells = []
        for role in roles:
            row = stats.get(role)
            if row is None:
                cells.append(f"{'-':>20} {'-':>6} {'-':>5}")
                continue
            valid, won = percent(row["valid_reply_rate"]), percent(row["win_rate"])
            cells.append(f"{row['mean_reward']:>20.3f} {valid:>6} {won:>5}")
        label = f"v{start}" if start == end else f"v{start}-{end}"
        print(f"{label:>10} {len(rows):>6} " + " ".join(cells) + action_shares(rows, args.actions))
    winners = Counter(g.winner for g in games)
    if set(winners) != {None}:
        print("winners: " + ", ".join(f"{w or 'not recorded'} {n}" for w, n in winners.most_common()))
    stats = summarize_games(args.run_dir)
    if "all" in stats:
        print(f"whole run: {stats['all']['games_per_hour']:.0f} games/hour")
    step_times(args.run_dir)


def step_times(run_dir: Path) -> None:
    """Each trainable server's step count, median training seconds a step, and median wall seconds between steps."""
    for metrics in sorted(run_dir.glob("servers/*/metrics.jsonl")):
        steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if not steps:
            continue
        trained = statistics.median(step["seconds"] for step in steps)
        times = [step["time"] for step in steps]
        wall = statistics.median(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else float("nan")
        print(f"{metrics.parent.name}: {len(steps)} steps; a step trains {trained:.1f} s (median), "
              f"{wall:.1f} s from one step to the next (median)")


if __name__ == "__main__":
    main()
