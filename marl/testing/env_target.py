"""The env that `marl check-env` checks, on its own: TARGET and `--args` read as a topology's `env:`, the env
imported and constructed, the roles it deals, and PettingZoo's `api_test` on it.

TARGET is `module:Class` (or `module:factory`), or a game of a suite as a topology names one: `textarena:GAME-ID`
(`env.textarena`), `openspiel:GAME` (`env.openspiel`). What the user typed wrong (a target that does not import, an
argument the env does not take or refuses, --args that do not parse) is a `UsageError`; what the env does wrong, a
`CheckFailed`.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

#: TARGET prefixes that name a game of a suite instead of a class (a topology's `env.textarena`, `env.openspiel`)
SUITES = ("textarena", "openspiel")

class UsageError(ValueError):
    """What the user typed cannot be checked: exit 2, the message on one line."""


class CheckFailed(Exception):
    """The env failed the check: the message is the verdict's reason."""


@dataclass
class CheckOptions:
    target: str  # module:Class, module:factory, textarena:GAME-ID or openspiel:GAME
    args: dict[str, Any] = field(default_factory=dict)  # the env's keyword arguments
    games: int = 4
    model: str | None = None  # a model dir or alias; None: a tiny random model built for the check
    run_dir: Path | None = None  # keep the server's data dir and log, games.jsonl and topology.yaml here
    max_tokens: int = 32  # longest reply per turn


def parse_env_args(words: Sequence[str]) -> dict[str, Any]:
    """`--args`: one JSON object, or `key=value` words whose values read as YAML (`num_items=3`,
    `game_args={max_rounds: 1}`, `name=cat`); UsageError otherwise."""
    if len(words) == 1 and words[0].lstrip().startswith("{"):
        try:
            value = json.loads(words[0])
        except json.JSONDecodeError as exc:
            raise UsageError(f"--args {words[0]!r} is not a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise UsageError(f"--args {words[0]!r} is not a JSON object")
        return value
    args: dict[str, Any] = {}
    for word in words:
        key, sep, text = word.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--args {word!r}: expected key=value (or one JSON object)")
        try:
            args[key] = yaml.safe_load(text) if text else ""
        except yaml.YAMLError as exc:
            raise UsageError(f"--args {word!r}: the value does not read as YAML: {exc}") from None
    return args


def env_section(target: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """The topology's `env:` for TARGET: `textarena: GAME-ID` / `openspiel: GAME`, else `class: TARGET`."""
    suite, sep, game = target.partition(":")
    if sep and suite in SUITES:
        if not game:
            raise UsageError(f"{target!r}: name the game after '{suite}:', e.g. {_SUITE_EXAMPLES[suite]}")
        return {suite: game, "args": dict(args)}
    return {"class": target, "args": dict(args)}


_SUITE_EXAMPLES = {"textarena": "textarena:KuhnPoker-v0", "openspiel": "openspiel:kuhn_poker"}


def load_env(section: Mapping[str, Any]) -> tuple[Callable[..., Any], dict[str, Any], dict[str, int]]:
    """Import and construct the env of `section` and ask it its roles: (factory, its keyword arguments, role ->
    agents dealt it). UsageError for what the user typed (a target that does not import, an argument the env does
    not take or refuses), CheckFailed for what the env does wrong."""
    from pydantic import ValidationError

    from marl.topology.importing import import_env_factory
    from marl.topology.spec import EnvSpec

    try:
        spec = EnvSpec.model_validate(section)
    except ValidationError as exc:
        raise UsageError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
    try:
        factory = import_env_factory(spec.class_path)
    except ImportError as exc:
        raise UsageError(str(exc)) from None
    _check_arguments(factory, spec.args)
    env = _construct(factory, spec.args)
    try:
        dealt = env.dealt_roles()
        roles = {str(role): int(info.count) for role, info in dealt.items()}
    except Exception as exc:  # noqa: BLE001 - the env's bug is the verdict
        raise CheckFailed(f"{type(env).__name__}.dealt_roles() raised {type(exc).__name__}: {exc}") from None
    finally:
        _close(env)
    if not roles:
        raise CheckFailed(f"{type(env).__name__}.dealt_roles() deals no role")
    return factory, spec.args, roles


def _check_arguments(factory: Callable[..., Any], args: Mapping[str, Any]) -> None:
    """Each key of `args` one the env takes (as a topology's `env.args` is checked); UsageError naming the first
    that is not, with the closest name."""
    from marl.topology.problems import did_you_mean

    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # nothing to read: the call will tell
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in args:
        if key not in names:
            name = getattr(factory, "__qualname__", repr(factory))
            raise UsageError(f"--args {key}: {name}() takes no argument {key!r}{did_you_mean(key, names)}; its"
                             f" arguments: {', '.join(names) or '(none)'}")


def _construct(factory: Callable[..., Any], args: Mapping[str, Any]) -> Any:
    try:
        return factory(**args)
    except ImportError as exc:  # a suite's package is missing: `pip install 'marl[textarena]'`
        raise UsageError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001
        if isinstance(getattr(exc, "arg", None), str):  # an env's refusal of an argument (a game id, a count)
            raise UsageError(str(exc)) from None
        raise CheckFailed(f"constructing the env raised {type(exc).__name__}: {exc}") from None


def run_api_test(factory: Callable[..., Any], args: Mapping[str, Any]) -> None:
    """PettingZoo's `api_test` on a fresh env; CheckFailed with its complaint. Its progress lines and its warnings
    about text spaces (not Box or Discrete) are kept quiet."""
    from pettingzoo.test import api_test

    env = factory(**args)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            api_test(env, num_cycles=200)
    except Exception as exc:  # noqa: BLE001 - api_test's assertion is the verdict
        raise CheckFailed(f"api_test: {type(exc).__name__}: {exc or 'an assertion failed'}") from None
    finally:
        _close(env)


def _close(env: Any) -> None:
    with contextlib.suppress(Exception):
        env.close()
