"""Modules that moved keep their old import path for one release: it warns, names the new path, and is the very
same module object (marl/moved.py); CHANGELOG.md lists every move."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from marl.moved import MOVED_MODULES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_path_warns_and_is_the_new_module(old):
    new = MOVED_MODULES[old]
    code = (f"import warnings, sys\nwarnings.simplefilter('error', DeprecationWarning)\nimport {new}\n"
            f"warnings.simplefilter('always')\nwith warnings.catch_warnings(record=True) as seen:\n"
            f"    import {old}\nassert sys.modules[{old!r}] is sys.modules[{new!r}]\n"
            "print(len(seen), seen[0].category.__name__, seen[0].filename, seen[0].message)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    count, category, filename, message = out.stdout.split(" ", 3)
    assert (count, category) == ("1", "DeprecationWarning")
    assert filename == "<string>", "the warning points at the user's import, not at importlib"
    assert f"{old} moved to {new}" in message


def test_names_resolve_through_an_old_path():
    with pytest.warns(DeprecationWarning, match="servers.interfaces moved to servers.backends"):
        old = importlib.import_module("servers.interfaces")
    from servers.backends import Trainer
    assert old.Trainer is Trainer


def test_the_old_marl_games_names_warn():
    from marl.games.schedule import play_games
    with pytest.warns(DeprecationWarning, match="marl.games.play_games moved to marl.games.schedule.play_games"):
        from marl.games import play_games as old
    assert old is play_games
    with pytest.raises(AttributeError):
        importlib.import_module("marl.games").no_such_name  # noqa: B018


def test_a_name_that_never_existed_still_fails():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("servers.no_such_module")


def test_changelog_lists_every_move():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    missing = [f"{old} -> {new}" for old, new in MOVED_MODULES.items() if f"`{old}` | `{new}`" not in changelog]
    assert not missing, f"CHANGELOG.md's table of moves lacks: {missing}"
