"""`TextAdapter`: play any PettingZoo AEC env with LLM agents, given a text rendering of its observations.

    env = TextAdapter(tictactoe_v3.env(), render=tictactoe_render, actions=tictactoe_actions)

`render(agent, obs, info) -> str` describes what `agent` sees; `actions(agent, obs, info) -> [(label, action), ...]`
lists the moves as (text label, underlying action) pairs, or returns None for a free-text turn (the text is the
action). Pairs whose action the env's action mask (in `obs["action_mask"]` or `info["action_mask"]`) forbids are
dropped. Without `actions`, a masked or Discrete action space is listed as "action 0", "action 1", ...

The result is a `TextAECEnv`: numbered options, retries, fallbacks (the first legal option), counting, `outcome()`.
Only the legal moves are listed, numbered afresh each turn: a number is a position in this turn's list (on a
half-full tic-tac-toe board "5" is not the center any more), while a label names the same move every turn.
`roles`/`teams` (a mapping or a function of the agent) rename roles and group them; they decide `dealt_roles()`.
The wrapped env stays the source of truth for turns, rewards, terminations and truncations.

In a topology, `env.class` names a factory that returns the adapted env (`envs.adapter:text_tictactoe`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from gymnasium.spaces import Discrete
from pettingzoo import AECEnv

from envs.base import EPISODE_OPTION, TextAECEnv, match_choice, printable

Render = Callable[[str, Any, dict], str]
Actions = Callable[[str, Any, dict], "list[tuple[str, Any]] | None"]


class TextAdapter(TextAECEnv):
    def __init__(self, env: AECEnv, render: Render, actions: Actions | None = None, *,
                 system_prompt: str | Callable[[str], str] | None = None,
                 roles: Mapping[str, str] | Callable[[str], str] | None = None,
                 teams: Mapping[str, str] | Callable[[str], str] | None = None,
                 render_mode: str | None = None):
        self.env = env
        self.possible_agents = list(env.possible_agents)
        name = getattr(env, "metadata", {}).get("name", type(env.unwrapped).__name__)
        self.metadata = {**TextAECEnv.metadata, "name": f"text_{name}"}
        super().__init__(render_mode=render_mode)
        self._render, self._actions = render, actions
        self._system_prompt, self._roles, self._teams = system_prompt, roles, teams
        self._last_text: dict[str, str] = {}

    # --- hooks ---------------------------------------------------------------------------------------------------

    def _reset_game(self, seed: int | None, options: dict | None) -> None:
        # the wrapped env is not marl's: it gets the caller's options without marl's own
        theirs = {key: value for key, value in (options or {}).items() if key != EPISODE_OPTION}
        self.env.reset(seed=seed, options=theirs or None)
        if list(self.env.agents) != self.agents:
            raise ValueError(f"TextAdapter needs the wrapped env's agents after reset to be its possible_agents "
                             f"({self.agents}); got {list(self.env.agents)}")
        self.agent_selection = self.env.agent_selection
        self._last_text = {}

    def _observe_text(self, agent: str) -> str:
        try:
            obs, info = self.env.observe(agent), self.env.infos.get(agent, {})
            self._last_text[agent] = str(self._render(agent, obs, info))
        except Exception:  # an agent the wrapped env already removed: show what it saw last
            if agent not in self._last_text:
                raise
        return self._last_text[agent]

    def choices(self, agent: str) -> list[tuple[str, Any]] | None:
        """The legal (label, action) pairs of `agent` now (mask applied), or None for free text."""
        obs, info = self.env.observe(agent), self.env.infos.get(agent, {})
        mask = _action_mask(obs, info)
        if self._actions is not None:
            pairs = self._actions(agent, obs, info)
        elif mask is not None:
            pairs = [(f"action {i}", int(i)) for i in range(len(mask))]
        elif isinstance(self.env.action_space(agent), Discrete):
            space = self.env.action_space(agent)
            pairs = [(f"action {i}", int(space.start + i)) for i in range(int(space.n))]
        else:
            raise ValueError(f"pass `actions=` to TextAdapter: cannot list the moves of {self.env.action_space(agent)}")
        if pairs is None:
            return None
        if mask is not None:
            pairs = [(label, a) for label, a in pairs
                     if not isinstance(a, (int, np.integer)) or (0 <= a < len(mask) and mask[a])]
        return [(printable(str(label)), action) for label, action in pairs]

    def _legal_actions(self, agent: str) -> list[str] | None:
        pairs = self.choices(agent)
        return None if pairs is None else [label for label, _ in pairs]

    def _parse(self, agent: str, text: str) -> Any:
        pairs = self.choices(agent)
        if pairs is None:
            return printable(text).strip() or None
        index = match_choice(text, [label for label, _ in pairs], numbers=self.number_options)
        return None if index is None else pairs[index][1]

    def _fallback(self, agent: str) -> Any:
        pairs = self.choices(agent)
        return pairs[0][1] if pairs else ""

    def _apply(self, agent: str, action: Any) -> None:
        inner = self.env
        inner.step(action)
        for a in self.agents:
            self.rewards[a] = float(inner.rewards.get(a, 0.0))
            self.terminations[a] = bool(inner.terminations.get(a, a not in inner.agents))
            self.truncations[a] = bool(inner.truncations.get(a, False))
            self.infos[a].update({k: v for k, v in inner.infos.get(a, {}).items() if k != "action_mask"})
        # Agents that left mid-game: step them out of the wrapped env so its game goes on (this env steps them
        # out of its own agents when the loop reaches them). At the end of the game the wrapped env is left as is.
        while any(not _done(inner, a) for a in inner.agents) and _done(inner, inner.agent_selection):
            inner.step(None)
        if not all(_done(inner, a) for a in inner.agents):
            self.agent_selection = inner.agent_selection

    def system_prompt(self, agent: str) -> str:
        if callable(self._system_prompt):
            return self._system_prompt(agent)
        if self._system_prompt is not None:
            return self._system_prompt
        return (f"You are {agent} in the game {self.env}. Each message shows the game and your options. "
                f"{self.choice_prompt}")

    def role_of(self, agent: str) -> str:
        return _lookup(self._roles, agent) or agent

    def team_of(self, agent: str) -> str:
        return _lookup(self._teams, agent) or self.role_of(agent)

    def summary(self) -> dict[str, Any]:
        """What each agent sees at the end, rendered (tic-tac-toe: the final board); an agent the wrapped env cannot
        show any more is left out."""
        views = {}
        for agent in self.possible_agents:
            try:
                views[agent] = self._observe_text(agent)
            except Exception:  # noqa: BLE001, S112 - never seen by this game, and the wrapped env will not show it
                continue
        return {"final_view": views} if views else {}

    def scripted_action(self, agent: str) -> str:
        """A random legal move (drawn from `self.rng`, so seeded games repeat)."""
        legal = self._legal_actions(agent)
        if not legal:
            raise NotImplementedError("no scripted action for a free-text turn")
        return self.rng.choice(legal)

    def close(self) -> None:
        self.env.close()


def _done(env: AECEnv, agent: str) -> bool:
    return bool(env.terminations.get(agent, True) or env.truncations.get(agent, False))


def _lookup(table: Mapping[str, str] | Callable[[str], str] | None, agent: str) -> str | None:
    if table is None:
        return None
    return table(agent) if callable(table) else table.get(agent)


def _action_mask(obs: Any, info: dict) -> np.ndarray | None:
    if isinstance(obs, dict) and "action_mask" in obs:
        return np.asarray(obs["action_mask"])
    if isinstance(info, dict) and "action_mask" in info:
        return np.asarray(info["action_mask"])
    return None


# --- the worked example: PettingZoo's tic-tac-toe (pettingzoo.classic.tictactoe_v3) ------------------------------

#: Cell names by action index. Tic-tac-toe numbers its cells column by column: 0 1 2 is the left column.
TICTACTOE_CELLS = ("top left", "middle left", "bottom left", "top center", "center", "bottom center",
                   "top right", "middle right", "bottom right")


def tictactoe_render(agent: str, obs: dict, info: dict) -> str:
    """The board from `agent`'s side: its marks are X for player_1, O for player_2 (plane 0 is always its own)."""
    planes = np.asarray(obs["observation"]).reshape(9, 2)
    me, them = ("X", "O") if agent == "player_1" else ("O", "X")
    cell = [me if planes[i, 0] else them if planes[i, 1] else "." for i in range(9)]
    rows = "\n".join(" ".join(cell[col * 3 + row] for col in range(3)) for row in range(3))
    return f"Tic-tac-toe. You play {me}. Get three in a row.\nBoard (. is empty):\n{rows}\nWhere do you play?"


def tictactoe_actions(agent: str, obs: dict, info: dict) -> list[tuple[str, int]]:
    return [(name, i) for i, name in enumerate(TICTACTOE_CELLS)]  # the adapter drops the masked (taken) cells


def text_tictactoe(env: AECEnv | None = None, *, system_prompt: str | Callable[[str], str] | None = None,
                   roles: Mapping[str, str] | Callable[[str], str] | None = None,
                   teams: Mapping[str, str] | Callable[[str], str] | None = None,
                   render_mode: str | None = None) -> TextAdapter:
    """Tic-tac-toe for LLM agents; a topology's `env.class: envs.adapter:text_tictactoe` (roles player_1 and
    player_2, each its own team, unless `roles`/`teams` say otherwise). Without `env`, PettingZoo's
    `tictactoe_v3.env()`, which needs pygame (`pip install 'pettingzoo[classic]'`)."""
    if env is None:
        try:
            from pettingzoo.classic import tictactoe_v3  # imports pygame
        except ImportError as exc:
            raise ImportError(f"PettingZoo's tic-tac-toe needs pygame: pip install 'pettingzoo[classic]' ({exc})") \
                from exc
        env = tictactoe_v3.env()
    return TextAdapter(env, render=tictactoe_render, actions=tictactoe_actions, system_prompt=system_prompt,
                       roles=roles, teams=teams, render_mode=render_mode)
