"""`marl plan` fits its terminal (issue 42): at COLUMNS=80 no line is wider than 80 (its tables were 160 wide);
piped without COLUMNS, rows stay whole up to 200 columns."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marl.plan import plan_topology
from marl.plan.report import PIPED_WIDTH, plan_console, print_plan
from marl.topology import Topology

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = ["werewolves-7b-14b-235b.yaml", "werewolves-lora.yaml", "signalling-gpu.yaml"]


def test_marl_plan_at_80_columns_prints_no_line_wider_than_80():
    env = {**os.environ, "COLUMNS": "80"}
    out = subprocess.run([sys.executable, "-m", "marl", "plan", str(REPO / "topologies" / TOPOLOGIES[0])],
                         capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "fits:" in out.stdout and any("GPUs 0-7" in line for line in lines)
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)


@pytest.mark.parametrize("name", TOPOLOGIES)
@pytest.mark.parametrize("columns", [80, 60])
def test_every_shipped_plan_fits_the_columns_it_is_given(name, columns, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(columns))
    out = io.StringIO()
    plan = plan_topology(Topology.load(str(REPO / "topologies" / name), [], check_env=False).spec)
    print_plan(plan, plan_console(out))
    assert max(len(line) for line in out.getvalue().splitlines()) <= columns


def test_piped_without_columns_rows_stay_whole(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()
    print_plan(plan_topology(Topology.load(str(REPO / "topologies" / TOPOLOGIES[0]), [], check_env=False).spec),
               plan_console(out))
    widths = [len(line) for line in out.getvalue().splitlines()]
    assert 80 < max(widths) <= PIPED_WIDTH
