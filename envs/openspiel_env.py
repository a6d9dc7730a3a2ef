"""`OpenSpielEnv`: any OpenSpiel game with sequential moves as a marl text game (`pip install 'marl[openspiel]'`,
open-spiel 2.0.2).

    env = OpenSpielEnv("kuhn_poker")                              # roles player_0, player_1 (one per player)
    env = OpenSpielEnv("liars_dice", params={"numdice": 2})       # a game's parameters, as pyspiel.load_game takes
    env = OpenSpielEnv("tic_tac_toe", shared_role="player")       # one role for both players

In a topology: `env: {openspiel: kuhn_poker, args: {params: {...}}}` (docs/envs.md, "OpenSpiel games").

- **Agents** are OpenSpiel's players: `player_0` ... `player_{n-1}` ("Player 0" in the text); a role each, or one
  role for all with `shared_role`.
- **Chance** (the deal, the dice) is drawn from the game's seed with the probabilities OpenSpiel gives, so a seed
  replays a game. With `deals="task"` (the default) every repeat of a task (one GRPO group) is dealt the same; with
  `deals="episode"` each repeat is dealt from the seed and its episode number. With `deals="stratified"` a task's
  opening deal (the chance outcomes before the first move) is the one its seed picks by remainder, so consecutive task
  seeds, as `marl run` numbers its tasks, deal every opening in turn and each batch sees them in near-equal shares (a
  lower-variance gradient than drawn deals; only for games whose openings are equally likely, like the poker games'
  deals). The reset option `chance_outcomes`
  (a list of OpenSpiel action ids) deals those instead, in order: how `marl eval --exploitability` reaches an
  information state.
- **Observations** are worded by `envs/openspiel_text.py`: the rules at an agent's first turn (`rules=False`: never;
  a prompt a third as long, for a model too small to read them), what happened since its last turn (the other
  players' moves where they are seen, public cards), its private information, and its legal moves by name
  (OpenSpiel's `action_to_string`, listed unnumbered).
- **Moves** are parsed as a person writes them: the move's name in any case, with brackets or around other words
  ("I [Bet]"), or a common synonym (`check` for Kuhn's Pass). An invalid reply is asked again, then the first legal
  move is played (`max_invalid_retries`), counted in `invalid_actions`; each invalid reply costs `invalid_penalty`
  (default 0) off the agent's return.
- **Rewards** are OpenSpiel's rewards, each move's (so a game's total is its `returns()`: chips in the poker
  games), minus the penalties; `winner` is the agent with the top return (`draw` when every return is equal).
- **Scripted players** are OpenSpiel policies (`scripted_policy`, envs/openspiel_policies.py): uniform random, the
  first legal move, CFR after N iterations, or a fixed table, drawn from the env's own random stream.

Refused, with the reason (`GameRefused`, at `env.openspiel` or `env.args.params` in a topology): names OpenSpiel
does not know, parameters it refuses, simultaneous-move and mean-field games, games whose chance outcomes cannot
be listed (sampled stochastic), and games with no text for their states. This module imports pyspiel lazily (at
construction), so `envs` imports without it. It never imports `marl/`.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

from envs.base import TextAECEnv, count_option, episode_of, match_choice, printable
from envs.openspiel_policies import ScriptedPolicy, scripted_policies
from envs.openspiel_text import GameText, game_text

__all__ = ["CHANCE_OPTION", "DEALS", "GameRefused", "OpenSpielEnv", "equally_likely_openings", "load_game"]

#: The reset option that deals given chance outcomes (OpenSpiel action ids, in order) instead of drawing them.
CHANCE_OPTION = "chance_outcomes"
#: The most openings `deals: stratified` lists (Leduc Poker has 30; a bridge deal, 52!/(13!)^4, is refused).
MAX_OPENINGS = 10_000
DEALS = ("task", "episode", "stratified")  # what chance outcomes are drawn per (stratified: by task, in turn)


class GameRefused(ValueError):
    """A game or parameters OpenSpiel refuses, or a game marl cannot play; `arg` is the argument to fix."""

    def __init__(self, arg: str, message: str):
        super().__init__(message)
        self.arg = arg


class OpenSpielEnv(TextAECEnv):
    """An OpenSpiel game as a `TextAECEnv`; see the module docstring."""

    number_options = False
    choice_prompt = "Reply with one move from the list."

    def __init__(self, game: str, params: Mapping[str, Any] | None = None, *, shared_role: str | None = None,
                 deals: str = "task", invalid_penalty: float = 0.0, max_invalid_retries: int = 2,
                 scripted_policy: str | Mapping[str, Any] = "uniform", rules: bool = True,
                 render_mode: str | None = None):
        if deals not in DEALS:
            raise GameRefused("deals", f"deals must be one of {', '.join(DEALS)}; got {deals!r}")
        if not invalid_penalty >= 0:
            raise GameRefused("invalid_penalty", f"invalid_penalty must be 0 or more; got {invalid_penalty!r}")
        if max_invalid_retries < 0:
            raise GameRefused("max_invalid_retries", f"max_invalid_retries must be 0 or more; got"
                                                     f" {max_invalid_retries}")
        self.game_name, self.params = game, dict(params or {})
        self.game = load_game(game, json.dumps(self.params, sort_keys=True))
        self.possible_agents = [f"player_{p}" for p in range(self.game.num_players())]
        self.metadata = {**TextAECEnv.metadata, "name": f"openspiel_{game}"}
        super().__init__(render_mode=render_mode)
        self.shared_role, self.deals, self.invalid_penalty = shared_role, deals, float(invalid_penalty)
        self.max_invalid_retries, self.tell_rules = max_invalid_retries, rules
        self.text: GameText = game_text(self.game)
        self._openings = equally_likely_openings(self.game) if deals == "stratified" else []
        try:
            self.scripted: dict[str, ScriptedPolicy] = scripted_policies(self.game, scripted_policy,
                                                                         self.possible_agents, self.role_of)
        except ValueError as exc:
            raise GameRefused("scripted_policy", str(exc)) from exc
        self.state: Any = None
        self._chance_rng = random.Random()
        self._forced: list[int] = []
        self._news: dict[str, list[str]] = {}
        self._told_rules: set[str] = set()
        self._moves: dict[str, list[str]] = {}
        self._fallbacks_seen: dict[str, int] = {}
        self.final_rewards: dict[str, float] = {}

    # --- roles ---------------------------------------------------------------------------------------------------

    def role_of(self, agent: str) -> str:
        return self.shared_role if self.shared_role is not None else agent

    def player_of(self, agent: str) -> int:
        """OpenSpiel's player number of `agent`."""
        return self.possible_agents.index(agent)

    def system_prompt(self, agent: str) -> str:
        return (f"You are Player {self.player_of(agent)} in a game of {self.game.get_type().long_name}. Reply with"
                " your move only, as it is listed.")

    # --- the game ------------------------------------------------------------------------------------------------

    def _reset_game(self, seed: int | None, options: dict | None) -> None:
        options = options or {}
        seed = self.rng.randrange(2**31) if seed is None else seed
        episode = episode_of(options) if self.deals == "episode" else 0
        self._chance_rng = random.Random(f"{seed}/{episode}")  # its own stream: scripted draws leave the deal alone
        self._forced = _chance_outcomes(options.get(CHANCE_OPTION))
        if self._openings and not self._forced:
            self._forced = list(self._openings[seed % len(self._openings)])
        self.state = self.game.new_initial_state()
        self._news = {a: [] for a in self.possible_agents}
        self._moves = {a: [] for a in self.possible_agents}
        self._told_rules = set()
        self._fallbacks_seen = {}
        self.final_rewards, self.winner = {}, None
        self._advance()

    def _advance(self) -> None:
        """Play chance nodes until a player moves or the game ends; then select that player or finish."""
        while self.state.is_chance_node():
            action = self._chance_action()
            for viewer, agent in enumerate(self.possible_agents):
                if (told := self.text.chance(self.state, action, viewer)) is not None:
                    self._news[agent].append(told)
            self._play(action)
        if self.state.is_terminal():
            self._finish()
        else:
            self.agent_selection = self.possible_agents[self.state.current_player()]

    def _chance_action(self) -> int:
        outcomes = self.state.chance_outcomes()
        if self._forced:
            action = self._forced.pop(0)
            if action not in dict(outcomes):
                raise ValueError(f"chance outcome {action} is not possible here (possible: {[a for a, _ in outcomes]})")
            return action
        actions, weights = zip(*outcomes)
        return self._chance_rng.choices(actions, weights=weights)[0]

    def _observe_text(self, agent: str) -> str:
        player = self.player_of(agent)
        parts = []
        if self.tell_rules and agent == self.agent_selection and agent not in self._told_rules:
            parts.append(self.text.rules(player))
        parts.extend(self._news.get(agent, []))
        if self.state is not None and not self.state.is_terminal():
            parts.append(self.text.private(self.state, player))
        return "\n".join(part for part in parts if part)

    def _legal_actions(self, agent: str) -> list[str] | None:
        if self.state is None or self.state.is_terminal() or agent != self.agent_selection:
            return []
        player = self.player_of(agent)
        return [self.text.move_name(self.state, player, a) for a in self.state.legal_actions(player)]

    def _parse(self, agent: str, text: str) -> int | None:
        return self.action_of(agent, text)

    def action_of(self, agent: str, text: str) -> int | None:
        """The OpenSpiel action `text` names for `agent` now, or None (not one of its legal moves, or two)."""
        player = self.player_of(agent)
        legal = self.state.legal_actions(player)
        names = [self.text.move_name(self.state, player, a) for a in legal]
        index = match_choice(text, names, numbers=False)
        if index is None:  # a synonym: "check" for Pass, where it names exactly one legal move
            spelled = [(alias, i) for i, name in enumerate(names) for alias in self.text.aliases.get(name.lower(), ())]
            hit = match_choice(text, [alias for alias, _ in spelled], numbers=False)
            index = None if hit is None else spelled[hit][1]
        return None if index is None else legal[index]

    def _fallback(self, agent: str) -> int:
        return self.state.legal_actions(self.player_of(agent))[0]

    def _apply(self, agent: str, action: Any) -> None:
        player = self.player_of(agent)
        self._told_rules.add(agent)
        self._news[agent] = []
        fallback = self.fallbacks.get(agent, 0) > self._fallbacks_seen.get(agent, 0)  # counted before this call
        self._fallbacks_seen[agent] = self.fallbacks.get(agent, 0)
        self._moves[agent].append("invalid" if fallback else self.text.move_name(self.state, player, action).lower())
        told = self.text.move(self.state, player, action)
        for other in self.possible_agents:
            if other != agent:
                self._news[other].append(told)
        self._play(action)
        self._advance()

    def _play(self, action: int) -> None:
        """Apply one action (a move or a chance outcome) and collect the rewards it brings."""
        self.state.apply_action(action)
        for agent, reward in zip(self.possible_agents, self.state.rewards()):
            self.rewards[agent] = self.rewards.get(agent, 0.0) + float(reward)

    def _finish(self) -> None:
        returns = dict(zip(self.possible_agents, (float(r) for r in self.state.returns())))
        for agent in self.agents:
            self.rewards[agent] -= self.invalid_penalty * self.invalid_actions.get(agent, 0)
            self.terminations[agent] = True
        self.final_rewards = returns
        top = max(returns.values())
        leaders = [a for a, r in returns.items() if r == top]
        self.winner = "draw" if len(leaders) == len(returns) else leaders[0] if len(leaders) == 1 else None
        if self.winner not in (None, "draw"):
            self.winner = self.team_of(self.winner)

    # --- what the game was ---------------------------------------------------------------------------------------

    def goal_met(self, agent: str) -> bool | None:
        """Won: the agent's return is positive (chips won, a game won); None before the end."""
        if not self.final_rewards:
            return None
        return self.final_rewards[agent] > 0

    def action_labels(self) -> dict[str, list[str]]:
        """Each agent's moves by name, lower case (`bet`, `x(1,1)`); `invalid` where the fallback was played."""
        return {agent: list(moves) for agent, moves in self._moves.items() if moves}

    def summary(self) -> dict[str, Any]:
        """OpenSpiel's own picture of the final state, the moves, and the returns."""
        if self.state is None:
            return {}
        return {"game": self.game_name, "state": printable(str(self.state)), "history": self.state.history(),
                "returns": self.final_rewards, "winner": self.winner}

    def scripted_action(self, agent: str) -> str:
        """The move the agent's scripted policy draws here (from `self.rng`), by name."""
        player = self.player_of(agent)
        action = self.scripted[agent].draw(self.state, player, self.rng)
        return self.text.move_name(self.state, player, action)


@functools.lru_cache(maxsize=64)
def load_game(name: str, params_json: str = "{}") -> Any:
    """The OpenSpiel game `name` with its parameters (JSON), or `GameRefused` saying why marl cannot play it."""
    try:
        import pyspiel
    except ImportError as exc:
        raise GameRefused("game", f"OpenSpiel games need open-spiel: pip install 'marl[openspiel]' ({exc})") from exc
    if name not in pyspiel.registered_names():
        import difflib
        close = difflib.get_close_matches(name, pyspiel.registered_names(), n=3)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise GameRefused("game", f"{name!r} is not an OpenSpiel game{hint}; pyspiel.registered_names() lists them")
    params = json.loads(params_json)
    try:
        game = pyspiel.load_game(name, params)
    except (pyspiel.SpielError, TypeError, ValueError) as exc:
        raise GameRefused("params", f"{name} refuses params {params}: {exc}") from exc
    if problem := unplayable(game):
        raise GameRefused("game", f"{name}: {problem}")
    return game


def unplayable(game: Any) -> str | None:
    """Why marl cannot play `game` as a turn-based text game (None: it can)."""
    import pyspiel
    kind = game.get_type()
    if kind.dynamics != pyspiel.GameType.Dynamics.SEQUENTIAL:
        return (f"its moves are {kind.dynamics.name.lower()}, and marl plays games whose players move in turn"
                " (OpenSpiel's turn_based_simultaneous_game wraps a simultaneous game as one)")
    if kind.chance_mode == pyspiel.GameType.ChanceMode.SAMPLED_STOCHASTIC:
        return "its chance outcomes are sampled inside the game, so a seed cannot replay a game"
    if not (kind.provides_observation_string or kind.provides_information_state_string):
        return "it has no text for its states (neither observation_string nor information_state_string)"
    return None


def chance_and_moves(game: Any, history: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Split an OpenSpiel history into its chance outcomes and its moves (player, action), in order."""
    state = game.new_initial_state()
    chance, moves = [], []
    for action in history:
        if state.is_chance_node():
            chance.append(action)
        else:
            moves.append((state.current_player(), action))
        state.apply_action(action)
    return chance, moves


def equally_likely_openings(game: Any) -> list[tuple[int, ...]]:
    """Every sequence of chance outcomes before the game's first move, in OpenSpiel's order; `GameRefused` (at
    `deals`) when there are none, more than `MAX_OPENINGS`, or they are not equally likely (dealing them in turn
    would then change the game)."""
    too_many = GameRefused("deals", f"deals: stratified lists every opening; {game} has more than {MAX_OPENINGS}")
    state, estimate = game.new_initial_state(), 1
    if not state.is_chance_node():
        raise GameRefused("deals", f"deals: stratified needs chance before the first move; {game} opens with a move")
    while state.is_chance_node() and estimate <= MAX_OPENINGS:  # the first line's branching: a bridge deal stops here
        outcomes = state.chance_outcomes()
        estimate *= len(outcomes)
        state = state.child(outcomes[0][0])
    if estimate > MAX_OPENINGS:
        raise too_many
    openings: list[tuple[tuple[int, ...], float]] = []
    stack, states = [(game.new_initial_state(), (), 1.0)], 1
    while stack:  # depth first, by hand: a long deal (one card a node) is deeper than Python's recursion
        state, prefix, probability = stack.pop()
        if not state.is_chance_node():
            openings.append((prefix, probability))
            continue
        outcomes = state.chance_outcomes()
        states += len(outcomes)
        if states > MAX_OPENINGS:  # counted in states, not openings: a long deal costs as much before its first
            raise too_many
        stack.extend((state.child(a), (*prefix, a), probability * p) for a, p in reversed(outcomes))
    first = openings[0][1]
    if any(abs(p - first) > 1e-9 * first for _, p in openings):
        raise GameRefused("deals", f"deals: stratified deals openings in turn, which changes {game}: its"
                                   f" {len(openings)} openings are not equally likely")
    return [prefix for prefix, _ in openings]


def _chance_outcomes(value: Any) -> list[int]:
    """The `CHANCE_OPTION` of a reset, checked: a list of action ids (the deal to force), or None."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"reset option {CHANCE_OPTION!r} must be a list of chance action ids, got {value!r}")
    return [count_option(f"{CHANCE_OPTION}[{i}]", a) for i, a in enumerate(value)]
