"""`GameRecord`: one finished game, as the coordinator returns it and `marl run` writes it (a line of games.jsonl).

Written by `marl/runner/run.py` (`append_game`); read by `marl/watching/plot.py` (curves, the per-role summary) and
`bench/run_report.py` (`read_games`), and by `marl eval` (marl/eval/). Only `role_rewards` is required: rows written
by older versions lack the newer fields (`replies`, `winner`, `teams`, `co_players`, ...) and read with the defaults
below, which mean "not recorded". Unknown keys are ignored, so a newer row still reads here. A line torn by a crash
is skipped.

`sampling` says how each model-played role sampled (temperature, top_p, max_tokens, stop): `run.*`, overridden by
the topology's `roles.R.sampling`; what its seats were given, and what the default `LLMAgent` sends with every call.

`co_players` is the game's provenance: who played each role, at which policy version. The coordinator also commits
it with every trainable server's episode (the episode's metadata, key `co_players`), so each server's samples say
whom they were played against.

`transcript` and `summary` let a person read the game (`marl games show`), bounded by `run.transcripts`:
- `full` (default): every turn's agent, role, observation and action (and `invalid`, when the env counts invalid
  replies), each observation and action cut to `TEXT_CHARS` characters (an observation keeps its end, where the
  question and the options are; an action its start), plus the env's `summary()`. The whole row keeps to
  `ROW_CHARS` characters of text: the summary up to `SUMMARY_CHARS` of JSON (a longer one is replaced by a note),
  the turns the rest, in order; observations that do not fit any more are dropped (None), then whole turns
  (`omitted_turns` counts them).
- `summary`: the env's summary and every turn without its observation.
- `off`: neither.
Text is stored as the agents sent it, control characters included: print it through `marl.watching.terminal.safe`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["CoPlayer", "GameRecord", "Sampling", "TranscriptRecorder", "Turn", "append_game", "as_records",
           "read_games"]

TRANSCRIPT_MODES = ("full", "summary", "off")  # `run.transcripts`
TEXT_CHARS = 2_000  # longest observation or action kept (run.transcripts: full)
SUMMARY_CHARS = 16_000  # longest env summary kept, as JSON; a longer one is replaced by a note
ROW_CHARS = 64_000  # the text budget of one row: summary JSON + observations + actions
TURNS_CHARS = ROW_CHARS - SUMMARY_CHARS  # what the turns may take (the summary comes at the end of the game)


class CoPlayer(BaseModel):
    """Who played one role in one game."""

    model_config = ConfigDict(extra="ignore")

    server: str | None = None  # the topology server (None: the env's scripted policy)
    policy_version: int | None = None  # the weights that played; None: scripted, or a static model of unknown version
    snapshot_of: str | None = None  # a past checkpoint of this trainable server played (eval, past_of opponents)


class Sampling(BaseModel):
    """How one role's model samples each reply: sent with each of its calls, recorded with each game."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float | None = None  # None: not sent (the server's default, 1.0)
    stop: tuple[str, ...] | None = None  # None: not sent (no stop strings)
    choice: bool = False  # each reply held to one of the env's legal moves (`structured_outputs`)

    def request_options(self) -> dict[str, Any]:
        """The chat-completion keyword arguments these settings make (unset ones left out; `choice` is sent as
        `structured_outputs` with the moves of each turn, by the agent)."""
        return self.model_dump(mode="json", exclude_none=True, exclude={"choice"})


class Turn(BaseModel):
    """One turn of a game: who moved, what it was told and what it replied."""

    model_config = ConfigDict(extra="ignore")

    agent: str
    role: str
    action: str  # the reply as sent (cut to TEXT_CHARS)
    observation: str | None = None  # None: not kept (run.transcripts: summary, or past the row's budget)
    invalid: bool | None = None  # the env rejected the reply (asked again or fell back); None: the env does not say
    forced: bool = False  # an exploring start's move (run.explore): drawn by the run, not asked of the player


class GameRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role_rewards: dict[str, float]  # mean over the agents of each role
    task_id: str = ""
    seed: int | None = None
    episode: int = 0  # which repeat of its task (GRPO group) this game was
    agent_rewards: dict[str, float] = {}  # per env agent
    episodes: dict[str, str] = {}  # server -> episode id
    policy_versions: dict[str, int] = {}  # server -> the version that played this game
    invalid_actions: dict[str, int] = {}  # per role
    replies: dict[str, int] = {}  # per role, valid or not (the valid-reply rate is 1 - invalid / replies)
    seconds: float = 0.0
    turns: int = 0
    winner: str | None = None  # the team that won, if the game has that notion
    goals: dict[str, bool] = {}  # role -> whether its goal was met, where the env says (`marl eval`'s win rule)
    actions: dict[str, list[str]] = {}  # role -> what its agents did, as the env's categories (`action_labels`)
    teams: dict[str, str] = {}  # role -> its team this game
    time: float | None = None  # unix time the game finished (None: not recorded)
    co_players: dict[str, CoPlayer] = {}  # role -> who played it (every role of the game)
    sampling: dict[str, Sampling] = {}  # role -> how it sampled (model-played roles; {}: an older row)
    transcript_mode: str | None = None  # run.transcripts when the game was played (None: an older row, no transcript)
    summary: dict[str, Any] = {}  # the env's summary() of the game
    transcript: list[Turn] = []  # every turn, in order (see the module docstring for the bounds)
    omitted_turns: int = 0  # turns left out of `transcript` by the row's budget
    forced_moves: int = 0  # the game's first moves drawn by run.explore instead of asked of its players


class TranscriptRecorder:
    """Collects a game's turns as they are played, within the bounds of `mode` (see the module docstring)."""

    def __init__(self, mode: str = "full"):
        if mode not in TRANSCRIPT_MODES:
            raise ValueError(f"transcripts must be one of {', '.join(TRANSCRIPT_MODES)}; got {mode!r}")
        self.mode = mode
        self.turns: list[Turn] = []
        self.left = TURNS_CHARS  # characters of the turns' budget still free
        self.omitted = 0
        self.summary: dict[str, Any] = {}

    def summarize(self, env: Any) -> None:
        """Keep the env's `summary()` (optional on an env). One that raises is noted, not raised: the game was played
        and its rewards stand."""
        if self.mode == "off" or not hasattr(env, "summary"):
            return
        try:
            self.set_summary(env.summary())
        except Exception as exc:  # noqa: BLE001 - a bug in the env's summary must not cost the game
            self.set_summary({"error": f"{type(env).__name__}.summary() raised {exc!r}"})

    def set_summary(self, summary: Mapping[str, Any]) -> None:
        """The env's summary, as JSON values (anything else as its str), replaced by a note when too long."""
        if self.mode == "off":
            return
        text = json.dumps(dict(summary), default=str)
        if len(text) > SUMMARY_CHARS:
            self.summary = {"omitted": f"the env's summary had {len(text)} characters of JSON, over the limit of"
                                       f" {SUMMARY_CHARS}"}
        else:
            self.summary = json.loads(text)

    def add(self, agent: str, role: str, observation: str, action: str, invalid: bool | None = None,
            forced: bool = False) -> None:
        if self.mode == "off":
            return
        action = _cut(action, keep_end=False)
        kept = _cut(observation, keep_end=True) if self.mode == "full" else None
        if kept is not None and len(kept) + len(action) > self.left:
            kept = None  # over the budget: the action alone, if it still fits
        if len(action) + len(kept or "") > self.left:
            self.omitted += 1
            return
        self.left -= len(action) + len(kept or "")
        self.turns.append(Turn(agent=agent, role=role, observation=kept, action=action, invalid=invalid, forced=forced))

    def fields(self) -> dict[str, Any]:
        """The GameRecord fields of the transcript."""
        return {"transcript_mode": self.mode, "summary": self.summary, "transcript": self.turns,
                "omitted_turns": self.omitted}


def _cut(text: str, *, keep_end: bool) -> str:
    """`text` within TEXT_CHARS: its end (observations: the question is last) or its start (actions)."""
    text = str(text)
    if len(text) <= TEXT_CHARS:
        return text
    return "..." + text[-(TEXT_CHARS - 3):] if keep_end else text[: TEXT_CHARS - 3] + "..."


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
