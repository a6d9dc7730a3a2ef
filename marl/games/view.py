"""`marl games show RUN_DIR [N]` and `marl games list RUN_DIR`: read the games of a run from its games.jsonl.

    marl games list runs/signalling-cpu            # the last 20 games, one line each, with their row numbers
    marl games show runs/signalling-cpu            # the latest game: header, the env's summary, turn by turn
    marl games show runs/signalling-cpu 412        # row 412 (0 is the first row; -2 the one before the latest)
    marl games show runs/signalling-cpu sig-17     # the latest game of task sig-17 (GRPO repeats share a task id)

A game's turns and summary are there as `run.transcripts` kept them (marl/games/record.py); rows written before
transcripts were recorded show their header only. Everything a client or an env wrote (tags, ids, observations,
replies) goes through `marl.watching.terminal.safe`: a reply cannot put escape sequences on the operator's terminal.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from marl.games.record import ROW_CHARS, GameRecord, read_games
from marl.watching.terminal import safe

__all__ = ["GamesViewError", "game_line", "list_games", "pick_game", "render_game", "show_game"]


class GamesViewError(ValueError):
    """Bad arguments: the message says what to pass instead."""


def games_file(run_dir: Path) -> Path:
    """The games.jsonl of a run directory (or the file itself)."""
    path = Path(run_dir)
    path = path / "games.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise GamesViewError(f"no games at {path}: pass a run directory (runs/<name>, where `marl run` writes"
                             " games.jsonl) or a games.jsonl")
    return path


def load_games(run_dir: Path) -> list[GameRecord]:
    games = read_games(games_file(run_dir))
    if not games:
        raise GamesViewError(f"no games in {games_file(run_dir)} yet")
    return games


def pick_game(games: list[GameRecord], which: str | None) -> int:
    """The row index `which` names: None the latest; an integer a row (negative: from the end); else a task id (its
    latest game)."""
    if which is None:
        return len(games) - 1
    try:
        index = int(which)
    except ValueError:
        rows = [i for i, game in enumerate(games) if game.task_id == which]
        if not rows:
            raise GamesViewError(
                f"no game of task {safe(which)!r} and not a row number (0 to {len(games) - 1})") from None
        return rows[-1]
    if not -len(games) <= index < len(games):
        raise GamesViewError(f"no row {index}: the run has {len(games)} games (rows 0 to {len(games) - 1},"
                             " or -1 for the latest)")
    return index % len(games)


def show_game(run_dir: Path, which: str | None = None, console: Console | None = None) -> None:
    """Print one game of a run (default: the latest)."""
    console = console or _console()
    games = load_games(run_dir)
    index = pick_game(games, which)
    same_task = [i for i, game in enumerate(games) if game.task_id == games[index].task_id]
    console.print(render_game(games[index], index, len(games), same_task), soft_wrap=True)


def list_games(run_dir: Path, limit: int = 20, console: Console | None = None) -> None:
    """One line per game, the latest `limit` of them, oldest first (the latest is last, nearest the prompt)."""
    console = console or _console()
    games = load_games(run_dir)
    start = max(0, len(games) - limit)
    for index in range(start, len(games)):
        console.print(game_line(games[index], index), soft_wrap=True)
    console.print(Text(f"{len(games)} games in {games_file(run_dir)}; `marl games show {run_dir} N` shows row N",
                       style="dim"), soft_wrap=True)


def _console() -> Console:
    return Console(highlight=False)


# --- one game ------------------------------------------------------------------------------------------------------


def game_line(game: GameRecord, index: int) -> Text:
    """A game in one line: row, task, when, rewards, winner, turns, who played."""
    line = Text(f"{index:>5}  ", style="bold")
    line.append(f"{safe(game.task_id) or '-'}  {_when(game.time)}  ")
    line.append(_rewards(game), style="cyan")
    if game.winner is not None:
        line.append(f"  winner {safe(game.winner)}", style="green")
    line.append(f"  {game.turns} turns  {_players(game)}", style="dim")
    return line


def render_game(game: GameRecord, index: int, total: int, same_task: list[int] | None = None) -> Text:
    """The header, the env's summary, then turn by turn who said what."""
    text = _header(game, index, total, same_task or [index])
    if game.summary:
        text.append("\nsummary\n", style="bold underline")
        width = max(10, *(len(key) + 1 for key in game.summary))
        for key, value in game.summary.items():
            text.append_text(_field(safe(key), _value_text(value), width))
    text.append_text(_transcript(game))
    return text


def _header(game: GameRecord, index: int, total: int, same_task: list[int]) -> Text:
    head = Text(f"game {index + 1} of {total}", style="bold")  # counted from 1; rows (`show N`) from 0
    head.append(f" (row {index})")
    head.append(f" · task {safe(game.task_id) or '-'} · seed {game.seed} · episode {game.episode} · {_when(game.time)}"
                f" · {game.turns} turns · {game.seconds:.1f}s\n")
    head.append_text(_field("players", _players(game) or "-"))
    head.append_text(_field("rewards", _rewards(game) or "-"))
    if game.winner is not None:
        head.append_text(_field("winner", safe(game.winner)))
    invalid = [f"{safe(role)} {n}/{game.replies.get(role, '?')}" for role, n in game.invalid_actions.items() if n]
    if invalid:
        head.append_text(_field("invalid", ", ".join(invalid) + " replies"))
    if len(same_task) > 1:
        head.append_text(_field("same task", "rows " + ", ".join(map(str, same_task))))
    return head


def _transcript(game: GameRecord) -> Text:
    if game.transcript_mode is None:
        return Text("\nno transcript: this row was written before games.jsonl kept transcripts\n", style="dim")
    if game.transcript_mode == "off":
        return Text("\nno transcript (run.transcripts: off)\n", style="dim")
    text = Text(f"\nturns (run.transcripts: {game.transcript_mode})\n", style="bold underline")
    for number, turn in enumerate(game.transcript, 1):
        text.append(f"{number:>3}. {safe(turn.agent)}", style="bold")
        if turn.role != turn.agent:
            text.append(f" ({safe(turn.role)})", style="bold")
        if turn.invalid:
            text.append("  invalid: asked again or fell back", style="red")
        text.append("\n")
        if turn.observation is not None:
            text.append(_indent(safe(turn.observation, newlines=True), "     | "), style="dim")
        text.append(_indent(safe(turn.action, newlines=True), "     > ", "       "),
                    style="red" if turn.invalid else "bold green")
    if game.omitted_turns:
        text.append(f"... {game.omitted_turns} more turns left out (the row's budget is {ROW_CHARS} characters)\n",
                    style="yellow")
    return text


# --- formatting --------------------------------------------------------------------------------------------------


def _field(name: str, value: str, width: int = 10) -> Text:
    return Text.assemble((f"{name:<{width}}", "bold"), value, "\n")


def _rewards(game: GameRecord) -> str:
    return ", ".join(f"{safe(role)} {reward:g}" for role, reward in game.role_rewards.items())


def _players(game: GameRecord) -> str:
    def one(role: str) -> str:
        player = game.co_players[role]
        version = f" v{player.policy_version}" if player.policy_version is not None else ""
        snapshot = f" (snapshot of {safe(player.snapshot_of)})" if player.snapshot_of else ""
        return f"{safe(role)}: {safe(player.server or 'scripted')}{version}{snapshot}"

    if game.co_players:
        return ", ".join(one(role) for role in game.co_players)
    return ", ".join(f"{safe(server)} v{version}" for server, version in game.policy_versions.items())


def _when(unix: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix)) if unix is not None else "-"


def _value_text(value: Any) -> str:
    """A summary value: text as it is; a list on one line if it is short, else one item a line; a flat mapping as
    key=value pairs; else JSON."""
    if isinstance(value, str):
        return safe(value, newlines=True)
    if isinstance(value, list) and value:
        items = [_compact(item) for item in value]
        flat = all(not isinstance(item, (dict, list)) for item in value)
        return ", ".join(items) if flat and len(", ".join(items)) <= 100 else "\n" + "\n".join(f"  {i}" for i in items)
    if isinstance(value, dict) and all(not isinstance(v, (dict, list)) for v in value.values()):
        return ", ".join(f"{safe(k)}={_compact(v)}" for k, v in value.items())
    return _compact(value)


def _compact(value: Any) -> str:
    return safe(value if isinstance(value, str) else json.dumps(value, separators=(", ", ": ")))


def _indent(text: str, first: str, rest: str | None = None) -> str:
    lines = text.splitlines() or [""]
    rest = first if rest is None else rest
    return "".join(f"{first if i == 0 else rest}{line}\n" for i, line in enumerate(lines))
