"""Scripted players of OpenSpiel games: solver policies instead of a model (envs/openspiel_env.py's
`scripted_policy`).

    uniform       every legal move equally likely (the default)
    first         the first legal move always (in the poker games: check or fold, the "always pass" policy)
    cfr, cfr:N    OpenSpiel's CFR average policy after N iterations (default 1,000; kuhn_poker: 300 iterations are
                  exploitable for 0.003 chips a hand, Leduc needs thousands); solved once per process and game
    {table: {INFO_STATE: {MOVE: P, ...}, ...}}
                  a fixed table: per OpenSpiel information state string, each move's probability by its name
                  (`action_to_string`); a state the table leaves out plays uniformly

`scripted_policy` is one of these for every agent, or a mapping of roles (or agents) to one, the others uniform:
`{player_1: cfr:300}`. A policy gives each move's probability (`probabilities`), which `marl eval
--exploitability` reads exactly, and draws a move from the env's random stream (`draw`).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["DEFAULT_CFR_ITERATIONS", "ScriptedPolicy", "parse_policy", "scripted_policies"]

DEFAULT_CFR_ITERATIONS = 1000
MAX_CFR_ITERATIONS = 1_000_000


class ScriptedPolicy:
    """A solver's policy: each legal move's probability at a state, for the player to move."""

    def __init__(self, name: str, probabilities: Callable[[Any, int], dict[int, float]]):
        self.name, self._probabilities = name, probabilities

    def probabilities(self, state: Any, player: int) -> dict[int, float]:
        """Each legal action of `player` at `state` with its probability (they sum to 1)."""
        probs = self._probabilities(state, player)
        total = sum(probs.values())
        return {a: p / total for a, p in probs.items()} if total > 0 else _uniform(state, player)

    def draw(self, state: Any, player: int, rng: random.Random) -> int:
        probs = self.probabilities(state, player)
        return rng.choices(list(probs), weights=list(probs.values()))[0]

    def __repr__(self) -> str:
        return f"ScriptedPolicy({self.name})"


def parse_policy(game: Any, spec: str | Mapping[str, Any]) -> ScriptedPolicy:
    """A policy from its spec (see the module docstring); ValueError names what is wrong."""
    if isinstance(spec, Mapping):
        if set(spec) != {"table"} or not isinstance(spec["table"], Mapping):
            raise ValueError(f"a policy table is {{table: {{INFO_STATE: {{MOVE: P}}}}}}; got keys {sorted(spec)}")
        return _table_policy(game, spec["table"])
    kind, _, arg = str(spec).partition(":")
    if kind == "uniform" and not arg:
        return ScriptedPolicy("uniform", _uniform)
    if kind == "first" and not arg:
        return ScriptedPolicy("first", lambda state, player: {state.legal_actions(player)[0]: 1.0})
    if kind == "cfr":
        if arg and not (arg.isdigit() and 1 <= int(arg) <= MAX_CFR_ITERATIONS):
            raise ValueError(f"cfr:N takes a number of iterations from 1 to {MAX_CFR_ITERATIONS:,}; got {spec!r}")
        iterations = int(arg) if arg else DEFAULT_CFR_ITERATIONS
        name = str(game)  # solved on the first draw, not here: an env builds every agent's policy, scripted or not
        return ScriptedPolicy(f"cfr:{iterations}", lambda state, player:
                              _cfr_policy(name, iterations)[state.information_state_string(player)])
    raise ValueError(f"unknown scripted policy {spec!r}: uniform, first, cfr, cfr:N or {{table: ...}}")


def scripted_policies(game: Any, spec: str | Mapping[str, Any], agents: Sequence[str],
                      role_of: Callable[[str], str]) -> dict[str, ScriptedPolicy]:
    """Each agent's scripted policy: `spec` for all, or `{role or agent: policy}` (the others uniform)."""
    if isinstance(spec, Mapping) and set(spec) != {"table"}:
        names = set(agents) | {role_of(a) for a in agents}
        if unknown := sorted(set(spec) - names):
            raise ValueError(f"scripted_policy names {unknown}, which are neither roles nor agents of this game"
                             f" ({', '.join(sorted(names))})")
        parsed = {key: parse_policy(game, value) for key, value in spec.items()}
        uniform = parse_policy(game, "uniform")
        return {a: parsed.get(a) or parsed.get(role_of(a)) or uniform for a in agents}
    policy = parse_policy(game, spec)
    return dict.fromkeys(agents, policy)


def _uniform(state: Any, player: int) -> dict[int, float]:
    legal = state.legal_actions(player)
    return {a: 1.0 / len(legal) for a in legal}


def _table_policy(game: Any, table: Mapping[str, Any]) -> ScriptedPolicy:
    for info_state, moves in table.items():
        if not isinstance(moves, Mapping) or not moves:
            raise ValueError(f"policy table at {info_state!r}: expected {{MOVE: probability}}, got {moves!r}")
        for move, p in moves.items():
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
                raise ValueError(f"policy table at {info_state!r}: {move!r} has probability {p!r}, not in [0, 1]")
    rows = {str(k): {str(m).lower(): float(p) for m, p in v.items()} for k, v in table.items()}

    def probabilities(state: Any, player: int) -> dict[int, float]:
        row = rows.get(state.information_state_string(player))
        if row is None:
            return _uniform(state, player)
        named = {state.action_to_string(player, a).lower(): a for a in state.legal_actions(player)}
        if unknown := sorted(set(row) - set(named)):
            raise ValueError(f"policy table at {state.information_state_string(player)!r}: {unknown} are not legal"
                             f" moves there ({', '.join(named)})")
        return {named[m]: p for m, p in row.items()}
    return ScriptedPolicy("table", probabilities)


@functools.lru_cache(maxsize=16)
def _cfr_policy(game: str, iterations: int) -> dict[str, dict[int, float]]:
    """OpenSpiel's (C++) CFR average policy of `game` (its string, with parameters) after `iterations`; CFR
    enumerates the game tree, so only small games (Kuhn: 300 iterations in 0.01 s; Leduc: 1,000 in about 8 s)."""
    import pyspiel
    from open_spiel.python.policy import TabularPolicy
    loaded = pyspiel.load_game(game)
    solver = pyspiel.CFRSolver(loaded)
    for _ in range(iterations):
        solver.evaluate_and_update_policy()
    average = solver.average_policy()  # a view into the solver: read it out while the solver lives (else a segfault)
    return {info_state: dict(average.get_state_policy(info_state)) for info_state in TabularPolicy(loaded).state_lookup}
