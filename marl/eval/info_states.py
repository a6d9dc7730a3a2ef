"""A game's information states, and the conversation an agent is in at each: what `marl eval --exploitability`
asks a model, and how it reads the model's replies as OpenSpiel actions.

    seats = policy_seats(topology)            # an OpenSpiel env, or TextArena's KuhnPoker-v0 mapped onto kuhn_poker
    for info in info_states(seats.game):      # every (player, information state) of the game, with one history
        for role in seats.roles_at(info.player):
            prompt = seats.prompt(info, role) # system, user, assistant, ..., user: what the game gives that agent
            action = prompt.parse("I [Bet]")  # an OpenSpiel action, or None for an invalid reply

The env itself plays the way to each state (the deal forced, each earlier move given as the move the game lists:
`Bet`, `[bet]`), so the conversation is the env's own, word for word. The one way it can differ from a real game:
there the agent's earlier replies were its own words ("I bet."), here they are the listed moves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["InfoState", "NotMeasurable", "OpenSpielSeats", "PolicySeats", "PromptedState", "TextArenaKuhnSeats",
           "info_states", "policy_seats"]


class NotMeasurable(ValueError):
    """A topology whose game `marl eval --exploitability` cannot measure (the message says why)."""


@dataclass(frozen=True)
class InfoState:
    """One information state of a player: OpenSpiel's string for it, a history that reaches it, its legal moves."""

    player: int
    key: str  # information_state_string(player)
    history: tuple[int, ...]  # chance outcomes and moves, OpenSpiel's action ids
    actions: tuple[int, ...]
    names: tuple[str, ...]  # action_to_string of each legal action


@dataclass
class PromptedState:
    """An information state as a role's model meets it: the conversation to send, and how to read a reply."""

    info: InfoState
    role: str
    messages: list[dict[str, str]]
    parse: Callable[[str], int | None]
    moves: list[str] | None = None  # the env's legal moves here, as a reply held to them names them (None: free)


def info_states(game: Any) -> list[InfoState]:
    """Every information state of every player, in the order a depth-first walk of the game tree meets them (each
    with the first history that reaches it). Enumerates the tree: small games only (Kuhn 12, Leduc 936)."""
    found: dict[tuple[int, str], InfoState] = {}
    stack = [game.new_initial_state()]
    while stack:
        state = stack.pop()
        if state.is_terminal():
            continue
        if state.is_chance_node():
            actions = [a for a, _ in state.chance_outcomes()]
        else:
            player, actions = state.current_player(), state.legal_actions()
            key = state.information_state_string(player)
            if (player, key) not in found:
                found[player, key] = InfoState(player, key, tuple(state.history()), tuple(actions),
                                               tuple(state.action_to_string(player, a) for a in actions))
        stack.extend(state.child(a) for a in reversed(actions))
    return list(found.values())


class PolicySeats:
    """Who plays each player of the solver's game (`game`, a pyspiel game), and how to ask them."""

    game: Any

    def roles_at(self, player: int) -> list[str]:
        """The roles whose policy plays OpenSpiel's `player` (one, or several where seats rotate)."""
        raise NotImplementedError

    def prompt(self, info: InfoState, role: str) -> PromptedState:
        raise NotImplementedError

    def scripted(self, info: InfoState, role: str) -> dict[int, float]:
        """The exact policy of a scripted role at `info` (each legal action's probability)."""
        raise NotMeasurable(f"role {role} is scripted, and this env's scripts have no probabilities to read")


class OpenSpielSeats(PolicySeats):
    """An `envs.openspiel_env.OpenSpielEnv`: agent `player_i` plays OpenSpiel's player i."""

    def __init__(self, make_env: Callable[[], Any]):
        self.make_env = make_env
        probe = make_env()
        self.game, self.agents = probe.game, list(probe.possible_agents)
        self._roles = [probe.role_of(agent) for agent in self.agents]

    def roles_at(self, player: int) -> list[str]:
        return [self._roles[player]]

    def prompt(self, info: InfoState, role: str) -> PromptedState:
        from envs.openspiel_env import CHANCE_OPTION, chance_and_moves
        env = self.make_env()
        chance, moves = chance_and_moves(self.game, info.history)
        env.reset(seed=0, options={CHANCE_OPTION: chance})
        agent = self.agents[info.player]
        messages = play_to(env, agent, [lambda p=p, a=a: env.text.move_name(env.state, p, a) for p, a in moves])
        return PromptedState(info, role, messages, lambda reply: env.action_of(agent, reply),
                             env.legal_actions(agent))

    def scripted(self, info: InfoState, role: str) -> dict[int, float]:
        env = self.make_env()
        return env.scripted[self.agents[info.player]].probabilities(state_at(self.game, info), info.player)


# TextArena's KuhnPoker-v0 with one round: its Player 1 opens (OpenSpiel's player 0), and its moves name what Pass and
# Bet mean where they are played.
_TEXTARENA_MOVES = {(False, 0): "[check]", (False, 1): "[bet]", (True, 0): "[fold]", (True, 1): "[call]"}
_TEXTARENA_ACTION = {move.strip("[]"): action for (_, action), move in _TEXTARENA_MOVES.items()}


class TextArenaKuhnSeats(PolicySeats):
    """TextArena's KuhnPoker-v0 (`max_rounds: 1`) read as OpenSpiel's kuhn_poker. TextArena's Player 1 opens, so it
    is OpenSpiel's player 0; with `rotate_seats` every role plays both players (the seed decides the seats), so a
    role's policy is measured at all 12 information states."""

    def __init__(self, make_env: Callable[[], Any]):
        import pyspiel
        self.make_env = make_env
        probe = make_env()
        self.game, self.agents = pyspiel.load_game("kuhn_poker"), list(probe.possible_agents)
        self.rotate = probe.rotate_seats
        self._roles = {agent: probe.role_of(agent) for agent in self.agents}

    def roles_at(self, player: int) -> list[str]:
        if self.rotate:
            return list(dict.fromkeys(self._roles.values()))
        return [self._roles[self.agents[1 - player]]]  # TextArena's seat 1 - player, unrotated: agent player_{1-p}

    def prompt(self, info: InfoState, role: str) -> PromptedState:
        agent = next(a for a in self.agents if self._roles[a] == role)
        env = self.make_env()
        env.reset(seed=self._seed_for(info, agent))
        state = self.game.new_initial_state()
        state.apply_action(info.history[0])
        state.apply_action(info.history[1])

        def move(action: int) -> Callable[[], str]:
            def text() -> str:
                name = _TEXTARENA_MOVES[1 in state.history()[2:], action]
                state.apply_action(action)
                return name
            return text
        messages = play_to(env, agent, [move(a) for a in info.history[2:]])
        facing_bet = 1 in info.history[2:]
        return PromptedState(info, role, messages, lambda reply: _textarena_action(reply, facing_bet))

    def _seed_for(self, info: InfoState, agent: str) -> int:
        """A seed at which `agent` sits in the seat of OpenSpiel's `info.player` and the cards are the history's."""
        want_seat = 1 - info.player  # TextArena's seat of OpenSpiel's player
        env = self.make_env()
        for seed in range(1000):
            if self.rotate and (self.agents.index(agent) + seed) % 2 != want_seat:
                continue
            env.reset(seed=seed)
            cards = env._ta.state.game_state["player_cards"]
            if (cards[1], cards[0]) == tuple(info.history[:2]) and env._seats[want_seat] == agent:
                return seed
        raise NotMeasurable(f"no seed below 1000 deals {info.key!r} with {agent} in TextArena's seat {want_seat}")


def _textarena_action(reply: str, facing_bet: bool) -> int | None:
    """The OpenSpiel action of a TextArena Kuhn move, judged as TextArena judges it: the first bracketed move
    (its own regular expression), which must be legal here (a check facing a bet is invalid)."""
    import re
    match = re.search(r"\[(Check|Bet|Fold|Call)\]", reply.strip(), re.IGNORECASE)
    if match is None:
        return None
    move = match.group(1).lower()
    legal = ("fold", "call") if facing_bet else ("check", "bet")
    return _TEXTARENA_ACTION[move] if move in legal else None


def play_to(env: Any, target: str, moves: Sequence[Callable[[], str]]) -> list[dict[str, str]]:
    """Play `moves` (each gives the next move's text, whoever is to move) from the env's reset state, and return
    `target`'s conversation: its system prompt, each of its observations and moves, then its observation now."""
    messages = [{"role": "system", "content": env.system_prompt(target)}]
    for move in moves:
        agent = env.agent_selection
        observation, text = str(env.observe(agent)), move()
        if agent == target:
            messages += [{"role": "user", "content": observation}, {"role": "assistant", "content": text}]
        env.step(text)
    if env.agent_selection != target:
        raise RuntimeError(f"playing the history should leave {target} to move, not {env.agent_selection}")
    messages.append({"role": "user", "content": str(env.observe(target))})
    return messages


def state_at(game: Any, info: InfoState) -> Any:
    """OpenSpiel's state at the history that reaches `info`."""
    state = game.new_initial_state()
    for action in info.history:
        state.apply_action(action)
    return state


def policy_seats(make_env: Callable[[], Any]) -> PolicySeats:
    """The seats of the topology's env (`make_env`): an OpenSpiel env of a two-player zero-sum game, or TextArena's
    KuhnPoker-v0 with one round. `NotMeasurable` for anything else."""
    env = make_env()
    if type(env).__name__ == "OpenSpielEnv":
        kind = env.game.get_type()
        if env.game.num_players() != 2 or kind.utility.name != "ZERO_SUM":
            raise NotMeasurable(f"{env.game_name} is not a two-player zero-sum game ({env.game.num_players()} players,"
                                f" {kind.utility.name.lower()}): exploitability is measured for those only")
        return OpenSpielSeats(make_env)
    if type(env).__name__ == "TextArenaEnv" and env.game.startswith("KuhnPoker"):
        if env.game_args.get("max_rounds", 1) != 1:
            raise NotMeasurable(f"{env.game} with max_rounds {env.game_args['max_rounds']}: the measure maps one"
                                " round onto OpenSpiel's kuhn_poker; set env.args.game_args.max_rounds: 1")
        return TextArenaKuhnSeats(make_env)
    raise NotMeasurable(f"{type(env).__name__} is not a game a solver can check: exploitability needs an OpenSpiel"
                        " game (env.openspiel) of two players, zero-sum, or TextArena's KuhnPoker-v0")
