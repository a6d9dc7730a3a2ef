"""`TextAECEnv`: the base class of text games: PettingZoo AEC environments whose agents read and write text.

An env author writes a handful of hooks; the base class does the PettingZoo plumbing (reset, observe, step, last,
dead-agent steps, reward accumulation), lists the legal actions in every observation, asks again after an invalid
reply, falls back after too many, and counts both per agent and per role (that bookkeeping is
`envs/invalid_replies.py`'s `InvalidReplies`)::

    class Guess(TextAECEnv):
        possible_agents = ["guesser"]

        def _reset_game(self, seed, options):
            self.secret = self.rng.choice(["cat", "dog", "cow"])

        def _observe_text(self, agent):
            return "Guess the animal."

        def _legal_actions(self, agent):
            return ["cat", "dog", "cow"]          # None would mean free text

        def _apply(self, agent, action):          # action: the matched legal string (default `_parse`)
            self.rewards[agent] = float(action == self.secret)
            self.terminations[agent] = True

Observations are `TextObservation` strings (printable ASCII: see `printable`); actions are strings the env parses.
See docs/envs.md. This package never imports `servers/` or `marl/`.
"""

from __future__ import annotations

import numbers
import random
import re
import string
import unicodedata
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
from gymnasium.spaces import Text
from pettingzoo import AECEnv

from envs.invalid_replies import InvalidReplies, default_reason

__all__ = ["EPISODE_OPTION", "MAX_OPTION_COUNT", "GameEnv", "InvalidAction", "RoleInfo", "TextAECEnv",
           "TextObservation", "count_option", "episode_of", "match_choice", "play", "printable"]

#: The `reset` option in which marl passes which repeat of its task a game is (0, 1, ...: the episodes of one GRPO
#: group share the task's seed). An env may draw what should differ between those episodes from it; others ignore it.
EPISODE_OPTION = "episode"
#: The largest count a `reset` option may hold (an episode index, a chance outcome): far past any real one, and small
#: enough for every RNG and C++ game marl hands it to.
MAX_OPTION_COUNT = 2**31 - 1


def count_option(name: str, value: Any) -> int:
    """A `reset` option that counts (an episode index, an action id), checked: a non-negative int, else a ValueError
    naming the option. bool is refused (True is not episode 1); numpy's ints are accepted."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= MAX_OPTION_COUNT:
        raise ValueError(f"reset option {name!r} must be an int from 0 to {MAX_OPTION_COUNT}, got {value!r}")
    return int(value)


def episode_of(options: Mapping[str, Any] | None) -> int:
    """Which repeat of its task a game is: `options[EPISODE_OPTION]`, checked (`count_option`); 0 when absent."""
    return count_option(EPISODE_OPTION, (options or {}).get(EPISODE_OPTION, 0))

#: Characters allowed in observations and actions (the charset of both `Text` spaces).
CHARSET = string.printable
_ALLOWED = frozenset(CHARSET)
_REPLACEMENTS = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-",
                               "\u2014": "-", "\u2212": "-", "\u2026": "...", "\u00a0": " "})


class TextObservation(str):
    """A `str` that PettingZoo's `api_test` accepts as an observation (it checks `obs.dtype` against the space)."""

    dtype = np.dtype("<U")


@dataclass(frozen=True)
class RoleInfo:
    """A role an env deals in every game: the team its agents play for, and how many agents are dealt it."""

    team: str
    count: int = 1


def count_roles(agents: Sequence[str], role_of: Callable[[str], str],
                team_of: Callable[[str], str]) -> dict[str, RoleInfo]:
    """The roles `agents` are dealt, with their teams and counts. A role is one team: agents of one role in two
    teams raise ValueError (give them different roles)."""
    counts: dict[str, int] = {}
    teams: dict[str, str] = {}
    for agent in agents:
        role, team = role_of(agent), team_of(agent)
        if teams.setdefault(role, team) != team:
            raise ValueError(f"role {role!r} is dealt to agents of two teams ({teams[role]!r} and {team!r}, "
                             f"{agent}): a role's agents share one team, so give them different roles")
        counts[role] = counts.get(role, 0) + 1
    return {role: RoleInfo(team=teams[role], count=n) for role, n in counts.items()}


def sum_by_role(counts: Mapping[str, int], role_of: Callable[[str], str]) -> dict[str, int]:
    """Per-agent counts summed per role."""
    out: dict[str, int] = {}
    for agent, n in counts.items():
        out[role_of(agent)] = out.get(role_of(agent), 0) + n
    return out


def mean_by_role(values: Mapping[str, float], role_of: Callable[[str], str]) -> dict[str, float]:
    """Per-agent values averaged per role."""
    by_role: dict[str, list[float]] = {}
    for agent, value in values.items():
        by_role.setdefault(role_of(agent), []).append(value)
    return {role: sum(v) / len(v) for role, v in by_role.items()}


@runtime_checkable
class GameEnv(Protocol):
    """What the coordinator and the topology need of an env. `TextAECEnv` provides all of it.

    `dealt_roles()` works before `reset` (a topology is checked against it at load); `role_of` and `team_of` may
    need `reset` first when roles are dealt at random (Werewolves).

    `reset(seed, options)`: marl plays every repeat of a task (one GRPO group) with the task's seed, and says which
    repeat a game is in `options[EPISODE_OPTION]`; the same seed and episode must give the same game.

    Optional, not required of an env: `summary() -> dict[str, Any]`, what a person needs to read the game once it
    ended (`TextAECEnv.summary`); `marl run` records it with each game's transcript when the env has it.
    """

    possible_agents: list[str]
    winner: str | None

    def dealt_roles(self) -> Mapping[str, RoleInfo]: ...
    def role_of(self, agent: str) -> str: ...
    def team_of(self, agent: str) -> str: ...
    def system_prompt(self, agent: str) -> str: ...
    def scripted_action(self, agent: str) -> str: ...
    def reset(self, seed: int | None = None, options: dict | None = None) -> None: ...
    def agent_iter(self, max_iter: int = ...) -> Iterator[str]: ...
    def last(self, observe: bool = True) -> tuple[Any, float, bool, bool, dict]: ...
    def step(self, action: Any) -> None: ...
    def outcome(self) -> dict[str, float]: ...
    def outcome_by_role(self) -> dict[str, float]: ...
    @property
    def invalid_actions_by_role(self) -> dict[str, int]: ...
    @property
    def replies_by_role(self) -> dict[str, int]: ...
    def close(self) -> None: ...


class InvalidAction(ValueError):
    """Raise from `_parse` to reject a reply with a specific reason (returning None gives a generic one)."""


def printable(text: str) -> str:
    """Map text onto printable ASCII: accents dropped, curly quotes and dashes straightened, anything else '?'."""
    text = str(text)
    if _ALLOWED.issuperset(text):  # already printable ASCII (the common case): unchanged
        return text
    text = unicodedata.normalize("NFKD", text.translate(_REPLACEMENTS))
    return "".join(c if c in _ALLOWED else "?" for c in text if not unicodedata.combining(c))


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w#]+", " ", text.lower()).split())


_NUMBER = re.compile(r"^(?:(?:option|choice|number|no|item) )?#? ?(\d+)(?: (.*))?$")


def match_choice(text: str, choices: Sequence[str], *, numbers: bool = True) -> int | None:
    """The index of the option `text` picks from `choices`, or None if it picks none (or more than one).

    Accepted, in this order (case, spacing and punctuation ignored):
    1. an option's exact text;
    2. its 1-based number: "2", "2.", "(2)", "#2", "option 2", "No. 2", or a number followed by text that names
       no other option ("2. blue car", "2. car", "2, because it is blue"); "2. red apple" (disagreeing) is None;
    3. a reply that contains exactly one option's text as whole words ("I pick the blue car"); an option contained
       in another matched option does not count, so "top center" picks "top center", not "center".
    Options that are themselves numbers ("3", "5") match by text (rule 1) before numbering (rule 2).
    With `numbers=False` rule 2 is skipped: a number is not an option's index (for options listed unnumbered).
    """
    names = [_norm(c) for c in choices]
    reply = _norm(text)
    if not reply:
        return None
    if reply in names:
        return names.index(reply)
    number = _NUMBER.match(reply) if numbers else None
    if number:
        index, rest = int(number.group(1)) - 1, (number.group(2) or "").strip()
        named = _contained(rest, names) if rest else []
        if 0 <= index < len(names) and named in ([], [index]):  # the number, and no text that contradicts it
            return index
        if named:  # a number and another option's text: ambiguous
            return None
    hits = _contained(reply, names)
    return hits[0] if len(hits) == 1 else None


def named_options(text: str, choices: Sequence[str]) -> list[int]:
    """The indices of the options `text` names as whole words (numbers do not count), as in rule 3 of `match_choice`."""
    return _contained(_norm(text), [_norm(c) for c in choices])


def _contained(reply: str, names: Sequence[str]) -> list[int]:
    padded = f" {reply} "
    hits = [i for i, name in enumerate(names) if name and f" {name} " in padded]
    hit_names = {names[i] for i in hits}
    return [i for i in hits if not any(names[i] != other and f" {names[i]} " in f" {other} " for other in hit_names)]


class TextAECEnv(AECEnv):
    """Base class of text games. Subclasses set `possible_agents` and implement the hooks below.

    Hooks (required): `_reset_game(seed, options)`, `_observe_text(agent)`, `_apply(agent, action)`.
    Hooks (optional): `_legal_actions(agent)` (default None: free text), `_parse(agent, text)`,
    `_fallback(agent)`, `system_prompt(agent)`, `role_of(agent)`, `team_of(agent)`, `scripted_action(agent)`.

    State a hook may use or set: `self.rng` (a `random.Random` seeded by reset's seed), `self.agents`,
    `self.agent_selection`, `self.rewards` (cleared before every step; set this step's rewards), `self.terminations`,
    `self.truncations`, `self.infos` (add keys freely), `self.num_moves` (moves applied this game).
    """

    metadata: dict[str, Any] = {"name": "text_game", "render_modes": ["human", "ansi"], "is_parallelizable": False}
    possible_agents: list[str] = []

    #: Invalid replies in a row before `_fallback` is applied (0: fall back at once).
    max_invalid_retries: int = 2
    #: Moves after which every agent still playing is truncated (None: the game must end by itself).
    max_steps: int | None = None
    #: Line printed under the list of legal actions.
    choice_prompt: str = "Reply with the number of your choice."
    #: List the legal actions numbered ("1. label": a bare number picks that option) or, when False, as "- label"
    #: lines; then a number means nothing to the default `_parse`, and an env's own `_parse` may give it a meaning
    #: (Werewolves: a seat number). Set `choice_prompt` to match.
    number_options: bool = True
    max_observation_chars: int = 65536
    max_action_chars: int = 4096
    #: The team that won, in games that have one (Werewolves: "werewolves", "village" or "draw"); an env sets it when
    #: the game ends. None: not decided, or no such notion. `marl run` records it with each game's rewards.
    winner: str | None = None

    def __init__(self, render_mode: str | None = None):
        super().__init__()
        self.render_mode = render_mode
        self.possible_agents = list(self.possible_agents)
        self._spaces: dict[tuple[str, str], Text] = {}
        self.rng = random.Random()
        self.agents: list[str] = []
        self.num_moves = 0
        self._returns: dict[str, float] = {}
        self._invalid = InvalidReplies()  # the reply counts and retries of this game: a new one at every reset

    # --- hooks ---------------------------------------------------------------------------------------------------

    def _reset_game(self, seed: int | None, options: dict | None) -> None:
        """Set up a new game from `self.rng`; set `self.agent_selection` (default: the first agent)."""
        raise NotImplementedError

    def _observe_text(self, agent: str) -> str:
        """What `agent` is told now (the base appends the legal actions and any invalid-reply line)."""
        raise NotImplementedError

    def _legal_actions(self, agent: str) -> list[str] | None:
        """The options `agent` may pick from now, or None for free text (speech)."""
        return None

    def _parse(self, agent: str, text: str) -> Any:
        """Turn a reply into an action, or None if invalid (raise `InvalidAction(reason)` to say why).

        Default: with legal actions, the one `match_choice` picks (the option's string; by number only if
        `number_options`); free text: the stripped, printable text, invalid when empty.
        """
        legal = self._legal_actions(agent)
        if legal is None:
            return printable(text).strip() or None
        index = match_choice(text, legal, numbers=self.number_options)
        return None if index is None else legal[index]

    def _apply(self, agent: str, action: Any) -> None:
        """Play a parsed (or fallback) action: advance the game, set rewards, terminations and agent_selection."""
        raise NotImplementedError

    def _fallback(self, agent: str) -> Any:
        """The action applied after too many invalid replies. Default: the first legal action, or "" (free text)."""
        legal = self._legal_actions(agent)
        return legal[0] if legal else ""

    def system_prompt(self, agent: str) -> str:
        """Role instructions for an LLM playing `agent` (its system message)."""
        return f"You are the {self.role_of(agent)} in a text game. Follow the instructions in each message."

    def role_of(self, agent: str) -> str:
        """The role `agent` plays this game (default: the agent's name). May change at every reset."""
        return agent

    def dealt_roles(self) -> dict[str, RoleInfo]:
        """Every role this env deals in each game, with its team and how many agents get it; valid before `reset`.

        Default: counted from `role_of`/`team_of` over `possible_agents` (`count_roles`), which suits envs whose
        roles do not depend on the game. An env that deals roles at random (Werewolves) overrides it.
        """
        return count_roles(self.possible_agents, self.role_of, self.team_of)

    def team_of(self, agent: str) -> str:
        """The team `agent` belongs to this game (default: its role)."""
        return self.role_of(agent)

    def summary(self) -> dict[str, Any]:
        """What a person needs to read this game, once it ended: the hidden setup and how it came out (Signalling:
        the items, the target, the message, the picks; Werewolves: the roles, the deaths, the winner). JSON values
        (str, numbers, bools, None, lists, dicts). `marl run` records it in games.jsonl; default: nothing."""
        return {}

    def goal_met(self, agent: str) -> bool | None:
        """Whether `agent` met its goal this game, where no team wins (`winner`): what `marl eval` counts as its win
        rather than a positive reward, which shaping may pay. None (the default): the env does not say."""
        return None

    def scripted_action(self, agent: str) -> str:
        """A sensible rule-based reply (scripted opponents, tests). Default: the first legal action."""
        legal = self._legal_actions(agent)
        if not legal:
            raise NotImplementedError(f"{type(self).__name__} has no scripted action for free-text turns")
        return legal[0]

    # --- public helpers ------------------------------------------------------------------------------------------

    def legal_actions(self, agent: str | None = None) -> list[str] | None:
        """The legal actions of `agent` (default: the agent to move), None for free text."""
        return self._legal_actions(self.agent_selection if agent is None else agent)

    def outcome(self) -> dict[str, float]:
        """Every agent's total reward this game (all rewards, also those after an agent was removed)."""
        return dict(self._returns)

    def outcome_by_role(self) -> dict[str, float]:
        """The mean total reward of the agents playing each role this game."""
        return mean_by_role(self._returns, self.role_of)

    # Per agent this game, counted by `InvalidReplies`: its replies (valid or not), its invalid replies, the fallbacks
    # played for it. Read-only views: a new game starts new counts.
    replies = property(lambda self: self._invalid.replies)
    invalid_actions = property(lambda self: self._invalid.invalid)
    fallbacks = property(lambda self: self._invalid.fallbacks)

    @property
    def invalid_actions_by_role(self) -> dict[str, int]:
        return sum_by_role(self.invalid_actions, self.role_of)

    @property
    def replies_by_role(self) -> dict[str, int]:
        """Replies per role (valid or not): the valid-reply rate of a role is 1 - invalid / replies."""
        return sum_by_role(self.replies, self.role_of)

    @property
    def fallbacks_by_role(self) -> dict[str, int]:
        return sum_by_role(self.fallbacks, self.role_of)

    # --- PettingZoo API ------------------------------------------------------------------------------------------

    def observation_space(self, agent: str) -> Text:
        return self._space("obs", agent, self.max_observation_chars)

    def action_space(self, agent: str) -> Text:
        return self._space("act", agent, self.max_action_chars)

    def _space(self, kind: str, agent: str, length: int) -> Text:
        if (kind, agent) not in self._spaces:
            self._spaces[kind, agent] = Text(max_length=length, min_length=0, charset=CHARSET)
        return self._spaces[kind, agent]

    def reset(self, seed: int | None = None, options: dict | None = None) -> None:
        # options checked before anything changes: a refused reset leaves the game as it was
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"reset's options must be a dict, got {type(options).__name__}")
        episode_of(options)  # checked for every env, whether or not it reads it
        if seed is not None:
            self.rng = random.Random(seed)
        self.agents = list(self.possible_agents)
        self.rewards = {a: 0.0 for a in self.agents}
        self._cumulative_rewards = {a: 0.0 for a in self.agents}
        self.terminations = {a: False for a in self.agents}
        self.truncations = {a: False for a in self.agents}
        self.infos = {a: {} for a in self.agents}
        self._returns = {a: 0.0 for a in self.agents}
        self._invalid = InvalidReplies(self.agents)
        self._skip_agent_selection = None
        self.num_moves = 0
        self.agent_selection = self.agents[0] if self.agents else None
        self._reset_game(seed, options)
        self._update_infos()

    def observe(self, agent: str) -> TextObservation:
        text = self._observe_text(agent)
        alive = agent in self.terminations and not (self.terminations[agent] or self.truncations[agent])
        if alive and agent == self.agent_selection:
            legal = self._legal_actions(agent)
            if legal is not None:
                options = "\n".join(f"{i}. {label}" if self.number_options else f"- {label}"
                                     for i, label in enumerate(legal, 1))
                text = f"{text.rstrip()}\n{options}\n{self.choice_prompt}".rstrip()
            if agent in self._invalid.retry_lines:
                text = f"{text}\n{self._invalid.retry_lines[agent]}"
        text = printable(text)
        if len(text) > self.max_observation_chars:  # keep the end: the latest news and the legal actions
            text = "...\n" + text[-(self.max_observation_chars - 4):]
        return TextObservation(text)

    def step(self, action: Any) -> None:
        agent = self.agent_selection
        if self.terminations[agent] or self.truncations[agent]:
            self._was_dead_step(action)
            return
        self._cumulative_rewards[agent] = 0.0
        self._clear_rewards()
        self.replies[agent] += 1
        text = _as_text(action)[: self.max_action_chars]
        try:
            parsed, reason = self._parse(agent, text), None
        except InvalidAction as exc:
            parsed, reason = None, str(exc)
        if parsed is None:
            reason = reason or default_reason(self._legal_actions(agent), self.number_options)
            if self._invalid.rejected(agent, _snippet(text), reason, self.max_invalid_retries):
                self._finish_step()  # the same agent is asked again
                return
            parsed = self._fallback(agent)
        self._invalid.accepted(agent)
        self._apply(agent, parsed)
        self.num_moves += 1
        if self.max_steps is not None and self.num_moves >= self.max_steps:
            for a in self.agents:
                self.truncations[a] = self.truncations[a] or not self.terminations[a]
        self._deads_step_first()
        self._finish_step()

    def _finish_step(self) -> None:
        self._accumulate_rewards()
        for agent, reward in self.rewards.items():
            self._returns[agent] = self._returns.get(agent, 0.0) + float(reward)
        self._update_infos()

    def _update_infos(self) -> None:
        for agent in self.agents:
            self.infos.setdefault(agent, {}).update(
                role=self.role_of(agent), invalid_actions=self.invalid_actions.get(agent, 0),
                fallbacks=self.fallbacks.get(agent, 0))

    def render(self) -> str | None:
        if self.render_mode is None or not self.agents:
            return None
        text = str(self.observe(self.agent_selection))
        if self.render_mode == "human":
            print(f"[{self.agent_selection}]\n{text}\n")
            return None
        return text

    def close(self) -> None:
        pass


def _as_text(action: Any) -> str:
    if isinstance(action, bytes):
        return action.decode("utf-8", "replace")
    return "" if action is None else str(action)


def _snippet(text: str, limit: int = 60) -> str:
    text = " ".join(printable(text).replace('"', "'").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def play(env: TextAECEnv, policies: Mapping[str, Callable[[str], str] | Any], *, seed: int | None = None,
         options: dict | None = None) -> dict[str, float]:
    """Play one game: `policies[agent]` is a callable (observation -> reply) or has `.act(observation)`.

    Policies with a `reset()` (LLM agents) are reset first: a game starts a fresh conversation. Returns
    `env.outcome()`.
    """
    env.reset(seed=seed, options=options)
    for policy in policies.values():
        if hasattr(policy, "reset"):
            policy.reset()
    for agent in env.agent_iter():
        observation, _, terminated, truncated, _ = env.last()
        if terminated or truncated:
            env.step(None)
            continue
        policy = policies[agent]
        env.step(policy.act(observation) if hasattr(policy, "act") else policy(observation))
    return env.outcome()
