"""Does every run end? `marl run` each shipped TextArena topology on a weak model (untrained SmolLM2-135M by default)
with `run.max_steps=1`, each under a wall-clock cap, and report how it ended: done, stopped with its reason (exit 1),
or still running at the cap (a failure). Nothing may be lost: every game in games.jsonl is one ended episode in the
ledger of each of its trainable servers.

    python bench/soak_textarena.py                          # SmolLM2-135M, both topologies, 20 minutes each at most
    python bench/soak_textarena.py --model DIR --minutes 5  # another model
    python bench/soak_textarena.py --smoke                  # a tiny model, Kuhn Poker, 2 games

Writes OUT/soak.json (default runs/soak-textarena) and each run's output in OUT/<topology>/run.log.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable as a script from anywhere

from marl.games.record import read_games  # noqa: E402

TOPOLOGIES = ["textarena-kuhn-poker.yaml", "textarena-secret-mafia.yaml"]


def soak(name: str, model: str, out: Path, cap_s: float, extra: list[str]) -> dict:
    """One topology's run on `model`: how it ended, its games, and whether each server's ledger holds them all."""
    path = ROOT / "topologies" / name
    servers = [s for s, spec in yaml.safe_load(path.read_text())["servers"].items() if spec.get("trainable")]
    run_dir = out / path.stem
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = [f"servers.{s}.model={model}" for s in servers] + ["run.max_steps=1", f"run.run_dir={run_dir}", *extra]
    started = time.monotonic()
    with (run_dir / "run.log").open("w") as log:
        try:
            code = subprocess.run([sys.executable, "-m", "marl", "run", str(path), *overrides], stdout=log,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=cap_s).returncode
        except subprocess.TimeoutExpired:
            code = None
    lines = (run_dir / "run.log").read_text(errors="replace").splitlines()
    reason = next((line.removeprefix("gave up: ") for line in reversed(lines) if line.startswith("gave up: ")), None)
    games = len(read_games(run_dir / "games.jsonl"))
    ledgers = {s: _ended_episodes(run_dir / "servers" / s / "ledger.sqlite") for s in servers}
    ended = "still running at the cap" if code is None else "done" if code == 0 else f"stopped (exit {code})"
    return {"topology": name, "ended": ended, "reason": reason, "games": games, "ledger_episodes": ledgers,
            "lost": sum(games - n for n in ledgers.values()), "seconds": round(time.monotonic() - started, 1)}


def _ended_episodes(ledger: Path) -> int:
    if not ledger.exists():
        return 0
    with sqlite3.connect(ledger) as db:
        return db.execute("SELECT COUNT(*) FROM episodes").fetchone()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--minutes", type=float, default=20.0, help="wall-clock cap of each run")
    parser.add_argument("--out", default="runs/soak-textarena")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, Kuhn Poker, 2 games")
    args = parser.parse_args()
    names, extra, model = TOPOLOGIES, [], args.model
    if args.smoke:
        from tests.tiny_model import build_tiny_model

        scratch = Path(tempfile.mkdtemp(prefix="soak-smoke-"))
        model, names, extra, args.out = str(build_tiny_model(scratch / "model")), TOPOLOGIES[:1], ["run.games=2"], \
            str(scratch / "out")
    out = Path(args.out)
    results = []
    for name in names:
        result = soak(name, model, out, args.minutes * 60, extra)
        results.append(result)
        print(f"{name}: {result['ended']} after {result['seconds']:.0f} s, {result['games']} games, lost"
              f" {result['lost']}" + (f"; reason: {result['reason']}" if result["reason"] else ""), flush=True)
    (out / "soak.json").write_text(json.dumps({"model": model, "runs": results}, indent=2))
    failed = [r["topology"] for r in results if r["ended"] == "still running at the cap" or r["lost"]
              or (r["ended"] != "done" and not r["reason"])]
    print(f"{len(results) - len(failed)} of {len(results)} runs ended with nothing lost; wrote {out / 'soak.json'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
