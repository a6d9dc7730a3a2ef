"""What goes wrong when loading a topology: `Problem` (one thing, at one YAML key) and `TopologyError` (all of them)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a topology."""

    key: str  # dotted YAML path, e.g. "roles.listener.server"; "" for the whole file
    message: str  # what is wrong and how to fix it
    where: str = ""  # "file.yaml:12", "override 'run.max_steps=x'", "file.yaml", or "" (from_dict)

    def __str__(self) -> str:
        parts = [p for p in (self.where, self.key) if p]
        return ": ".join([*parts, self.message])


class TopologyError(ValueError):
    """A topology that cannot be loaded. `problems` lists every problem found; the message shows them all."""

    def __init__(self, problems: Sequence[Problem], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        what = f"topology {source}" if source else "topology"
        if len(self.problems) == 1:
            only = self.problems[0]
            text = str(only) if source and only.where.startswith(source) else f"invalid {what}: {only}"
        else:
            text = f"invalid {what} ({len(self.problems)} problems):\n" + "\n".join(f"  {p}" for p in self.problems)
        super().__init__(text)


def did_you_mean(word: object, candidates: Iterable[str]) -> str:
    """" (did you mean 'x'?)" for the candidate closest to `word`, or "" when none is close."""
    close = difflib.get_close_matches(str(word), list(candidates), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def short(value: Any, limit: int = 60) -> str:
    """`repr(value)`, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
