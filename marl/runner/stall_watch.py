"""Noticing a run that could never end: a trainable learner whose pool cannot fill a batch.

`marl run` with `run.max_steps` waits until every trainable learner took that many steps. A learner whose roles never
call the model (every game of Secret Mafia ends at night, before a villager speaks) or whose groups otherwise never
complete would keep it waiting for ever while the other learners train. `StallWatch` counts, per learner, the games
recorded since its policy version last moved. Past its bound (`run.stall_batches` batches' worth of games, a batch
being `batch_size` x `num_repeat` games, plus the games in flight) it says why in one line: the run then stops
(exit 1), or with `run.on_stall: warn` says so once and goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from marl.games.record import GameRecord

__all__ = ["LearnerNeeds", "StallWatch"]


@dataclass(frozen=True)
class LearnerNeeds:
    """What one learner must see to take a step: the roles whose episodes it trains on and the games in a batch."""

    roles: tuple[str, ...]
    batch_games: int  # batch_size * num_repeat: one episode of each role per game


@dataclass
class _Since:
    """A learner's games since its version last moved."""

    version: int | None = None
    games: int = 0
    spoke: int = 0  # games in which one of its roles called the model
    reported: bool = False


class StallWatch:
    def __init__(self, needs: Mapping[str, LearnerNeeds], *, stall_batches: int, in_flight: int = 0):
        self.needs = dict(needs)
        self.bounds = {name: stall_batches * need.batch_games + in_flight for name, need in needs.items()}
        self._since = {name: _Since() for name in needs}
        self._lock = threading.Lock()  # games finish on the run's worker threads

    def observe(self, record: GameRecord, versions: Mapping[str, int]) -> list[str]:
        """Count a recorded game (with every learner's policy version now); the learners that passed their bound
        with it, each with its reason, once per stall."""
        with self._lock:
            return [reason for name in self.needs if (reason := self._count(name, record, versions.get(name)))]

    def _count(self, name: str, record: GameRecord, version: int | None) -> str | None:
        """Count `record` for learner `name` (now at `version`); its reason if this game passed its bound."""
        need, since = self.needs[name], self._since[name]
        if version != since.version:  # a step (or the first reading): the count starts again
            self._since[name] = since = _Since(version=version)
        if not any(role in record.role_rewards for role in need.roles):
            return None  # not in this game
        since.games += 1
        since.spoke += any(record.replies.get(role, 0) > 0 for role in need.roles)
        if since.games <= self.bounds[name] or since.reported:
            return None
        since.reported = True
        return self.reason(name)

    def reason(self, name: str) -> str:
        """Why learner `name` has taken no step (its counts since its last one)."""
        need, since = self.needs[name], self._since[name]
        roles = _named(need.roles)
        if since.spoke == 0:
            return (f"{roles}'s episodes have no tokens: every game ended before {roles} called the model;"
                    f" {since.games:,} games, so {name} can never fill a batch")
        return (f"{name} took no training step in {since.games:,} games ({self.bounds[name]:,} allowed, a batch being"
                f" {need.batch_games} games); {roles} called the model in {since.spoke:,} of them")


def _named(roles: Sequence[str]) -> str:
    return roles[0] if len(roles) == 1 else "/".join(roles)
