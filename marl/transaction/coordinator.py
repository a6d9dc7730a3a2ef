"""The coordinator: every game is one transaction across the model servers of a topology.

For each game it
1. leases on every server the game links (the trainable servers that play a role the env deals) at once, the
   servers' own answers saying when to wait (a busy one says how long; a stopped one is revived by the run's
   `ServerMonitor`); if any lease fails, it aborts the others and waits again (it never holds a lease on one server
   while waiting for another);
2. draws the static endpoints the game seats (for a pool of past snapshots, a `past_of` server, the snapshot this
   game plays against);
3. plays the game on those leases and endpoints with its `GameTable` (marl/games/table.py): a player for every
   agent's `Seat`, the PettingZoo AEC game to its end, its `GameRecord`; a `runner` may play it elsewhere
   (`run.ray.spread_games`: a Ray task, marl/runner/ray_cluster.py);
4. commits each server's episode with the rewards of the roles that server plays and the game's provenance
   (metadata `co_players`: every role's server and policy version): with one linked server, `end` (atomic by
   itself); with several, a two-phase commit (`marl.transaction.two_phase`: prepare everywhere, the decision written to
   the decision log, commit everywhere), so every server gets its episode or none does. Any exception before the commit
   aborts every lease of the game.
A game with no trainable server (every role static or scripted: `marl eval`) leases nothing and commits nothing.
The result is a `GameRecord` (marl/games/record.py). Which games to play, and replaying failed ones with the same task
id so GRPO groups line up across servers, is `marl/games/schedule.py`'s job.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai

from envs.base import GameEnv
from marl.client import EpisodeOutput, SwarmError, connection_limits
from marl.games.record import GameRecord
from marl.games.table import GameFailed, GameSettings, GameTable, Seat
from marl.protocol import EngineState, ErrorCode
from marl.runner.endpoints import HeldLease, SnapshotPoolEndpoint, StaticEndpoint
from marl.runner.server_watch import ServerMonitor
from marl.transaction.decision_log import DecisionLog
from marl.transaction.two_phase import Part, commit_game, persist

if TYPE_CHECKING:
    from marl.runner.endpoints import Endpoint

__all__ = ["Coordinator", "GameCancelled", "GameFailed", "GameRunner", "GameSettings", "GameTable",
           "linked_servers_of"]

log = logging.getLogger("marl.transaction.coordinator")

_KEEPALIVE_POLL_S = 0.25  # how often the coordinator looks for leases due for renewal
_ABORT_S = 10.0  # how long aborting a lease retries a server that does not answer (its lease expires anyway)
_STOPPING_ABORT_S = 2.0  # the same once the run stops, so that a dead server does not hold the exit up
_NEVER = threading.Event()  # the `cancel` of a game nobody cancels


class GameCancelled(GameFailed):
    """The game was cancelled while it waited for its leases (the run is stopping); it held none."""


def linked_servers_of(env: GameEnv, role_servers: Mapping[str, str | None],
                      endpoints: Mapping[str, Endpoint]) -> list[str]:
    """The trainable servers that play a role `env` deals: every game leases on each of them.

    Raises ValueError if the env deals a role that `role_servers` does not place.
    """
    dealt = env.dealt_roles()
    unplaced = sorted(set(dealt) - set(role_servers))
    if unplaced:
        raise ValueError(f"the env deals roles {unplaced} that role_servers does not place ({sorted(role_servers)})")
    return sorted({server for role, server in role_servers.items()
                   if role in dealt and server is not None and endpoints[server].trainable})


#: How a coordinator plays a game once leased: `(table, task_id, seed, leases, statics, episode=...) -> GameRecord`
#: (`episode` as a keyword). Default: here (`GameTable.play`); `marl.runner.ray_cluster` plays it as a Ray task on
#: any node.
GameRunner = Callable[..., GameRecord]


class Coordinator:
    def __init__(
        self,
        *,
        env_factory: Callable[[], GameEnv],
        role_servers: Mapping[str, str | None],
        endpoints: Mapping[str, Endpoint],
        settings: GameSettings | None = None,
        player_factory: Callable[[Seat], Any] | None = None,
        linked_servers: Sequence[str] | None = None,
        monitor: ServerMonitor | None = None,
        decisions: DecisionLog | None = None,
        runner: GameRunner | None = None,
    ):
        """`role_servers` maps each role to the server that plays it (None: scripted by the env): `marl run` passes
        `Topology.players()`.

        `linked_servers`: the servers every game leases on (`Topology.linked_servers()`); default:
        `linked_servers_of` a fresh env. `monitor`: the run's `ServerMonitor`, watching every linked server; the
        coordinator asks it to revive a server that refused a lease because it is OFFLINE (default: one of its own,
        which reads on demand). `decisions`: the durable log of the two-phase commits of games that
        link several servers (`marl run` keeps it in the run dir; default: one of its own in a temporary directory).
        `player_factory(seat)` builds the player of each agent at each game: an object with `act(observation: str)
        -> str` (and optionally `close()`, called when the game ends). Default: `default_player`. `runner`: where
        each game is played once its leases are held (default: in the calling thread); leasing and committing stay
        here either way.
        """
        self.table = GameTable(env_factory, role_servers, settings or GameSettings(), player_factory)
        self.role_servers, self.settings = self.table.role_servers, self.table.settings
        self.endpoints = endpoints
        self.runner = runner or self._play_here
        if linked_servers is None:
            linked_servers = linked_servers_of(env_factory(), role_servers, endpoints)
        self.linked = list(linked_servers)
        self._own_monitor = monitor is None
        self.monitor = monitor or ServerMonitor({name: endpoints[name] for name in self.linked})
        self._limits = {
            name: threading.BoundedSemaphore(ep.max_concurrency) for name, ep in endpoints.items() if ep.max_concurrency
        }
        # One pool for every game's calls to the servers (begins, the two-phase commit, renewals): no pool per game.
        # Its threads start only when calls overlap, so the cap costs nothing while few games run at once.
        self._io = ThreadPoolExecutor(max(16, 4 * len(endpoints)), thread_name_prefix="coordinator-io")
        self._static_clients: dict[str, openai.OpenAI] = {}  # base URL -> the client of a fixed static endpoint
        self._static_clients_lock = threading.Lock()
        self._leases = _HeldLeases(endpoints, self._io)
        self._refused_last: frozenset[str] = frozenset()  # servers that refused the last lease try: asked first
        self._scratch = tempfile.TemporaryDirectory(prefix="marl-decisions-") if decisions is None else None
        self.decisions = decisions or DecisionLog(Path(self._scratch.name) / "decisions.sqlite")

    # --- one game ------------------------------------------------------------------------------------------------

    def play_game(self, task_id: str, seed: int, *, episode: int = 0, cancel: threading.Event = _NEVER
                  ) -> GameRecord:
        """Play and commit one game, the `episode`-th of task `task_id` (see `GameTable.play`). Raises `GameFailed`
        (every lease aborted), or `GameCancelled` if `cancel` was set while the game waited for its leases. Once
        `cancel` is set (the run stops), the commit and the aborts stop retrying a server that does not answer after
        one short try (`marl.transaction.two_phase.persist`)."""
        with self._concurrency_slots():
            leases = self._lease_all(cancel)
            try:
                with contextlib.ExitStack() as drawn:
                    result = self.runner(self.table, task_id, seed, leases, self._draw_statics(drawn), episode=episode)
                self._commit(task_id, leases, result, cancel)
                return result
            except BaseException as exc:
                self._leases.abort(leases.values(), timeout=_STOPPING_ABORT_S if cancel.is_set() else _ABORT_S)
                if isinstance(exc, (GameFailed, KeyboardInterrupt, SystemExit)):
                    raise
                raise GameFailed(f"game {task_id} failed: {exc!r}") from exc

    def _play_here(self, table: GameTable, task_id: str, seed: int, leases: dict[str, HeldLease],
                   statics: dict[str, StaticEndpoint], episode: int = 0) -> GameRecord:
        return table.play(task_id, seed, leases, statics, self._shared_client, episode=episode)

    @functools.cached_property
    def _seated_statics(self) -> list[str]:
        """The static servers every game seats: those playing a role the env deals (each game deals every one)."""
        statics = {server for server in self.role_servers.values()
                   if server in self.endpoints and not self.endpoints[server].trainable}
        if not statics:  # no env to build
            return []
        dealt = self.table.env_factory().dealt_roles()
        return sorted({self.role_servers[role] for role in dealt if self.role_servers.get(role) in statics})

    def _draw_statics(self, drawn: contextlib.ExitStack) -> dict[str, StaticEndpoint]:
        """Every static server a game seats -> the endpoint it plays on: its own, or for a pool of snapshots the
        snapshot drawn for this game (held by `drawn` until the game ends)."""
        statics = {}
        for server in self._seated_statics:
            endpoint = self.endpoints[server]
            if isinstance(endpoint, SnapshotPoolEndpoint):
                endpoint = drawn.enter_context(endpoint.snapshots.draw())
            statics[server] = endpoint
        return statics

    def _shared_client(self, seat: Seat) -> openai.OpenAI | None:
        """One client per fixed static endpoint, shared by its seats; a drawn snapshot's seats get their own. Keyed
        by URL: a server that moved (a Ray actor restarted elsewhere) gets a client for its new URL."""
        if isinstance(self.endpoints[seat.server], SnapshotPoolEndpoint):
            return None
        with self._static_clients_lock:
            if seat.base_url not in self._static_clients:
                self._static_clients[seat.base_url] = openai.OpenAI(  # shared by every game's threads
                    base_url=seat.base_url, api_key=seat.api_key, max_retries=2, timeout=600,
                    http_client=openai.DefaultHttpxClient(limits=connection_limits(1000)))
            return self._static_clients[seat.base_url]


    # --- leasing: all or nothing, never holding one while waiting for another -------------------------------------

    def _lease_all(self, cancel: threading.Event) -> dict[str, HeldLease]:
        """Lease on every linked server, or on none.

        While every server answers but some are busy (BOOTING, ROLLING_POST, WEIGHT_SYNCING: a big model's weight
        sync can take minutes), the game waits as long as it takes. `lease_timeout_s` bounds only the time a server
        is unreachable or refuses outright; then the game fails (and is replayed later).
        """
        deadline = time.monotonic() + self.settings.lease_timeout_s
        delay = 0.1
        while True:
            leases, reason, only_busy = self._try_lease_all()
            if leases is not None:
                return leases
            if only_busy:
                deadline = time.monotonic() + self.settings.lease_timeout_s
            elif time.monotonic() > deadline:
                limit = self.settings.lease_timeout_s
                raise GameFailed(f"could not lease on every server within {limit:g}s ({reason})")
            if cancel.wait(delay):
                raise GameCancelled(f"cancelled while waiting for leases ({reason})")
            delay = min(delay * 2, 2.0)

    def _try_lease_all(self) -> tuple[dict[str, HeldLease] | None, str, bool]:
        """One try: (the leases, "", True), or (None, why not, whether every refusal only said "not now").

        The servers' own answers to `begin` are the one source of truth for "may this game lease now?": a busy
        server (booting, draining, training, every slot taken) answers 503 with `retry_after_s`, a stopped one 409
        `engine_not_rolling` (the monitor revives it). No status is read first: a cached state is never newer than
        the answer. The servers that refused the last try are asked first, and alone, so games waiting for one busy
        server hold no lease on the others meanwhile.
        """
        first = [name for name in self.linked if name in self._refused_last]
        leases, errors = self._begin_on(first)
        if not errors:
            more, errors = self._begin_on([name for name in self.linked if name not in first])
            leases.update(more)
        self._refused_last = frozenset(errors)
        if not errors:
            return leases, "", True
        self._leases.abort(leases.values())
        self.monitor.revive_if_offline([name for name, exc in errors.items() if _engine_stopped(exc)])
        return None, "; ".join(f"{name}: {exc}" for name, exc in errors.items()), all(map(_says_wait, errors.values()))

    def _begin_on(self, servers: list[str]) -> tuple[dict[str, HeldLease], dict[str, Exception]]:
        """Begin on `servers` concurrently, one try each: the leases granted, and the refusals by server."""
        futures = {name: self._io.submit(self._leases.begin, name) for name in servers}
        leases, errors = {}, {}
        for name, future in futures.items():
            try:
                leases[name] = future.result()
            except (SwarmError, httpx.HTTPError) as exc:
                errors[name] = exc
        return leases, errors

    def _concurrency_slots(self) -> _Slots:
        return _Slots([self._limits[name] for name in sorted(self._limits) if name in self.linked])

    # --- commit ----------------------------------------------------------------------------------------------------

    def _commit(self, task_id: str, leases: dict[str, HeldLease], result: GameRecord,
                stop: threading.Event = _NEVER) -> None:
        """Every linked server gets its episode with the rewards of the roles it plays, or none does.

        One server: `end` is atomic and idempotent by itself. Several: a two-phase commit
        (`marl.transaction.two_phase`): prepare everywhere, the decision written to the log, then commit everywhere;
        a server that misses the commit gets it from the log (re-drive, or the server's own deadline)."""
        outputs = {name: self._output(name, result) for name in leases}
        if len(leases) == 1:
            (name, lease), = leases.items()
            client = self.endpoints[name].client
            try:
                persist(lambda timeout: client.end_episode(task_id, lease.episode_id, outputs[name], timeout=timeout),
                        60, stop)
            except (SwarmError, httpx.HTTPError) as exc:
                raise GameFailed(f"game {task_id}: end failed on {name}: {exc}") from exc
            self._leases.forget(lease)
            return
        parts = {name: Part(self.endpoints[name].client, task_id, lease.episode_id, outputs[name])
                 for name, lease in leases.items()}
        outcome = commit_game(self.decisions, f"{task_id}-{uuid.uuid4().hex[:12]}", parts,  # one id per attempt
                              io=self._io, stop=stop)
        for lease in leases.values():
            self._leases.forget(lease)  # prepared (key dead), committed or aborted: nothing left to abort or renew
        if not outcome.committed:
            errors = "; ".join(f"{name}: {exc}" for name, exc in outcome.prepare_errors.items())
            raise GameFailed(f"game {task_id}: not committed on any server ({errors})")

    def _output(self, server: str, result: GameRecord) -> EpisodeOutput:
        rewards = {role: r for role, r in result.role_rewards.items() if self.role_servers.get(role) == server}
        return EpisodeOutput(
            reward=sum(rewards.values()) / len(rewards) if rewards else 0.0,
            agent_rewards=rewards,
            metadata={"seed": result.seed, "role_rewards": result.role_rewards, "turns": result.turns,
                      "co_players": {role: player.model_dump() for role, player in result.co_players.items()}},
        )

    # --- leases held ---------------------------------------------------------------------------------------------

    def abort_all(self) -> int:
        """Abort every lease still held (Ctrl-C, the run stops); returns how many. A server that does not answer is
        given up after a short try: its leases expire there by themselves."""
        return self._leases.abort_all()

    def open_leases(self) -> int:
        return self._leases.count()

    def close(self) -> None:
        self._leases.close()
        if self._own_monitor:
            self.monitor.close()
        self._io.shutdown(wait=False, cancel_futures=True)
        if self._scratch is not None:
            self.decisions.close()
            self._scratch.cleanup()


class _HeldLeases:
    """Every lease the coordinator holds: begun here, kept alive, forgotten once ended, aborted on failure or Ctrl-C."""

    def __init__(self, endpoints: Mapping[str, Endpoint], io: ThreadPoolExecutor):
        self.endpoints, self.io = endpoints, io
        self._open: dict[tuple[str, str], HeldLease] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._keep_alive, name="coordinator-keepalive", daemon=True).start()

    def begin(self, server: str) -> HeldLease:
        # One try: the game's own loop does the waiting (`Coordinator._lease_all`), holding no lease meanwhile.
        episode_id, lease = self.endpoints[server].client.begin_episode(timeout=0)
        held = HeldLease(server, episode_id, lease)
        with self._lock:
            self._open[(server, episode_id)] = held
        return held

    def forget(self, held: HeldLease) -> None:
        with self._lock:
            self._open.pop((held.server, held.episode_id), None)

    def abort(self, leases: Iterable[HeldLease], timeout: float = _ABORT_S) -> None:
        """Abort the leases still held (one already ended, prepared or aborted is left alone), each retried at most
        `timeout` while its server does not answer."""
        for held in list(leases):
            with self._lock:
                if (held.server, held.episode_id) not in self._open:
                    continue
            try:
                self.endpoints[held.server].client.abort_episode(held.episode_id, timeout=timeout)
            except (SwarmError, httpx.HTTPError) as exc:  # the server is gone: its lease dies with it (or expires)
                log.warning("could not abort %s on %s: %s", held.episode_id, held.server, exc)
            self.forget(held)

    def abort_all(self) -> int:
        with self._lock:
            held = list(self._open.values())
        self.abort(held, timeout=_STOPPING_ABORT_S)
        return len(held)

    def count(self) -> int:
        with self._lock:
            return len(self._open)

    def close(self) -> None:
        self._closed.set()

    def _keep_alive(self) -> None:
        """Renew every held lease at a quarter of its patience.

        A lease expires after `patience_s` without a model call, but in a game a role may rightly wait for minutes
        (Werewolves' seer acts once a night while three werewolves talk), so the coordinator vouches for the leases
        of the games it is playing. If the coordinator dies, the renewals stop and the servers reclaim the slots.
        """
        while not self._closed.wait(_KEEPALIVE_POLL_S):
            with self._lock:
                held = list(self._open.values())
            now = time.monotonic()
            for lease in held:
                if now - lease.renewed_at < lease.lease.patience_s / 4:
                    continue
                lease.renewed_at = now
                try:
                    self.io.submit(self._renew, lease)  # in parallel: a dead server must not delay the others
                except RuntimeError:  # closed meanwhile
                    return

    def _renew(self, lease: HeldLease) -> None:
        try:
            self.endpoints[lease.server].client.renew_episode(lease.episode_id, timeout=10)
        except (SwarmError, httpx.HTTPError) as exc:  # gone or ended meanwhile: the game finds out by itself
            log.debug("could not renew %s on %s: %s", lease.episode_id, lease.server, exc)


def _says_wait(exc: Exception) -> bool:
    """A refusal that means "not now": busy (it says how long to wait), or stopped (to be revived: OFFLINE)."""
    return isinstance(exc, SwarmError) and exc.error is not None and (
        exc.error.retry_after_s is not None or exc.code is ErrorCode.ENGINE_NOT_ROLLING)


def _engine_stopped(exc: Exception) -> bool:
    return isinstance(exc, SwarmError) and exc.code is ErrorCode.ENGINE_NOT_ROLLING and exc.state is EngineState.OFFLINE


class _Slots:
    """Per-server concurrency caps, taken in a fixed order so two games never deadlock."""

    def __init__(self, semaphores: list[threading.BoundedSemaphore]):
        self.semaphores = semaphores

    def __enter__(self) -> None:
        for sem in self.semaphores:
            sem.acquire()

    def __exit__(self, *exc: object) -> None:
        for sem in reversed(self.semaphores):
            sem.release()


#: Names that left this module, kept for one release: old name -> (module, its name there). Resolved lazily, and
#: never imported here (an imported name would be found without the warning); `marl.games.schedule` imports this module.
_MOVED = {
    "Endpoint": ("marl.runner.endpoints", "legacy_endpoint"),
    "SnapshotSource": ("marl.runner.endpoints", "SnapshotSource"),
    "play_games": ("marl.games.schedule", "play_games"),
    "tasks": ("marl.games.schedule", "tasks"),
    "RunStats": ("marl.games.schedule", "RunStats"),
    "default_player": ("marl.games.table", "default_player"),
    "GameResult": ("marl.games.record", "GameRecord"),
}


def __getattr__(name: str) -> Any:
    """Names that moved (to `marl.runner.endpoints`, `marl.games.schedule`, `marl.games.table`,
    `marl.games.record`), kept for one release with a DeprecationWarning."""
    import importlib
    import warnings

    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, new = _MOVED[name]
    where = (f"{module} (one of TrainableEndpoint, StaticEndpoint, SnapshotPoolEndpoint)" if name == "Endpoint"
             else f"{module}.{new}")
    warnings.warn(f"marl.coordinator.{name} moved to {where}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), new)
