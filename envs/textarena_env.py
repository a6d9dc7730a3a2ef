"""`TextArenaEnv`: any TextArena game (`pip install 'marl[textarena]'`, textarena 0.7.4) as a marl text game.

    env = TextArenaEnv("KuhnPoker-v0")                       # roles player_0, player_1 (one per seat)
    env = TextArenaEnv("SecretMafia-v0", num_players=6)      # roles mafia (team mafia), villager, doctor,
                                                             # detective (team village), dealt by the game's seed

In a topology: `env: {textarena: SecretMafia-v0, args: {num_players: 6}}` (docs/envs.md, "TextArena games").

- **Agents** are TextArena's players: `player_0` ... `player_{n-1}` ("Player 0" in TextArena's text). With
  `rotate_seats=True` agent `player_i` sits in TextArena's seat (i + seed) mod n instead, so that over games each
  agent plays every seat (in Kuhn Poker the one who opens); `summary()["seats"]` says where each sat.
- **Roles**: a game that deals secret roles (TextArena's `game_info[pid]["role"]` after reset) deals them as marl
  roles, named in lower case (`Mafia` -> `mafia`), in the team the game gives the role (Secret Mafia's `Role.team`)
  or `teams={role: team}`. Other games have one role per seat (`player_0`, ...), or one role for every seat with
  `shared_role="player"`. `dealt_roles()` comes from one reset of the game, made at construction.
- **Observations** are TextArena's messages, formatted as its LLM wrapper does (`[GAME] ...`, `[Player 1] ...`):
  each turn the messages the agent received since its last turn (its first turn starts with the game's rules). The
  system prompt is TextArena's own (`STANDARD_GAME_PROMPT` of its agents).
- **Moves** are free text, stepped through the game id's own action wrappers (most add missing brackets). Whether
  a move is invalid is TextArena's call (`State.set_invalid_move`): its retry message, its penalty and its ending
  apply, and the move is counted in `invalid_actions` / `invalid_actions_by_role` like marl's own envs.
- **Rewards** are TextArena's final rewards (`state.rewards`), at the last move; `winner` is the team whose agents
  got the top reward (`draw` when all are equal).
- **Seeds**: TextArena draws from Python's global `random`, which it seeds at reset. Each env keeps its own state
  of that generator and swaps it in, under one lock, around every call into TextArena, so games in threads
  do not disturb each other and a seed replays the same game.

This module imports textarena lazily (at construction), so `envs` imports without it. It never imports `marl/`.
"""

from __future__ import annotations

import functools
import json
import random
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from envs.base import RoleInfo, TextAECEnv, count_roles, printable

__all__ = ["GAMES_NEEDING_NETWORK", "GameRefused", "TextArenaEnv", "textarena_problem"]

#: TextArena's system prompt for its players (textarena/agents/basic_agents.py), used when it cannot be imported.
STANDARD_GAME_PROMPT = ("You are a competitive game player. Make sure you read the game instructions carefully, and"
                        " always follow the required format.")
#: Games (by base name) that reach the internet when they run, in textarena 0.7.4 (measured, docs/envs.md).
GAMES_NEEDING_NETWORK = {
    "Codenames": "downloads NLTK corpora from the internet at reset",
    "WordChains": "downloads NLTK corpora from the internet at reset",
    "Debate": "its judge calls OpenRouter (an API key and the internet)",
}
#: Player counts tried, in order, when `num_players` is not given.
DEFAULT_PLAYER_COUNTS = (2, 1)
_SCRIPTED_SPEECH = "I have nothing to add."
_BRACKETED = re.compile(r"\[[^\[\]\n]{1,40}\]")
_PLACEHOLDER = re.compile(r"^\[(?:.*\bX\b.*|\.\.\.)\]$")  # "[X]", "[Player X]": a format, not a move
_RANDOM_LOCK = threading.RLock()  # TextArena uses the global `random`: one game's call at a time swaps its state in


class GameRefused(ValueError):
    """A game id or player count TextArena refuses; `arg` is the argument to fix (`game` or `num_players`)."""

    def __init__(self, arg: str, message: str):
        super().__init__(message)
        self.arg = arg


@dataclass(frozen=True)
class _Probe:
    """What one reset of a game says, before any game is played: its seats and the roles it deals."""

    num_players: int
    roles: tuple[str | None, ...]  # per seat: the dealt role (marl's name), None where the game deals none
    teams: tuple[tuple[str, str], ...]  # role -> team, as the game says


class TextArenaEnv(TextAECEnv):
    """A TextArena game as a `TextAECEnv`; see the module docstring."""

    def __init__(self, game: str, num_players: int | None = None, *, shared_role: str | None = None,
                 teams: Mapping[str, str] | None = None, game_args: Mapping[str, Any] | None = None,
                 rotate_seats: bool = False, allow_network: bool = False, max_moves: int = 1000,
                 render_mode: str | None = None):  # fmt: skip
        if problem := textarena_problem(game, allow_network=allow_network):
            raise GameRefused("game", problem)
        self.game, self.game_args = game, dict(game_args or {})
        self._probe = _probe(game, num_players, json.dumps(self.game_args, sort_keys=True))
        self.possible_agents = [f"player_{pid}" for pid in range(self._probe.num_players)]
        self.metadata = {**TextAECEnv.metadata, "name": f"textarena_{game}"}
        super().__init__(render_mode=render_mode)
        self.shared_role, self.teams = shared_role, {**dict(self._probe.teams), **dict(teams or {})}
        self.max_steps, self.rotate_seats = max_moves, rotate_seats
        self._seats = dict(enumerate(self.possible_agents))  # TextArena's player id -> the agent there this game
        self._ta: Any = None
        self._random_state: Any = None
        self._roles: dict[str, str] = {}
        self._news: dict[str, list[tuple[int, str, str]]] = {}  # agent -> (sender, text, kind) since its last turn
        self._moves: dict[str, list[str]] = {}
        self._invalid_calls = 0
        self.final_rewards: dict[str, float] = {}
        self.game_info: dict[str, dict[str, Any]] = {}

    # --- roles ---------------------------------------------------------------------------------------------------

    def role_of(self, agent: str) -> str:
        if self.shared_role is not None:
            return self.shared_role
        if any(self._probe.roles):
            if not self._roles:
                raise RuntimeError(f"{self.game} deals roles at reset(): call reset() first")
            return self._roles[agent]
        return agent

    def team_of(self, agent: str) -> str:
        role = self.role_of(agent)
        return self.teams.get(role, role)

    def dealt_roles(self) -> dict[str, RoleInfo]:
        if self.shared_role is not None or not any(self._probe.roles):
            return count_roles(self.possible_agents, self.role_of, self.team_of)
        counts: dict[str, int] = {}
        for role in self._probe.roles:
            counts[str(role)] = counts.get(str(role), 0) + 1
        return {role: RoleInfo(team=self.teams.get(role, role), count=n) for role, n in sorted(counts.items())}

    def system_prompt(self, agent: str) -> str:
        try:
            from textarena.agents.basic_agents import STANDARD_GAME_PROMPT as prompt
        except ImportError:
            prompt = STANDARD_GAME_PROMPT
        return prompt

    # --- the game ------------------------------------------------------------------------------------------------

    def _reset_game(self, seed: int | None, options: dict | None) -> None:
        seed = self.rng.randrange(2**31) if seed is None else seed
        self._random_state = random.Random(seed).getstate()
        # Rotated, agent i sits in seat (i + seed) mod n: each role plays every position (a first mover's edge too)
        n = len(self.possible_agents)
        offset = seed % n if self.rotate_seats else 0
        self._seats = {pid: self.possible_agents[(pid - offset) % n] for pid in range(n)}
        self._ta = _make(self.game, self.game_args)
        with self._own_random():
            self._ta.reset(num_players=n, seed=seed)
        state = self._ta.state
        self._count_invalid_moves(state)
        self._roles = {self._seats[pid]: _role_name(info.get("role"), pid) for pid, info in state.game_info.items()}
        self._news = {a: [] for a in self.possible_agents}
        self._moves = {a: [] for a in self.possible_agents}
        self.final_rewards, self.game_info, self.winner = {}, {}, None
        self._drain()
        self.agent_selection = self._seats[state.current_player_id]

    def _count_invalid_moves(self, state: Any) -> None:
        """Count every invalid move TextArena declares (its `set_invalid_move`, on this game's state)."""
        declare = state.set_invalid_move

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._invalid_calls += 1
            return declare(*args, **kwargs)
        state.set_invalid_move = counted

    @contextmanager
    def _own_random(self) -> Iterator[None]:
        with _RANDOM_LOCK:
            outer = random.getstate()
            random.setstate(self._random_state)
            try:
                yield
            finally:
                self._random_state = random.getstate()
                random.setstate(outer)

    def _observe_text(self, agent: str) -> str:
        lines = [f"[{sender}] {text}" for sender, text, _ in self._news.get(agent, [])]
        if not lines and agent == self.agent_selection:
            return "[GAME] It is your turn."  # nothing new since its last move (rare): still a user message
        return "\n".join(lines)

    def _parse(self, agent: str, text: str) -> str:
        return printable(text).strip()  # any text is a move: TextArena judges it (an empty one too)

    def _apply(self, agent: str, action: Any) -> None:
        self._news[agent] = []
        before = self._invalid_calls
        with self._own_random():
            done, _ = self._ta.step(str(action))
        invalid = self._invalid_calls > before
        if invalid:
            self._invalid.invalid[agent] += 1
        self._moves[agent].append("invalid" if invalid else _move_label(str(action)))
        self._drain()
        state = self._ta.state
        if done or state.done:
            self._finish(state)
        else:
            self.agent_selection = self._seats[state.current_player_id]

    def _drain(self) -> None:
        """Move every player's new TextArena messages into its news (TextArena hands out only the current player's)."""
        state = self._ta.state
        for pid, messages in state.observations.items():
            agent = self._seats.get(pid)
            if agent in self._news:
                for sender, text, kind in messages:
                    self._news[agent].append((_sender(state, sender), str(text), getattr(kind, "name", str(kind))))
            messages.clear()

    def _finish(self, state: Any) -> None:
        rewards = state.rewards or {}
        self.final_rewards = {self._seats[pid]: float(r) for pid, r in rewards.items()}
        self.game_info = {self._seats[pid]: dict(info) for pid, info in state.game_info.items()}
        for agent in self.agents:
            self.rewards[agent] = self.final_rewards.get(agent, 0.0)
            self.terminations[agent] = True
        self.winner = self._winning_team()

    def _winning_team(self) -> str | None:
        if not self.final_rewards:
            return None
        top = max(self.final_rewards.values())
        if all(r == top for r in self.final_rewards.values()):
            return "draw"
        teams = {self.team_of(a) for a, r in self.final_rewards.items() if r == top}
        return teams.pop() if len(teams) == 1 else None

    # --- what the game was ---------------------------------------------------------------------------------------

    def goal_met(self, agent: str) -> bool | None:
        """Won: the agent's team is the winner (None before the end, or when several teams share the top)."""
        if self.winner is None:
            return None
        return self.winner != "draw" and self.team_of(agent) == self.winner

    def action_labels(self) -> dict[str, list[str]]:
        """Each agent's moves as the bracketed move it made, lower case (`[bet]`, `[player 3]`), `talk` for text
        without one, `invalid` for a move TextArena refused."""
        return {agent: list(moves) for agent, moves in self._moves.items() if moves}

    def summary(self) -> dict[str, Any]:
        """The roles dealt, the deaths (TextArena's messages of players killed or eliminated), the winner, the reason
        TextArena gives, and its rewards."""
        if self._ta is None:
            return {}
        out: dict[str, Any] = {"game": self.game, "roles": {a: self.role_of(a) for a in self.possible_agents}}
        if self.rotate_seats:
            out["seats"] = {agent: f"Player {pid}" for pid, agent in self._seats.items()}
        deaths = []
        for sender, text in self._ta.state.logs:
            death = re.match(r"Player (\d+) (?:was|has been) (?:killed|eliminated)", str(text))
            if sender == _GAME_ID and death:
                deaths.append(f"{printable(text).rstrip('.')} ({self.role_of(self._seats[int(death.group(1))])})")
        if deaths:
            out["deaths"] = deaths
        reasons = {str(info.get("reason")) for info in self.game_info.values() if info.get("reason")}
        out.update(winner=self.winner, reason="; ".join(sorted(reasons)) or None, rewards=self.final_rewards)
        invalid = [a for a, info in self.game_info.items() if info.get("invalid_move")]
        if invalid:
            out["penalized_for_invalid_moves"] = invalid
        return out

    def scripted_action(self, agent: str) -> str:
        """A random bracketed move from the latest game message that offers some (`[check]`, `[3]`), drawn from
        `self.rng`; on a turn that offers none (speech), a fixed line."""
        for sender, text, kind in reversed(self._news.get(agent, [])):
            if sender == "GAME" and kind != "GAME_ADMIN":
                moves = [m for m in _BRACKETED.findall(text) if not _PLACEHOLDER.match(m)]
                if moves:
                    return self.rng.choice(moves)
        return _SCRIPTED_SPEECH


_GAME_ID = -1  # TextArena's sender id of game messages (textarena.core.GAME_ID)


def _sender(state: Any, sender: int) -> str:
    if sender == _GAME_ID:
        return "GAME"
    return str(getattr(state, "role_mapping", {}).get(sender, f"Player {sender}"))


def _role_name(role: Any, pid: int) -> str | None:
    """marl's name of a role TextArena dealt ("Mafia" -> "mafia"); None for the default "Player N" (no role)."""
    if role is None or str(role) == f"Player {pid}":
        return None
    return re.sub(r"[^a-z0-9_-]+", "_", str(role).strip().lower()).strip("_") or None


def _move_label(action: str) -> str:
    moves = [m.lower() for m in _BRACKETED.findall(action) if m.lower() != "[game]"]  # "[GAME]": a copied sender
    return moves[0] if moves else "talk"


def _import_textarena() -> Any:
    try:
        import textarena
    except ImportError as exc:
        missing = ImportError(f"TextArena games need textarena: pip install 'marl[textarena]' ({exc})")
        missing.arg = "game"  # type: ignore[attr-defined]  # reported at env.textarena (marl/topology/env_contract.py)
        raise missing from exc
    return textarena


def textarena_problem(game: str, *, allow_network: bool = False) -> str | None:
    """Why `game` cannot be played here (None: it can): not a TextArena id, or one that needs the internet."""
    registry = _import_textarena().envs.registration.ENV_REGISTRY
    if game not in registry:
        import difflib
        close = difflib.get_close_matches(game, list(registry), n=3)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        return f"{game!r} is not a TextArena game id{hint}; textarena.envs.registration.ENV_REGISTRY lists them"
    base = game.split("-v")[0]
    if base in GAMES_NEEDING_NETWORK and not allow_network:
        return (f"{game} cannot run offline: it {GAMES_NEEDING_NETWORK[base]}; pass allow_network: true where the"
                " machine reaches the internet")
    return None


def _make(game: str, game_args: Mapping[str, Any]) -> Any:
    try:
        return _import_textarena().make(game, **game_args)
    except SyntaxError as exc:  # textarena 0.7.4 has games written in Python 3.12's f-string syntax
        raise GameRefused("game", f"{game} needs a newer Python: its module does not parse here ({exc.msg},"
                                  f" {exc.filename}:{exc.lineno})") from exc
    except TypeError as exc:
        raise GameRefused("game_args", f"{game} refuses game_args {dict(game_args)}: {exc}") from exc


@functools.lru_cache(maxsize=64)
def _probe(game: str, num_players: int | None, game_args_json: str) -> _Probe:
    """Reset the game once (seed 0) to learn its seats and the roles it deals; refuse a player count it refuses."""
    game_args = json.loads(game_args_json)
    counts = DEFAULT_PLAYER_COUNTS if num_players is None else (num_players,)
    refusals = []
    for n in counts:
        env = _make(game, game_args)
        with _RANDOM_LOCK:
            outer = random.getstate()
            try:
                env.reset(num_players=n, seed=0)
            except (AssertionError, ValueError) as exc:
                refusals.append(f"{n} players ({type(exc).__name__}: {exc})")
                continue
            finally:
                random.setstate(outer)
        return _Probe(n, *_dealt(env, n))
    if num_players is None:
        raise GameRefused("num_players", f"{game} refuses {' and '.join(refusals)}: set num_players")
    raise GameRefused("num_players", f"{game} refuses {refusals[0]}")


def _dealt(env: Any, num_players: int) -> tuple[tuple[str | None, ...], tuple[tuple[str, str], ...]]:
    """Each seat's dealt role after a reset, and each role's team where the game says (`env.roles[pid].team`)."""
    info = env.state.game_info
    roles = tuple(_role_name(info.get(pid, {}).get("role"), pid) for pid in range(num_players))
    role_objects = getattr(env, "roles", None)  # a textarena.Wrapper passes attributes on to the game
    teams = {}
    for pid, role in enumerate(roles):
        team = getattr((role_objects or {}).get(pid), "team", None) if isinstance(role_objects, Mapping) else None
        if role is not None and team:
            teams[role] = _role_name(team, -1) or role
    return roles, tuple(sorted(teams.items()))
