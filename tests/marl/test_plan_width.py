"""`marl plan` fits its terminal (issue 42): at COLUMNS=80 no line is wider than 80 (its tables were 160 wide);
piped without COLUMNS, rows stay whole up to 200 columns. Its lines end in no space and wrap at spaces, a note's
continuation indented under it (issue 54)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from marl.plan import plan_topology
from marl.plan.report import PIPED_WIDTH, plan_console, print_plan
from marl.topology import Topology

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = ["werewolves-7b-14b-235b.yaml", "werewolves-lora.yaml", "signalling-gpu.yaml"]
SHIPPED = sorted(path.name for path in (REPO / "topologies").glob("*.yaml"))
BOX = re.compile(r"[\u2500-\u257f]")  # a table's lines


def plan_text(name: str, columns: int, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    out = io.StringIO()
    print_plan(plan_topology(Topology.load(str(REPO / "topologies" / name), [], check_env=False).spec),
               plan_console(out))
    return out.getvalue()


def words(text: str) -> set[str]:
    return set(BOX.sub(" ", text).split())


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


def assert_wrapped_at_spaces(text: str, whole: set[str]) -> None:
    """No line ends in a space; every word is one of the plan's words printed wide (a word cut in two is not)."""
    assert not [line for line in text.splitlines() if line.endswith(" ")], text
    assert words(text) <= whole, sorted(words(text) - whole)


@pytest.mark.parametrize("columns", [100, 80])
def test_marl_plan_ends_no_line_in_a_space_and_splits_no_word(columns, monkeypatch):
    env = {**os.environ, "COLUMNS": str(columns)}
    out = subprocess.run([sys.executable, "-m", "marl", "plan", str(REPO / "topologies" / TOPOLOGIES[0])],
                         capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert_wrapped_at_spaces(out.stdout, words(plan_text(TOPOLOGIES[0], 2000, monkeypatch)))
    lines = out.stdout.splitlines()
    wolves = lines.index(next(line for line in lines if line.startswith("wolves_7b: Qwen/Qwen2.5-7B-Instruct")))
    assert not lines[wolves].endswith(" ") and "─" not in lines[wolves]  # the header is its own line, unpadded
    trainer = next(i for i, line in enumerate(lines) if line.startswith("  trainer: a 32768-token micro-batch"))
    assert lines[trainer + 1].startswith("    ") and lines[trainer + 1][4] != " "  # its continuation, indented


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_plan_wraps_at_spaces_at_100_and_80_columns(name, monkeypatch):
    whole = words(plan_text(name, 2000, monkeypatch))
    for columns in (100, 80):
        assert_wrapped_at_spaces(plan_text(name, columns, monkeypatch), whole)
