"""The `marl` command as a new user first meets it: every help page prints, every shipped topology shows."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from marl.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = sorted((REPO / "topologies").glob("*.yaml"))


def _marl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marl", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, stdin=subprocess.DEVNULL)


def _command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and subcommand the parser knows, e.g. ("topology", "show")."""
    paths = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths.append((*prefix, name))
                paths.extend(_command_paths(sub, (*prefix, name)))
    return paths


def test_marl_help_lists_every_command():
    result = _marl("--help")
    assert result.returncode == 0, result.stderr
    for command in ("serve", "run", "topology", "overwatch", "eval", "proxy", "episode", "games"):
        assert command in result.stdout


@pytest.mark.parametrize("path", _command_paths(build_parser()), ids=" ".join)
def test_every_subcommand_help(path):
    result = _marl(*path, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: marl " + " ".join(path))


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda p: p.name)
def test_topology_show_on_every_shipped_topology(topology):
    result = _marl("topology", "show", str(topology.relative_to(REPO)))
    assert result.returncode == 0, result.stderr
    assert "── servers" in result.stdout and "── env " in result.stdout
