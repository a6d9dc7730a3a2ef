"""Training tokens of recorded Werewolves episodes with and without timeline merging.

    python bench/merging_savings.py runs/werewolves-local/servers/*       # episodes a `marl run` recorded
    python bench/merging_savings.py --record 8                             # record 8 games first (tiny models)
    python bench/merging_savings.py --smoke                  # seconds: record one short game (1 round), measure it

An agent re-sends its whole conversation on every call. Without merging, each call is a training sample of its own
(prompt + completion: the shared history is processed again on every turn); with merging, one agent's calls of
one episode are one sample. For every sample in the ledgers this counts both
(`servers.episodes.samples.unmerged_tokens`: call k's prompt is every token before its completion) and prints the
totals per server and role. The generated (trained-on) tokens are the same either way; only the context the trainer
re-reads changes.

`--record N` plays N Werewolves games through the coordinator on two in-process servers with tiny random models
(werewolves on one, the seer on the other, the rest scripted) into a temporary directory, then measures those.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from servers.episodes.ledger import Ledger
from servers.episodes.samples import unmerged_tokens


def measure(data_dirs: list[Path]) -> dict[tuple[str, str], dict[str, int]]:
    totals: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for data_dir in data_dirs:
        ledger = Ledger(data_dir / "ledger.sqlite")
        try:
            for row in ledger.episodes(limit=1_000_000):
                samples = ledger.samples_of(row.episode_id)
                for agent in {s.agent for s in samples}:
                    totals[data_dir.name, agent]["episodes"] += 1
                for sample in samples:
                    t = totals[data_dir.name, sample.agent]
                    t["samples"] += 1
                    t["calls"] += sample.num_calls
                    t["generated"] += sum(sample.loss_mask)
                    t["merged"] += len(sample.token_ids)
                    t["unmerged"] += unmerged_tokens(sample)
                    t["max_len"] = max(t["max_len"], len(sample.token_ids))
        finally:
            ledger.close()
    return totals


def record(games: int, directory: Path, max_rounds: int = 4, max_tokens: int = 24) -> list[Path]:
    """Play `games` Werewolves games on two in-process tiny-model servers; returns their data dirs."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import ADMIN, LocalServer  # the tests' in-process server

    from envs.werewolves import Werewolves
    from marl.client import SwarmClient
    from marl.games.schedule import play_games, tasks
    from marl.runner.endpoints import TrainableEndpoint
    from marl.transaction.coordinator import Coordinator, GameSettings
    from tests.tiny_model import build_tiny_model

    model = build_tiny_model(directory / "model", max_position_embeddings=8192)
    dirs = [directory / "wolves_model", directory / "seer_model"]
    with LocalServer(model, dirs[0]) as wolves, LocalServer(model, dirs[1]) as seer:
        endpoints = {}
        for name, srv in (("wolves_model", wolves), ("seer_model", seer)):
            config = {"job": "werewolves", "batch_size": 10_000, "num_repeat": 2, "save_freq": 0}  # never trains
            client = SwarmClient(srv.url, admin_token=ADMIN)
            client.auto_sync_train_config_and_start_engine(config)
            endpoints[name] = TrainableEndpoint(name, client=client, train_config=config)
        coordinator = Coordinator(
            env_factory=lambda: Werewolves(max_rounds=max_rounds),
            role_servers={"werewolf": "wolves_model", "seer": "seer_model", "villager": None, "witch": None,
                          "hunter": None},
            endpoints=endpoints, settings=GameSettings(max_tokens=max_tokens))
        stats = play_games(coordinator, tasks("bench", 1, seed=0), concurrency=2, games=games)
        coordinator.close()
        print(f"recorded {stats.games} games ({stats.failed} failed attempts)")
    return dirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_dirs", nargs="*", type=Path, help="server data dirs (each holds ledger.sqlite)")
    parser.add_argument("--record", type=int, default=0, help="record this many games with tiny models first")
    parser.add_argument("--smoke", action="store_true", help="a few seconds: record one short game, measure it")
    args = parser.parse_args()
    data_dirs = [d for d in args.data_dirs if (d / "ledger.sqlite").exists()]
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            data_dirs += record(1, Path(tmp), max_rounds=1, max_tokens=8)
        elif args.record:
            data_dirs += record(args.record, Path(tmp))
        if not data_dirs:
            parser.error("no ledger found: pass server data dirs (runs/<run>/servers/<name>) or --record N")
        totals = measure(data_dirs)
    print(f"{'server':<16} {'agent':<10} {'episodes':>8} {'samples':>8} {'calls':>7} {'generated':>10} "
          f"{'merged':>10} {'unmerged':>10} {'saved':>7}")
    grand = defaultdict(int)
    for (server, agent), t in sorted(totals.items()):
        print(f"{server:<16} {agent:<10} {t['episodes']:>8} {t['samples']:>8} {t['calls']:>7} {t['generated']:>10} "
              f"{t['merged']:>10} {t['unmerged']:>10} {t['unmerged'] / max(t['merged'], 1):>6.2f}x")
        for key in ("calls", "generated", "merged", "unmerged", "samples"):
            grand[key] += t[key]
    print(f"total: {grand['calls']} calls in {grand['samples']} merged samples; training tokens "
          f"{grand['merged']} merged vs {grand['unmerged']} unmerged: "
          f"{grand['unmerged'] / max(grand['merged'], 1):.2f}x fewer with merging "
          f"({grand['generated']} generated tokens either way)")


if __name__ == "__main__":
    main()
