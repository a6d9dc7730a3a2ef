"""Where a key is: `Locator` finds the YAML line (or the command-line override) that set a key, and turns pydantic's
validation errors into `Problem`s that name their key, say what to fix, and point there.

omegaconf keeps no line numbers, so the file is composed again with PyYAML to find them.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Sequence
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .problems import Problem, did_you_mean, short
from .spec import RULE_ERROR, TopologySpec

# Hints appended to "required key is missing" errors.
_MISSING_HINTS = {
    "name": "give the topology a name, e.g. name: my-experiment",
    "roles": "list who plays what, e.g. roles: {speaker: {server: speaker_model}}",
    "env": "name the environment, e.g. env: {class: envs.signalling:SignallingGame, args: {}}",
    "env.class": "give the env's import path 'module:Class' or 'module:factory', e.g."
                 " class: envs.signalling:SignallingGame",
}
# What an object is called in "the keys of ... are" hints.
_OBJECT_NAMES = {"ServerSpec": "a server", "RoleSpec": "a role", "EnvSpec": "env", "RunSpec": "run",
                 "TrainConfig": "train (a TrainConfig)", "TopologySpec": "a topology"}


class Locator:
    """Finds where the value at a key path came from: an override (`key=value` on the command line) or a line."""

    def __init__(self, source: str | None, text: str | None, overrides: Sequence[tuple[str, str]] = ()):
        self.source = source
        self.overrides = list(overrides)  # (key, original text)
        self.root = None
        if text is not None:
            try:
                self.root = yaml.compose(text, Loader=yaml.SafeLoader)
            except yaml.YAMLError:
                self.root = None

    def _line(self, parts: Sequence[str]) -> tuple[int | None, bool]:
        """(line of the deepest key of `parts` found in the file, whether all of `parts` was found)."""
        node = self.root
        if node is None:
            return None, False
        line = node.start_mark.line + 1
        for part in parts:
            if isinstance(node, yaml.MappingNode):
                for key_node, value_node in node.value:
                    if str(key_node.value) == part:
                        line, node = key_node.start_mark.line + 1, value_node
                        break
                else:
                    return line, False
            elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
                node = node.value[int(part)]
                line = node.start_mark.line + 1
            else:
                return line, False
        return line, True

    def where(self, parts: Sequence[Any]) -> str:
        """Where the value at `parts` came from: the override that set it (or something inside it, when the key is
        not in the file), else the file and line."""
        parts = [str(p) for p in parts]
        line, found = self._line(parts)
        for key, text in reversed(self.overrides):  # the last override of a key wins, as in the merge
            kparts = key.split(".")
            if parts[:len(kparts)] == kparts or (parts and kparts[:len(parts)] == parts and not found):
                return f"override {text!r}"
        if self.source is None:
            return ""
        return f"{self.source}:{line}" if line else self.source

    def problem(self, parts: Sequence[Any], message: str) -> Problem:
        return Problem(".".join(str(p) for p in parts), message, self.where(parts))


def pydantic_problems(exc: ValidationError, locator: Locator) -> list[Problem]:
    """One `Problem` per pydantic error, at its key, in words that say how to fix it."""
    problems = []
    for err in exc.errors(include_url=False):
        loc = [p for p in err["loc"] if p != "[key]"]
        kind = err["type"]
        if kind == RULE_ERROR:  # the spec's own rules already say what to do
            msg = err["msg"]
        elif kind == "extra_forbidden":
            msg = _unknown_key_message(loc)
        elif kind == "missing":
            dotted = ".".join(str(p) for p in loc)
            hint = _MISSING_HINTS.get(dotted) or _MISSING_HINTS.get(str(loc[-1]) if loc else "", "")
            msg = "required key is missing" + (f": {hint}" if hint else "")
        else:
            msg = f"{err['msg']} (got {short(err.get('input'))})"
        problems.append(locator.problem(loc, msg))
    return problems


def _unknown_key_message(loc: Sequence[Any]) -> str:
    model = _model_at(loc[:-1])
    allowed = [f.alias or n for n, f in model.model_fields.items()] if model else []
    here = _OBJECT_NAMES.get(model.__name__, model.__name__) if model else "here"
    msg = f"unknown key {str(loc[-1])!r}{did_you_mean(loc[-1], allowed)}"
    return msg + (f"; the keys of {here} are: {', '.join(allowed)}" if allowed else "")


def _model_at(loc: Sequence[Any]) -> type[BaseModel] | None:
    """The pydantic model of the object at `loc` in a TopologySpec (None if it is not a model)."""
    tp: Any = TopologySpec
    for part in loc:
        tp = _unwrap(tp)
        if inspect.isclass(tp) and issubclass(tp, BaseModel):
            field = next((f for n, f in tp.model_fields.items() if part in (n, f.alias)), None)
            if field is None:
                return None
            tp = field.annotation
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        else:
            return None
    tp = _unwrap(tp)
    return tp if inspect.isclass(tp) and issubclass(tp, BaseModel) else None


def _unwrap(tp: Any) -> Any:
    """`X | None` -> X."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp
