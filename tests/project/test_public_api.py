"""The public Python API: what `marl` exports, pinned; every name moved or renamed still works where it was, with a
DeprecationWarning; and what README, docs and examples import exists and is not deprecated.

Changing the set below is changing the API: say so in CHANGELOG.md, and keep a moved name working where it was (a
module `__getattr__` that warns) for at least one release.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import marl

ROOT = Path(__file__).resolve().parents[2]

PUBLIC = {
    # one server
    "SwarmClient", "Episode", "EpisodeOutput", "SwarmError", "SwarmRefused", "SwarmTimeout", "ErrorCode",
    "TrainConfig", "EpisodeLease", "EngineState", "RUNNING_STATES", "ADMIN_TOKEN_ENV",
    # games across servers
    "Coordinator", "TrainableEndpoint", "StaticEndpoint", "SnapshotPoolEndpoint", "GameSettings", "Seat",
    "GameFailed", "GameCancelled", "play_games", "episodes", "tasks", "RunStats", "FailedAttempt", "CallbackFailed",
    # players, records, envs, topologies
    "LLMAgent", "ScriptedAgent", "default_player", "GameRecord", "Sampling", "CoPlayer", "read_games",
    "TextAECEnv", "GameEnv", "RoleInfo", "InvalidAction", "Topology", "TopologyError",
}

#: Deprecated names, each kept for at least one release: (module, old name) -> (module, name it resolves to).
DEPRECATED = {
    ("marl.coordinator", "play_games"): ("marl.games.schedule", "play_games"),
    ("marl.coordinator", "tasks"): ("marl.games.schedule", "tasks"),
    ("marl.coordinator", "RunStats"): ("marl.games.schedule", "RunStats"),
    ("marl.coordinator", "default_player"): ("marl.games.table", "default_player"),
    ("marl.coordinator", "GameResult"): ("marl.games.record", "GameRecord"),
    ("marl.coordinator", "Endpoint"): ("marl.endpoints", "legacy_endpoint"),
    ("marl.coordinator", "SnapshotSource"): ("marl.endpoints", "SnapshotSource"),
    ("marl.protocol", "Sample"): ("servers.episodes.samples", "Sample"),
}


def test_marl_exports_exactly_the_public_names_and_each_imports():
    assert set(marl.__all__) == PUBLIC
    assert sorted(marl.__all__) == marl.__all__
    assert PUBLIC <= set(dir(marl))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a public name is never a deprecated one
        namespace: dict = {}
        exec("from marl import *", namespace)
    assert PUBLIC <= set(namespace)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        marl.NoSuchName  # noqa: B018


def test_importing_marl_stays_cheap():
    """`import marl` loads none of its modules (names are resolved on first use): a CLI or a server importing a
    constant from it pays nothing for the rest."""
    code = "import sys, marl; print(sorted(m for m in sys.modules if m.startswith(('marl.', 'envs', 'openai'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "['marl.moved']"  # the finder of moved modules' old paths: stdlib only


@pytest.mark.parametrize(("old", "new"), sorted(DEPRECATED.items()), ids=lambda x: ".".join(x))
def test_a_moved_name_still_works_where_it_was_with_a_warning(old, new):
    module, name = old
    with pytest.warns(DeprecationWarning, match=re.escape(f"{module}.{name}")):
        value = getattr(importlib.import_module(module), name)
    assert value is getattr(importlib.import_module(new[0]), new[1])


#: The imports of examples/agentscope_werewolves.py as of commit 184cb3e, before play_games and tasks left
#: marl.coordinator (and of code written against it, with play_games).
EARLIER_EXAMPLE = """
from marl import SwarmClient, SwarmError
from marl.agentscope_agents import Fallback, agentscope_players
from marl.coordinator import Coordinator, Endpoint, GameFailed, GameSettings, play_games, tasks
from marl.topology import import_class
"""


def test_the_earlier_agentscope_examples_imports_still_work_with_warnings():
    with pytest.warns(DeprecationWarning) as warned:
        namespace: dict = {}
        exec(EARLIER_EXAMPLE, namespace)
    warned_of = {str(w.message).split(" moved")[0] for w in warned if str(w.message).startswith("marl.")}
    names = {"marl.coordinator.Endpoint", "marl.coordinator.play_games", "marl.coordinator.tasks"}
    modules = {"marl.agentscope_agents", "marl.coordinator"}  # moved into rooms: warned on a process's first import
    assert names <= warned_of <= names | modules
    assert namespace["play_games"] is marl.play_games and namespace["tasks"] is marl.tasks


def _documented_imports() -> list[tuple[str, str, str]]:
    """(file, module, name) of every `from marl... import` / `from envs... import` in README, docs and examples."""
    found = []
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.py"))]
    pattern = re.compile(r"(?:^|;)\s*from ((?:marl|envs)[\w.]*) import (\([^)]*\)|[^\n;#]+)", re.M)
    for path in files:
        for module, names in pattern.findall(path.read_text()):
            # "X as Y": the imported name is X
            for name in re.sub(r"\bas \w+", "", names).replace("(", " ").replace(")", " ").replace(",", " ").split():
                found.append((path.name, module, name))
    return found


def test_readme_docs_and_examples_import_only_names_that_exist_and_are_not_deprecated():
    documented = _documented_imports()
    assert len(documented) > 20  # the scan found the imports
    missing = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for file, module, name in documented:
            try:
                getattr(importlib.import_module(module), name)
            except (AttributeError, ImportError, DeprecationWarning) as exc:
                missing.append(f"{file}: from {module} import {name}: {exc!r}")
    assert not missing, "\n".join(missing)


def test_a_trainable_endpoint_takes_a_train_config_and_a_dict_still_works_with_a_warning():
    """A topology's `train:` travels typed from YAML to the server; the old dict shape is converted, warning."""
    from marl import TrainConfig
    from marl.runner.endpoints import TrainableEndpoint

    typed = TrainConfig(batch_size=3)
    assert TrainableEndpoint("a", client=None, train_config=typed).train_config is typed
    with pytest.warns(DeprecationWarning, match="pass a marl.TrainConfig"):
        old = TrainableEndpoint("a", client=None, train_config={"batch_size": 3})
    assert old.train_config == typed
    with pytest.raises(ValueError, match="batch_sise"):
        TrainableEndpoint("a", client=None, train_config={"batch_sise": 3})
