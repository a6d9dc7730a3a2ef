"""Every `marl` command answers a mistake in one line that says what to do, and exit 2, as argparse answers a bad
argument (issue 54): a server that cannot be reached (said within seconds), a refused admin token, a URL without its
scheme, a file or directory that is not there, a run without the checkpoint asked for. Never a traceback.

Each command the parser knows is run (`command_paths`: a new command is run too, with a made-up mistake until
`MISTAKES` says which mistakes a user of it makes), in a subprocess as a user runs it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marl.cli import build_parser
from marl.runner.launch import free_port
from tests.conftest import ADMIN

REPO = Path(__file__).resolve().parents[2]
CPU = str(REPO / "topologies" / "signalling-cpu.yaml")
MISSING = "/nonexistent-marl-test/nothing"
CLOSED = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connections are refused


def command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], bool]:
    """Every command and subcommand the parser knows, e.g. ("topology", "show"): whether it has subcommands."""
    paths = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = command_paths(sub, (*prefix, name))
                paths[(*prefix, name)] = bool(nested)
                paths.update(nested)
    return paths


COMMANDS = command_paths(build_parser())

#: Per command: (arguments, what the one line must say). `run.run_dir` of an empty directory: no checkpoints there.
MISTAKES: dict[tuple[str, ...], list[tuple[list[str], str]]] = {
    ("serve",): [(["--model", MISSING], "cannot resolve model")],
    ("trainer-node",): [([], "deprecated")],
    ("status",): [([CLOSED, "--timeout", "1"], "gave up after 1.0s"), (["127.0.0.1:1"], "(add http://)"),
                  ([CLOSED, "--timeout", "0"], "seconds > 0")],
    ("topology", "show"): [([MISSING + ".yaml"], "no such topology file")],
    ("plan",): [([MISSING + ".yaml"], "no such topology file")],
    ("run",): [([MISSING + ".yaml"], "no such topology file")],
    ("overwatch",): [([CLOSED, "--once"], "1 of 1 servers could not be read"),
                     (["127.0.0.1:1"], "is neither a URL")],
    ("plot",): [([MISSING], "is not a directory")],
    ("games", "show"): [([MISSING], "no games at")],
    ("games", "list"): [([MISSING], "no games at")],
    ("episode", "list"): [([MISSING], "no ledger at")],
    ("episode", "show"): [([MISSING], "no ledger at")],
    ("eval",): [([CPU, "--run-dir", MISSING], "no such directory"),
                ([CPU, "run.run_dir=EMPTY"], "has no checkpoint in"),
                ([CPU, "--exploitability", "--run-dir", MISSING], "no such directory"),
                ([CPU, "--games", "0"], "expected a whole number >= 1")],
    ("proxy",): [(["--server", CLOSED, "--reward", "rule", "--reward-option", "max_words=1"], "gave up after 5.0s"),
                 (["--server", "127.0.0.1:1", "--reward", "rule", "--reward-option", "max_words=1"], "http://")],
}


def made_up_mistake(path: tuple[str, ...]) -> list[tuple[list[str], str]]:
    """A command not in `MISTAKES`: a missing file for each positional argument (a command of subcommands: none,
    which argparse refuses), or an option it does not have."""
    parser = build_parser()
    for name in path:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    positionals = [a for a in parser._actions if not a.option_strings and a.nargs != 0
                   and not isinstance(a, argparse._SubParsersAction)]
    if any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
        return [([], "")]
    return [([MISSING] * len(positionals) if positionals else ["--no-such-option"], "")]


def marl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marl", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "100", **(env or {})})


def assert_one_line_mistake(result: subprocess.CompletedProcess, path: tuple[str, ...], fragment: str) -> str:
    """Exit 2, no traceback; stderr (past argparse's usage lines) is one line: `marl <command>...` (argparse's
    `marl: error: unrecognized arguments` for an unknown option), with `fragment`."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    said = [line for line in result.stderr.splitlines() if line and not line.startswith(("usage:", " "))]
    assert len(said) == 1 and said[0].startswith((f"marl {path[0]}", "marl: error:")), result.stderr
    assert fragment in said[0], result.stderr
    return said[0]


def test_every_command_in_mistakes_exists():
    assert set(MISTAKES) <= set(COMMANDS), set(MISTAKES) - set(COMMANDS)


@pytest.mark.parametrize("path", [("serve",), ("plot",), ("games",)], ids=" ".join)
def test_a_command_not_in_mistakes_gets_a_made_up_one(path):
    """What a new command is run with until `MISTAKES` names its own (a command without positionals: an option it
    does not have; with some: a missing file for each; of subcommands: none)."""
    (args, fragment), = made_up_mistake(path)
    assert args == {"serve": ["--no-such-option"], "plot": [MISSING], "games": []}[path[0]]
    assert_one_line_mistake(marl(*path, *args), path, fragment)


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_a_mistake_is_one_line_and_exit_2(path, tmp_path):
    env = {"MARL_ADMIN_TOKEN": ADMIN, "MARL_PROXY_API_KEY": "app-key"}  # not the mistakes tried here
    for args, fragment in MISTAKES.get(path) or made_up_mistake(path):
        args = [arg.replace("EMPTY", str(tmp_path)) for arg in args]
        assert_one_line_mistake(marl(*path, *args, env=env), path, fragment)


def test_an_unreachable_server_is_said_within_seconds_without_advising_the_same_command():
    said = assert_one_line_mistake(marl("status", CLOSED, "--timeout", "1"), ("status",), "gave up after 1.0s")
    assert "could not reach the server" in said and "Is the server running" in said
    assert "`marl status" not in said  # not the advice to run what just failed


def test_a_refused_or_missing_token_is_one_line_that_says_which(local_server):
    no_token = {key: value for key, value in os.environ.items() if key != "MARL_ADMIN_TOKEN"}
    with local_server() as srv:
        assert marl("status", srv.url, f"--admin-token={ADMIN}").returncode == 0  # its token starts with a dash
        wrong = marl("status", srv.url, "--admin-token", "wrong-token")
        assert_one_line_mistake(wrong, ("status",), "the admin token was rejected")
        assert "HTTP 401" in wrong.stderr
        missing = subprocess.run([sys.executable, "-m", "marl", "status", srv.url], capture_output=True, text=True,
                                 timeout=120, cwd=REPO, env=no_token)
        assert_one_line_mistake(missing, ("status",), "no admin token was given")
        assert "--admin-token" in missing.stderr
        watched = marl("overwatch", srv.url, "--once", "--admin-token", "wrong-token")
        assert_one_line_mistake(watched, ("overwatch",), "could not be read")
        assert "REFUSED" in watched.stdout
        proxy = marl("proxy", "--server", srv.url, "--reward", "rule", "--reward-option", "max_words=1",
                     env={"MARL_ADMIN_TOKEN": "wrong-token", "MARL_PROXY_API_KEY": "app-key"})
        assert_one_line_mistake(proxy, ("proxy",), "the admin token was rejected")


def test_a_bug_still_shows_its_traceback(tmp_path):
    """Only marl's documented exceptions for a mistake are one line: anything else is a bug, shown whole."""
    script = ("import sys, marl.cli\n"
              "def broken(args):\n    raise RuntimeError('a bug')\n"
              "args = marl.cli.parse(['plot', 'x'])\nargs.func = broken\n"
              "marl.cli.parse = lambda argv=None: args\nmarl.cli.main()\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 1 and "Traceback" in result.stderr and "RuntimeError: a bug" in result.stderr
