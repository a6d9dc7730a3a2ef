"""A game's episodes recorded on every server of the game, or on none: two-phase commit over `SwarmClient`s.

    decisions = DecisionLog(run_dir / "decisions.sqlite")
    outcome = commit_game(decisions, game_id, {"srv_a": Part(client_a, task_id, episode_a, output_a), ...})

1. The game and its participants (server url, episode id, holding client id) go to the decision log.
2. Every server prepares its episode, concurrently: validated and durable, outside the pool, lease key dead.
3. The decision is written to the log, fsynced: COMMIT if every prepare succeeded (and it is not too late: before
   half the prepare timeout, see `marl.transaction.decision_log`), else ABORT.
4. Every server is told the decision (`commit_episode`, retried until acknowledged within half the prepare timeout;
   or `abort_episode`). A server that does not acknowledge is left `pending`: the game's decision stands, and it
   reaches that server by `redrive` (a restarted coordinator) or by the server itself, which reads the log when
   the prepared episode passes its deadline.

A run that stops (`stop` is set: Ctrl-C, or it gave up on a dead server) does not wait out those retries: a server
that does not answer is retried in tries of at most `TRY_S`, and once `stop` is set no new try starts. So a game in
its commit holds the run's exit up for at most about one try per phase; what is left unacknowledged is `pending`,
and the decision log re-drives it.

`redrive(decisions)` finishes every game of the log not acknowledged everywhere: commit where COMMIT was decided, abort
everywhere else (a game with no decision is decided ABORT first), as the client that holds each episode.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from marl.client import SwarmClient, SwarmError, SwarmTimeout
from marl.protocol import DEFAULT_PREPARE_TIMEOUT_S
from marl.transaction.decision_log import Decision, DecisionLog, Participant

__all__ = ["GameCommit", "Part", "commit_game", "persist", "redrive"]

logger = logging.getLogger("marl.transaction.two_phase")

T = TypeVar("T")

#: One try's budget while a server says to wait or cannot be reached: how soon a retrying call sees that the run stops.
TRY_S = 5.0
_NEVER = threading.Event()  # the `stop` of a commit nobody stops


def persist(call: Callable[[float], T], budget_s: float, stop: threading.Event = _NEVER) -> T:
    """`call(timeout)` (a `SwarmClient` call) retried while the server says to wait or cannot be reached, in tries of
    at most `TRY_S`, until it answers or `budget_s` has passed; once `stop` is set, no new try starts. Raises what
    the last try raised (`SwarmTimeout`), or at once any other error (a refusal)."""
    deadline = time.monotonic() + budget_s
    while True:
        try:
            return call(max(min(TRY_S, deadline - time.monotonic()), 1.0))
        except SwarmTimeout:
            if stop.is_set() or time.monotonic() >= deadline:
                raise


@dataclass(frozen=True)
class Part:
    """One server's share of a game: its client (the lease holder), the task, the episode and its output."""

    client: SwarmClient
    task: Any
    episode_id: str
    output: Any  # a float, an EpisodeOutput, or anything with `.reward`


@dataclass
class GameCommit:
    decision: Decision
    acknowledged: list[str]  # servers that applied the decision
    pending: dict[str, Exception] = field(default_factory=dict)  # servers that did not (yet): re-driven later
    prepare_errors: dict[str, Exception] = field(default_factory=dict)  # why the decision is ABORT

    @property
    def committed(self) -> bool:
        """The game counts: COMMIT is decided (a pending server gets its episode from the re-drive or the log)."""
        return self.decision is Decision.COMMIT


def commit_game(decisions: DecisionLog, game_id: str, parts: Mapping[str, Part], *,
                prepare_timeout_s: float = DEFAULT_PREPARE_TIMEOUT_S, io: Executor | None = None,
                stop: threading.Event = _NEVER) -> GameCommit:
    """Prepare the game's episode on every server, decide durably, then commit (or abort) everywhere.

    `io` runs the calls to the servers concurrently: the coordinator passes its own executor, one for all its games;
    default: a thread pool for this call only. `stop`: the run is stopping; a server that does not answer is not
    retried past the try under way (see the module docstring), and is left `pending`.
    """
    decisions.begin(game_id, {name: Participant(p.client.url, p.episode_id, p.client.client_id)
                         for name, p in parts.items()})
    decide_by = time.time() + prepare_timeout_s / 2
    decision_log = str(decisions.path.resolve())

    def prepare(part: Part) -> object:
        return persist(lambda timeout: part.client.prepare_episode(
            part.task, part.episode_id, part.output, game_id=game_id, prepare_timeout_s=prepare_timeout_s,
            decision_log=decision_log, timeout=timeout), part.client.timeout, stop)

    def commit(part: Part) -> object:
        return persist(lambda timeout: part.client.commit_episode(part.episode_id, timeout=timeout),
                       prepare_timeout_s / 2, stop)

    def abort(part: Part) -> object:
        return persist(lambda timeout: part.client.abort_episode(part.episode_id, timeout=timeout),
                       part.client.timeout, stop)

    with _executor(io, len(parts)) as pool:
        prepare_errors = _on_each(parts, prepare, pool)
        decision = decisions.decide(game_id, commit=not prepare_errors, decide_by=decide_by)
        pending = _on_each(parts, commit if decision is Decision.COMMIT else abort, pool)
    if not pending:
        decisions.done(game_id)
    for name, exc in pending.items():
        logger.warning("game %s: %s not yet told %s (%s); the re-drive or the server's deadline will", game_id, name,
                    decision.value, exc)
    return GameCommit(decision, [name for name in parts if name not in pending], pending, prepare_errors)


def redrive(decisions: DecisionLog, admin_token: str | Mapping[str, str | None] | None = None, *,
            timeout: float = 30.0, io: Executor | None = None) -> dict[str, GameCommit]:
    """Apply every unfinished game's decision on all its servers (ABORT where none was made); by game id.

    `admin_token`: one token for every server, or a mapping from server url to its token. `io` runs each game's
    servers concurrently (default: one thread pool for this re-drive).
    """
    def token_of(who: Participant) -> str | None:
        return admin_token.get(who.url) if isinstance(admin_token, Mapping) else admin_token

    outcomes = {}
    with _executor(io, 4) as pool:
        for game in decisions.unfinished():
            decision = game.decision or decisions.decide(game.game_id, commit=False)
            pending = _on_each(game.participants,
                               lambda who, decision=decision: _apply(decision, who, token_of(who), timeout), pool)
            if not pending:
                decisions.done(game.game_id)
            outcomes[game.game_id] = GameCommit(decision, [n for n in game.participants if n not in pending], pending)
    return outcomes


def _apply(decision: Decision, who: Participant, admin_token: str | None, timeout: float) -> None:
    with SwarmClient(who.url, admin_token, client_id=who.client_id, timeout=timeout) as client:
        if decision is Decision.COMMIT:
            client.commit_episode(who.episode_id)
        else:
            client.abort_episode(who.episode_id)


@contextlib.contextmanager
def _executor(io: Executor | None, threads: int) -> Iterator[Executor]:
    """`io` as it is (its owner shuts it down), or a thread pool of `threads` for the block only."""
    if io is not None:
        yield io
        return
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="two-phase") as pool:
        yield pool


def _on_each(parts: Mapping[str, T], action: Callable[[T], object], pool: Executor) -> dict[str, Exception]:
    """Run `action` on every part concurrently on `pool`; the errors, by server name."""
    futures = {name: pool.submit(action, part) for name, part in parts.items()}
    errors = {}
    for name, future in futures.items():
        try:
            future.result()
        except (SwarmError, httpx.HTTPError) as exc:
            errors[name] = exc
    return errors
