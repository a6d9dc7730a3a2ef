"""Do servers that share a machine's cores run faster on a share each? `marl run` a topology of several local CPU
servers in pairs of runs: one with every server on torch's default (a CPU thread per core in each process:
OMP_NUM_THREADS=<cores>) and one with marl's split (`marl.runner.launch.threads_per_server`: the cores divided between
the servers), alternating which goes first. Prints each run's wall time, games and games per minute (first game to
last), then the medians.

    python bench/cpu_threads.py topologies/signalling-cpu.yaml run.max_steps=4 --pairs 2
    python bench/cpu_threads.py --smoke       # half a minute: a tiny model, one step per run, one pair

Each run's directory is OUT/<arm>-<pair> (default OUT: a temporary folder, removed at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from marl.games.record import read_games  # noqa: E402
from marl.runner.launch import usable_cores  # noqa: E402

#: the arms: the OMP_NUM_THREADS each run's environment has (None: unset, so marl splits the cores)
ARMS = {"torch default": str(usable_cores()), "marl split": None}
SMOKE_TOPOLOGY = """\
name: cpu-threads-smoke
servers:
  speaker_model: {{model: {model}, trainable: true, device: cpu, train: {{batch_size: 2, num_repeat: 2}}}}
  listener_model: {{model: {model}, trainable: true, device: cpu, train: {{batch_size: 2, num_repeat: 2}}}}
roles:
  speaker: {{server: speaker_model}}
  listener: {{server: listener_model}}
env: {{class: "envs.signalling:SignallingGame"}}
run: {{games: null, max_steps: 1, repeats: 2, concurrency: 4, max_tokens: 8}}
"""


def run_once(file: str, overrides: list[str], run_dir: Path, threads: str | None) -> dict:
    """One `marl run` with OMP_NUM_THREADS=`threads` (None: unset); its wall time and game throughput."""
    environment = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        environment["OMP_NUM_THREADS"] = threads
    started = time.monotonic()
    with (run_dir.parent / f"{run_dir.name}.log").open("w") as log:
        run = subprocess.run([sys.executable, "-m", "marl", "run", file, f"run.run_dir={run_dir}", *overrides],
                             env=environment, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    wall_s = time.monotonic() - started
    if run.returncode != 0:
        raise SystemExit(f"marl run exited {run.returncode}; see {log.name}")
    ends = sorted(g.time for g in read_games(run_dir / "games.jsonl") if g.time is not None)
    span_s = ends[-1] - ends[0] if len(ends) > 1 else 0.0
    return {"wall_s": wall_s, "games": len(ends), "games_per_min": 60 * (len(ends) - 1) / span_s if span_s else None}


def bench(file: str, overrides: list[str], pairs: int, out: Path) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for pair in range(pairs):
        order = list(ARMS) if pair % 2 == 0 else list(reversed(ARMS))
        for arm in order:
            row = run_once(file, overrides, out / f"{arm.replace(' ', '-')}-{pair}", ARMS[arm])
            results[arm].append(row)
            rate = "-" if row["games_per_min"] is None else f"{row['games_per_min']:.1f}"
            print(f"pair {pair} {arm:>13}: {row['wall_s']:6.1f} s, {row['games']} games, {rate} games/min",
                  flush=True)
    for arm, rows in results.items():
        rates = [r["games_per_min"] for r in rows if r["games_per_min"] is not None]
        print(f"median {arm:>13}: {statistics.median(r['wall_s'] for r in rows):6.1f} s"
              + (f", {statistics.median(rates):.1f} games/min" if rates else ""))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", nargs="?", help="the topology YAML (two or more local servers)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    parser.add_argument("--pairs", type=int, default=2, help="pairs of runs (default 2)")
    parser.add_argument("--out", type=Path, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one step per run, one pair")
    args = parser.parse_intermixed_args()
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        if args.smoke:
            from tests.tiny_model import build_tiny_model

            args.file, args.pairs = str(out / "topology.yaml"), 1
            Path(args.file).write_text(SMOKE_TOPOLOGY.format(model=build_tiny_model(out / "tiny")))
        elif args.file is None:
            parser.error("the topology file is required (or --smoke)")
        results = bench(args.file, args.overrides, args.pairs, out)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
