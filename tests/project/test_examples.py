"""The shipped examples use marl's current API (issue 54): each is imported and its objects are built (nothing
served, no game played) in a fresh interpreter, where every DeprecationWarning that marl's own code (marl, servers,
envs) raises is recorded, and any is a failure. Other libraries' warnings are theirs to fix, and left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.py"))

#: Runs in the fresh interpreter: `warnings.warn` wrapped to note the DeprecationWarnings marl's own modules raise
#: (the filters of `-W` match the module a warning is attributed to, which `stacklevel` makes the caller's: the
#: example), then the example imported as a module, then its BUILD code (below) run with it as `example`.
DRIVER = '''
import importlib.util, sys, warnings

OURS = {"marl", "servers", "envs"}
raised = []
_warn = warnings.warn


def warn(message, category=None, stacklevel=1, *args, **kwargs):
    cls = category or (type(message) if isinstance(message, Warning) else UserWarning)
    module = sys._getframe(1).f_globals.get("__name__", "")
    if issubclass(cls, DeprecationWarning) and module.partition(".")[0] in OURS:
        raised.append(f"{module}: {message}")
    return _warn(message, category, stacklevel + 1, *args, **kwargs)


warnings.warn = warn
warnings.simplefilter("always", DeprecationWarning)
path, build = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("example", path)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
exec(build, {"example": example})
if raised:
    sys.exit("marl's own DeprecationWarnings:\\n" + "\\n".join(raised))
print("built")
'''

#: Per example, what builds its objects without a server: the functions its main() calls before anything runs.
BUILD = {
    "agentscope_werewolves.py": """
from marl import SwarmClient
args = example.parse_args(["--server", "http://127.0.0.1:1", "--admin-token", "t", "--env-arg", "max_rounds=1"])
with SwarmClient(args.server, admin_token=args.admin_token) as client:
    coordinator, config, ours = example.build(args, client)
    coordinator.close()
assert ours == ["werewolf", "seer"] and config.num_repeat == args.repeats
""",
    "learn_format.py": """
config = example.train_config(example.parse_args(["--learning-rate", "3e-5"]))
assert config.grpo.learning_rate == 3e-5 and config.save_freq == 8
""",
    "proxy_app.py": """
from marl import TrainConfig
command = example.proxy_command(example.parse_args(["--url", "http://127.0.0.1:1"]), 10999)
config = TrainConfig.model_validate_json(command[command.index("--train-config") + 1])
assert config.job == "proxy-app" and config.save_freq == 0
""",
}


def test_every_example_is_built_here():
    assert sorted(BUILD) == [path.name for path in EXAMPLES]  # a new example: say how to build it


@pytest.mark.parametrize("name", sorted(BUILD))
def test_an_example_builds_without_marls_own_deprecation_warnings(name):
    if name == "agentscope_werewolves.py":
        pytest.importorskip("agentscope")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", DRIVER, str(REPO / "examples" / name), BUILD[name]],
                            capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert result.returncode == 0 and result.stdout.strip().endswith("built"), result.stdout + result.stderr
