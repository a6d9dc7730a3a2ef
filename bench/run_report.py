"""What a `marl run` achieved, from its run directory: reward, valid replies and wins per role, by policy version.

    python bench/run_report.py runs/signalling-cpu                 # versions of the first trainable server
    python bench/run_report.py runs/werewolves-local --server wolves_model --buckets 2

Rows are games grouped by the policy version the given server played them with (`--buckets N` merges versions into
N equal ranges, which smooths small steps); the last table is the whole run (games/hour from the first to the last
game). Everything is read from games.jsonl, so it works during a run too.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from marl.game_record import GameRecord, read_games
from marl.plot import percent, summarize_games, summarize_roles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--server", help="whose policy version groups the games (default: the first one)")
    parser.add_argument("--buckets", type=int, default=0, help="merge versions into this many ranges")
    args = parser.parse_args()
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
            cells.append(f"{row['mean_reward']:>20.3f} {percent(row['valid_reply_rate']):>6} {percent(row['win_rate']):>5}")
        label = f"v{start}" if start == end else f"v{start}-{end}"
        print(f"{label:>10} {len(rows):>6} " + " ".join(cells))
    winners = Counter(g.winner for g in games)
    if set(winners) != {None}:
        print("winners: " + ", ".join(f"{w or 'not recorded'} {n}" for w, n in winners.most_common()))
    stats = summarize_games(args.run_dir)
    if "all" in stats:
        print(f"whole run: {stats['all']['games_per_hour']:.0f} games/hour")


if __name__ == "__main__":
    main()
