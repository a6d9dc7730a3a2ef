"""Games, from scheduling to reading them back: many games (`schedule`: `play_games`, `tasks`, retries and the
failure budget), one game at its table (`table`: seats, players, the transcript), the `games.jsonl` row (`record`)
and `marl games` (`view`).

Until the next release `marl.games.<name>` still finds what `marl/games.py` held (now `marl.games.schedule`), with a
DeprecationWarning; `from marl import play_games` is the stable path.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    schedule = importlib.import_module("marl.games.schedule")
    if name.startswith("__") or not hasattr(schedule, name):
        raise AttributeError(f"module 'marl.games' has no attribute {name!r}")
    warnings.warn(f"marl.games.{name} moved to marl.games.schedule.{name}; import it from there or from marl "
                  "(the old path goes in the next release)", DeprecationWarning, stacklevel=2)
    return getattr(schedule, name)
