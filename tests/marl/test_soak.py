"""Soak of the shipped TextArena topologies with a weak model (issue 55): every run ends, finishing or stopping with
the reason, and nothing is lost (every game in games.jsonl is one committed episode on each of its servers).

A tiny untrained model plays here (each run bounded in time); bench/soak_textarena.py runs the same with SmolLM2-135M.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from marl.games.record import read_games

pytest.importorskip("textarena")

ROOT = Path(__file__).resolve().parents[2]
#: Secret Mafia is the one that never ended (its village never spoke); Kuhn Poker's tiny-model run is
#: bench/soak_textarena.py's smoke, which tests/project/test_benches.py runs.
TOPOLOGIES = ["textarena-secret-mafia.yaml"]


def ledger_episodes(run_dir: Path, server: str) -> int:
    with sqlite3.connect(run_dir / "servers" / server / "ledger.sqlite") as db:
        return db.execute("SELECT COUNT(*) FROM episodes").fetchone()[0]


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_a_shipped_textarena_topology_on_a_weak_model_ends_and_loses_nothing(tiny_model, tmp_path, name):
    topology = yaml.safe_load((ROOT / "topologies" / name).read_text())
    servers = [s for s, spec in topology["servers"].items() if spec.get("trainable")]
    run_dir = tmp_path / "run"
    overrides = [f"servers.{s}.model={tiny_model}" for s in servers] + [
        "run.max_steps=1", f"run.run_dir={run_dir}", "run.lease_timeout_s=30"]
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "marl.cli", "run", str(ROOT / "topologies" / name), *overrides],
                            capture_output=True, text=True, timeout=400, env={**os.environ, "COLUMNS": "250"})
    output = result.stdout + result.stderr
    assert result.returncode in (0, 1), output[-3000:]
    assert time.monotonic() - started < 300, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    last = output.strip().splitlines()[-1]
    games = read_games(run_dir / "games.jsonl")
    if result.returncode == 1:  # stopped: with one line saying why
        assert "gave up: " in output, output[-3000:]
    else:
        assert last.startswith("done: "), last
    assert f": {len(games)} games," in last, last  # the summary counts exactly what games.jsonl holds
    for server in servers:  # each recorded game is one ended episode on each of its servers
        assert ledger_episodes(run_dir, server) == len(games), server
