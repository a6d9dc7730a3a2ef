"""`GameRecord`: one finished game, as the coordinator returns it and `marl run` writes it (a line of games.jsonl).

Written by `marl/run.py` (`append_game`); read by `marl/plot.py` (curves, the per-role summary) and
`bench/run_report.py` (`read_games`), and by `marl eval` (marl/eval/). Only `role_rewards` is required: rows written
by older versions lack the newer fields (`replies`, `winner`, `teams`, `co_players`, ...) and read with the defaults
below, which mean "not recorded". Unknown keys are ignored, so a newer row still reads here. A line torn by a crash
is skipped.

`co_players` is the game's provenance: who played each role, at which policy version. The coordinator also commits
it with every trainable server's episode (the episode's metadata, key `co_players`), so each server's samples say
whom they were played against.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["CoPlayer", "GameRecord", "append_game", "as_records", "read_games"]


class CoPlayer(BaseModel):
    """Who played one role in one game."""

    model_config = ConfigDict(extra="ignore")

    server: str | None = None  # the topology server (None: the env's scripted policy)
    policy_version: int | None = None  # the weights that played; None: scripted, or a static model of unknown version
    snapshot_of: str | None = None  # a past checkpoint of this trainable server played (eval, past_of opponents)


class GameRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role_rewards: dict[str, float]  # mean over the agents of each role
    task_id: str = ""
    seed: int | None = None
    agent_rewards: dict[str, float] = {}  # per env agent
    episodes: dict[str, str] = {}  # server -> episode id
    policy_versions: dict[str, int] = {}  # server -> the version that played this game
    invalid_actions: dict[str, int] = {}  # per role
    replies: dict[str, int] = {}  # per role, valid or not (the valid-reply rate is 1 - invalid / replies)
    seconds: float = 0.0
    turns: int = 0
    winner: str | None = None  # the team that won, if the game has that notion
    teams: dict[str, str] = {}  # role -> its team this game
    time: float | None = None  # unix time the game finished (None: not recorded)
    co_players: dict[str, CoPlayer] = {}  # role -> who played it (every role of the game)


def append_game(file: IO[str], record: GameRecord) -> None:
    """One line of games.jsonl, flushed: a reader (or a crash) sees whole games only."""
    file.write(record.model_dump_json() + "\n")
    file.flush()


def read_games(path: Path) -> list[GameRecord]:
    """Every game of a games.jsonl (empty if the file does not exist yet); lines that do not parse are skipped."""
    path = Path(path)
    if not path.exists():
        return []
    games = []
    for line in path.read_text().splitlines():
        try:
            games.append(GameRecord.model_validate(json.loads(line)))
        except (json.JSONDecodeError, ValidationError):
            continue  # a line torn by a crash
    return games


def as_records(games: Iterable[GameRecord | Mapping[str, Any]]) -> list[GameRecord]:
    """Records from records or from games.jsonl rows already parsed as dicts."""
    return [g if isinstance(g, GameRecord) else GameRecord.model_validate(g) for g in games]
