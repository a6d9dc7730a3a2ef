"""Modules that moved keep their old import path for one release: it warns, names the new path, and is the very
same module object (marl/moved.py); CHANGELOG.md lists every move."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from marl.moved import MOVED_MODULES

ROOT = Path(__file__).resolve().parents[2]


#: Run in one fresh interpreter, each old path in turn: its new module imported first with DeprecationWarning an
#: error (no new module may import an old path), then the old path, recording the warnings it raises. One per
#: module took 55 interpreters and 20 CPU seconds; an old path imports only through marl/moved.py's finder, so the
#: modules imported for one pair do not import another's old path.
FRESH_IMPORTS = """
import json, sys, traceback, warnings
for old, new in json.loads(sys.argv[1]):
    try:
        warnings.simplefilter('error', DeprecationWarning)
        __import__(new)
        warnings.simplefilter('always')
        with warnings.catch_warnings(record=True) as seen:
            exec(f'import {old}')
        assert sys.modules[old] is sys.modules[new], f'{old} is not the module {new}'
        print(json.dumps({'old': old, 'count': len(seen), 'category': seen[0].category.__name__,
                          'filename': seen[0].filename, 'message': str(seen[0].message)}))
    except BaseException:
        print(json.dumps({'old': old, 'error': traceback.format_exc()}))
"""


@pytest.fixture(scope="module")
def fresh_imports() -> dict[str, dict]:
    pairs = json.dumps(sorted(MOVED_MODULES.items()))
    out = subprocess.run([sys.executable, "-c", FRESH_IMPORTS, pairs], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return {row["old"]: row for row in map(json.loads, out.stdout.splitlines())}


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_path_warns_and_is_the_new_module(old, fresh_imports):
    row = fresh_imports[old]
    assert "error" not in row, row.get("error")
    assert (row["count"], row["category"]) == (1, "DeprecationWarning")
    assert row["filename"] == "<string>", "the warning points at the user's import, not at importlib"
    assert f"{old} moved to {MOVED_MODULES[old]}" in row["message"]


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
