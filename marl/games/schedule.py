"""Many games: which task each game plays, how many are in flight, when one is replayed, and when a run stops.

`play_games` keeps up to `concurrency` games in flight, each on its own worker thread. Its promises:
- `games=N` is the number of games played and reported to `on_result`, never more: a worker starts a new game only
  while the games finished plus those in flight are fewer than N.
- The schedule yields each game's (task id, seed) or (task id, seed, episode); `episodes` is `marl run`'s.
- A game that fails is replayed in the same slot with the same task id, seed and episode (so every task still reaches
  `repeats` episodes on every server), after a pause that grows with each attempt. Failed attempts and replays are
  counted apart from games (`RunStats.failed`, `RunStats.retried`); every failed attempt goes to `on_failure`.
- A game that fails `max_failures` times in a row ends the run, and `RunStats.error` says which game and why (its
  last failure). A server restart costs a game one or two attempts (leasing waits while a server is unreachable, up
  to `lease_timeout_s` per attempt); a deterministic failure (an env that raises, a scripted role without a scripted
  move) fails every attempt at once and ends the run within half a minute (the pauses add up to 20 s).
- `should_stop()` (asked before every game and twice a second) ends the run early: games still waiting for a lease
  give up, games already playing finish and are reported.
- A callback that raises (`on_result`, `on_failure`, `should_stop`, or the `schedule` iterator) is never lost: it
  stops the run as `should_stop` would (games already playing finish, are committed and still go to `on_result`),
  and once every worker has returned `play_games` raises `CallbackFailed` chained to the first such exception
  (`exc.__cause__`), with the tallies in `exc.stats`. A finite `schedule` that runs out ends the run normally.
"""

from __future__ import annotations

import inspect
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from marl.games.record import GameRecord
from marl.transaction.coordinator import Coordinator, GameCancelled, GameFailed

log = logging.getLogger("marl.games.schedule")

#: What `play_games` plays: each game's (task id, seed), or (task id, seed, episode)
Schedule = Iterable[tuple[str, int] | tuple[str, int, int]]
MAX_FAILURES = 5  # failed attempts in a row after which a game ends the run (`run.max_failures`)
_CHECK_S = 0.5  # how often the waiting thread asks `should_stop` (short joins also keep Ctrl-C responsive)


def episodes(run_name: str, repeats: int, seed: int) -> Iterator[tuple[str, int, int]]:
    """Endless (task id, env seed, episode) triples, `marl run`'s schedule: each task `repeats` times in a row (one
    GRPO group per task), its episodes numbered 0 to repeats - 1."""
    index = 0
    while True:
        for episode in range(repeats):
            yield f"{run_name}-{index}", seed * 1_000_003 + index, episode
        index += 1


def tasks(run_name: str, repeats: int, seed: int) -> Iterator[tuple[str, int]]:
    """`episodes` without the episode: (task id, env seed) pairs, each repeated `repeats` times in a row."""
    return ((task_id, task_seed) for task_id, task_seed, _ in episodes(run_name, repeats, seed))


def retry_pause_s(attempt: int) -> float:
    """Pause before replaying a game that failed `attempt` times: 2 s, 4 s, 6 s, ... at most 10 s."""
    return min(2.0 * attempt, 10.0)


@dataclass
class RunStats:
    games: int = 0  # games finished and reported
    failed: int = 0  # failed attempts
    retried: int = 0  # replays of a failed game
    results: list[GameRecord] = field(default_factory=list)
    error: str | None = None  # why the run gave up (a game that failed `max_failures` times in a row)


class CallbackFailed(RuntimeError):
    """A callback of `play_games` raised: the run was stopped. `__cause__` is the callback's own exception, `stats`
    the run's tallies when it stopped, `callback` which one raised (`on_result`, `on_failure`, `should_stop`)."""

    def __init__(self, callback: str, exc: BaseException, stats: RunStats):
        super().__init__(f"{callback} raised {exc!r}; the run stopped after {stats.games} games")
        self.callback, self.stats = callback, stats


@dataclass(frozen=True)
class FailedAttempt:
    task_id: str
    attempt: int  # 1 for the game's first try
    error: GameFailed
    retrying: bool  # False: the game is given up (the run ends or stops)


class _Games:
    """The shared state of one `play_games` call: slots, tallies, the stop signal."""

    def __init__(self, coordinator: Coordinator, schedule: Schedule, *, games: int | None,
                 max_failures: int, should_stop: Callable[[], bool], on_result: Callable[[GameRecord], None],
                 on_failure: Callable[[FailedAttempt], None], keep_results: bool = True):
        self.coordinator, self.games, self.max_failures = coordinator, games, max_failures
        self.keep_results = keep_results
        self.schedule = iter(schedule)  # a list of (task id, seed) pairs works too
        self.should_stop, self.on_result, self.on_failure = should_stop, on_result, on_failure
        self.stats = RunStats()
        self.started = 0  # games given a slot: finished or in flight (a replay keeps its game's slot)
        self.lock = threading.RLock()  # reentrant: `call` notes a failure under it while `claim` holds it
        self.stop = threading.Event()  # set: no new game, no replay, and games waiting for a lease give up
        self.exhausted = False  # the schedule ran out
        self.callback_error: tuple[str, BaseException] | None = None  # the first callback that raised, its name

    def call(self, name: str, callback: Callable[..., Any], *args: Any) -> Any:
        """Run a user callback on a worker thread. One that raises stops the run and is kept for `play_games` to
        raise: left alone, it would end only this worker, with a traceback on stderr, and the run would report
        success after fewer games than asked."""
        try:
            return callback(*args)
        except (Exception, SystemExit) as exc:  # a thread drops SystemExit without a word; Ctrl-C is left alone
            log.error("%s raised %r: stopping the run", name, exc)
            with self.lock:
                self.callback_error = self.callback_error or (name, exc)
            self.stop.set()
            return None

    def raise_callback_error(self) -> None:
        """Raise `CallbackFailed` from the first callback that raised, if one did."""
        if self.callback_error is not None:
            name, exc = self.callback_error
            raise CallbackFailed(name, exc, self.stats) from exc

    def claim(self) -> tuple[str, int, int] | None:
        """A new game's task id, seed and episode (a schedule's pair is episode 0), or None when no more games are
        needed, the schedule ran out, or the run is stopping."""
        if self.call("should_stop", self.should_stop):
            return None
        with self.lock:
            if self.stop.is_set() or self.exhausted or (self.games is not None and self.started >= self.games):
                return None
            game = self.call("schedule", next, self.schedule, None)
            if game is None:  # a finite schedule ran out (or raised: then the run stops too)
                self.exhausted = True
                return None
            self.started += 1
            task_id, seed, *episode = game
            return task_id, seed, episode[0] if episode else 0

    def worker(self) -> None:
        # `call` keeps what escapes a game too (a bug here or in a coordinator subclass): no worker dies unseen.
        self.call("a game worker", self._work)

    def _work(self) -> None:
        while (game := self.claim()) is not None:
            self.play(*game)

    def play(self, task_id: str, seed: int, episode: int) -> None:
        """Play one game until it finishes, fails `max_failures` times in a row, or the run stops."""
        attempt = 1
        while True:
            try:
                result = self.coordinator.play_game(task_id, seed, episode=episode, cancel=self.stop)
            except GameCancelled:
                return
            except GameFailed as exc:
                if not self.failed(task_id, attempt, exc) or self.stop.wait(retry_pause_s(attempt)):
                    return
                attempt += 1
                continue
            with self.lock:
                self.stats.games += 1
                if self.keep_results:
                    self.stats.results.append(result)
            self.call("on_result", self.on_result, result)
            return

    def failed(self, task_id: str, attempt: int, exc: GameFailed) -> bool:
        """Count a failed attempt; True if the game is to be replayed."""
        with self.lock:
            self.stats.failed += 1
            retrying = attempt < self.max_failures and not self.stop.is_set()
            if retrying:
                self.stats.retried += 1
            elif attempt >= self.max_failures and self.stats.error is None:
                self.stats.error = f"game {task_id} failed {attempt} times in a row; the last failure: {exc}"
                self.stop.set()
        log.warning("%s (attempt %d%s)", exc, attempt, ", replaying it" if retrying else "")
        self.call("on_failure", self.on_failure, FailedAttempt(task_id, attempt, exc, retrying))
        return retrying


def play_games(
    coordinator: Coordinator,
    schedule: Schedule,
    *,
    concurrency: int,
    games: int | None = None,
    max_failures: int = MAX_FAILURES,
    should_stop: Callable[[], bool] = lambda: False,
    on_result: Callable[[GameRecord], None] = lambda result: None,
    on_failure: Callable[[FailedAttempt], None] = lambda failure: None,
    max_attempts: int | None = None,
    keep_results: bool = True,
) -> RunStats:
    """Play `games` games (None: until `should_stop()` or the end of a finite `schedule`), `concurrency` at a time;
    see the module docstring.

    `on_result(record)` gets every game played and committed, `on_failure(attempt)` every failed attempt; both are
    called on worker threads. Returns the run's tallies; `RunStats.error` says why the run gave up, if it did.
    `keep_results=False` leaves `RunStats.results` empty: a long run that records its games through `on_result`
    (as `marl run` does, into games.jsonl) then keeps nothing per game in memory.

    Raises `CallbackFailed` (chained to the callback's exception) if `on_result`, `on_failure` or `should_stop`
    raised: the run stopped there, and games already playing were finished and committed first.

    Deprecated, for one release: `on_result(result, error)`, the two-argument callback of
    `marl.transaction.coordinator`'s old `play_games` (called `(record, None)` per game and `(None, GameFailed)` per
    failed attempt), and `max_attempts` (now `max_failures`); both warn.
    """
    on_result, on_failure = _legacy_callbacks(on_result, on_failure)
    if max_attempts is not None:
        warnings.warn("play_games(max_attempts=...) is now max_failures=...", DeprecationWarning, stacklevel=2)
        max_failures = max_attempts
    run = _Games(coordinator, schedule, games=games, max_failures=max_failures, should_stop=should_stop,
                 on_result=on_result, on_failure=on_failure, keep_results=keep_results)
    threads = [threading.Thread(target=run.worker, name=f"game-{i}", daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=_CHECK_S)
                if not run.stop.is_set() and run.call("should_stop", should_stop):
                    run.stop.set()
    finally:  # Ctrl-C included: no worker starts or replays a game after this
        run.stop.set()
    run.raise_callback_error()
    return run.stats


def _legacy_callbacks(on_result: Callable[..., None], on_failure: Callable[[FailedAttempt], None]
                      ) -> tuple[Callable[[GameRecord], None], Callable[[FailedAttempt], None]]:
    """`on_result` and `on_failure` as `play_games` calls them. An `on_result` that takes two arguments is the old
    shape, `(result, error)`: it warns, and gets `(record, None)` per game and `(None, GameFailed)` per failed
    attempt (after `on_failure`), as before."""
    if _required_positional(on_result) != 2:
        return on_result, on_failure
    warnings.warn("play_games(on_result=f) with f(result, error) is deprecated: on_result now takes the GameRecord"
                  " alone, and failed attempts go to on_failure(FailedAttempt)", DeprecationWarning, stacklevel=3)

    def failure(attempt: FailedAttempt) -> None:
        on_failure(attempt)
        on_result(None, attempt.error)

    return (lambda record: on_result(record, None)), failure


def _required_positional(callback: Callable[..., Any]) -> int | None:
    """How many positional arguments `callback` requires (None: its signature cannot be read)."""
    try:
        parameters = inspect.signature(callback).parameters.values()
    except (TypeError, ValueError):  # some builtins
        return None
    return sum(1 for p in parameters if p.default is p.empty
               and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
