"""The coordinator: every game is one transaction across the model servers of a topology.

For each game it
1. waits until every server the game links (the trainable servers that play a role the env deals) is ROLLING, as
   the run's `ServerMonitor` sees it, then leases on all of them at once; if any lease fails, it aborts the others
   and waits again (it never holds a lease on one server while waiting for another);
2. gives each agent its own player: it describes the agent's `Seat` (a trainable role gets the credentials of its
   server's lease, tagged with the role; a static role its fixed endpoint, or for a pool of past snapshots (a
   `past_of` server, `marl/league.py`) the snapshot drawn for this game; a scripted role the env) and asks the
   `player_factory` for an object with `act(observation) -> reply` (default: `default_player`, an OpenAI-SDK
   `LLMAgent` or the env's scripted policy; `marl.agentscope_agents` gives AgentScope agents);
3. plays the PettingZoo AEC game (the env is a `envs.base.GameEnv`);
4. commits each server's episode with the rewards of the roles that server plays and the game's provenance
   (metadata `co_players`: every role's server and policy version): with one linked server, `end` (atomic by
   itself); with several, a two-phase commit (`marl.two_phase`: prepare everywhere, the decision written to the
   decision log, commit everywhere), so every server gets its episode or none does. Any exception before the commit
   aborts every lease of the game.
A game with no trainable server (every role static or scripted: `marl eval`) leases nothing and commits nothing.
The result is a `GameRecord` (marl/game_record.py). Which games to play, and replaying failed ones with the same task
id so GRPO groups line up across servers, is `marl/games.py`'s job.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import httpx
import openai

from envs.base import GameEnv
from marl.agents import LLMAgent, ScriptedAgent
from marl.client import EpisodeOutput, SwarmClient, SwarmError
from marl.decision_log import DecisionLog
from marl.game_record import CoPlayer, GameRecord
from marl.monitor import ServerMonitor
from marl.protocol import AGENT_HEADER, EngineState, EpisodeLease
from marl.two_phase import Part, commit_game

log = logging.getLogger("marl.coordinator")

_LEASE_ATTEMPT_S = 2.0
_KEEPALIVE_POLL_S = 0.25  # how often the coordinator looks for leases due for renewal
_NEVER = threading.Event()  # the `cancel` of a game nobody cancels


class GameFailed(Exception):
    """A game could not be played or committed; all of its leases were aborted (or had already ended)."""


class GameCancelled(GameFailed):
    """The game was cancelled while it waited for its leases (the run is stopping); it held none."""


class SnapshotSource(Protocol):
    """A pool of static servers on past checkpoints of a trainable server (`marl.league.SnapshotPool`)."""

    def draw(self) -> contextlib.AbstractContextManager[Endpoint]:
        """A static endpoint on one snapshot (with its `policy_version` and `snapshot_of`), kept serving until the
        context exits."""


@dataclass
class Endpoint:
    """How the coordinator reaches one server of the topology."""

    name: str
    client: SwarmClient | None = None  # a trainable swarm server: episodes are leased
    base_url: str | None = None  # a static OpenAI-compatible endpoint
    api_key: str = "none"
    model: str | None = None
    max_concurrency: int | None = None
    #: Synced (and the engine started) whenever the server is found OFFLINE, e.g. after a crash and restart.
    train_config: dict | None = None
    #: A static endpoint on a known checkpoint: its policy version, and the trainable server it is a snapshot of
    #: (recorded as the game's provenance; None: unknown, e.g. an external model).
    policy_version: int | None = None
    snapshot_of: str | None = None
    #: A `past_of` server: no endpoint of its own; every game draws one of its snapshots.
    snapshots: SnapshotSource | None = None

    @property
    def trainable(self) -> bool:
        return self.client is not None


@dataclass(frozen=True)
class Seat:
    """One env agent's seat at one game: what a `player_factory` gets to build the player of that agent."""

    agent: str  # the env agent, e.g. "player_3"
    role: str  # the role it plays this game; its calls carry it as their agent tag (see `agent_tag`)
    server: str | None  # the topology server playing the role; None: scripted by the env
    system_prompt: str = ""
    base_url: str | None = None  # OpenAI-compatible: the lease's endpoint (trainable) or the static server's
    api_key: str = "none"
    model: str | None = None
    trainable: bool = False  # True: base_url/api_key belong to this game's lease, valid only while it lives
    max_tokens: int = 64
    temperature: float = 1.0
    env: Any = field(default=None, repr=False, compare=False)  # the game's env, for scripted play

    @property
    def agent_tag(self) -> str:
        """What the server records the seat's calls under (the `X-Marl-Agent` header): the role."""
        return self.role


def default_player(seat: Seat, client: openai.OpenAI | None = None) -> LLMAgent | ScriptedAgent:
    """The env's scripted policy for a scripted seat, else an `LLMAgent` on the seat's endpoint.

    `client` is an OpenAI client to reuse (the coordinator shares one per static server); default: a new one for the
    seat's endpoint, without retries on a lease (a retried call could be recorded twice).
    """
    if seat.server is None:
        return ScriptedAgent(seat.env, seat.agent)
    if client is None:
        client = openai.OpenAI(base_url=seat.base_url, api_key=seat.api_key, max_retries=0 if seat.trainable else 2,
                               timeout=600, default_headers={AGENT_HEADER: seat.agent_tag})
    return LLMAgent(client, seat.model, system_prompt=seat.system_prompt, max_tokens=seat.max_tokens,
                    temperature=seat.temperature, agent_tag=seat.agent_tag)


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


@dataclass
class GameSettings:
    max_tokens: int = 64
    temperature: float = 1.0
    lease_timeout_s: float = 60.0  # give up leasing a game after this long (the game is then retried)


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
    ):
        """`role_servers` maps each role to the server that plays it (None: scripted by the env): `marl run` passes
        `Topology.players()`.

        `linked_servers`: the servers every game leases on (`Topology.linked_servers()`); default:
        `linked_servers_of` a fresh env. `monitor`: the run's `ServerMonitor`, watching every linked server (default:
        one of its own, which reads on demand). `decisions`: the durable log of the two-phase commits of games that
        link several servers (`marl run` keeps it in the run dir; default: one of its own in a temporary directory).
        `player_factory(seat)` builds the player of each agent at each game: an object with `act(observation: str)
        -> str` (and optionally `close()`, called when the game ends). Default: `default_player`.
        """
        self.env_factory = env_factory
        self.role_servers = dict(role_servers)
        self.endpoints = endpoints
        self.settings = settings or GameSettings()
        self.player_factory = player_factory or self._default_player
        if linked_servers is None:
            linked_servers = linked_servers_of(env_factory(), role_servers, endpoints)
        self.linked = list(linked_servers)
        self._own_monitor = monitor is None
        self.monitor = monitor or ServerMonitor({name: endpoints[name] for name in self.linked})
        self._limits = {
            name: threading.BoundedSemaphore(ep.max_concurrency) for name, ep in endpoints.items() if ep.max_concurrency
        }
        self._io = ThreadPoolExecutor(max(4, 2 * len(endpoints)), thread_name_prefix="coordinator-io")
        self._static_clients = {
            name: openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=2, timeout=600)
            for name, ep in endpoints.items()
            if not ep.trainable and ep.snapshots is None
        }
        self._leases = _HeldLeases(endpoints, self._io)
        self._scratch = tempfile.TemporaryDirectory(prefix="marl-decisions-") if decisions is None else None
        self.decisions = decisions or DecisionLog(Path(self._scratch.name) / "decisions.sqlite")

    # --- one game ------------------------------------------------------------------------------------------------

    def play_game(self, task_id: str, seed: int, *, cancel: threading.Event = _NEVER) -> GameRecord:
        """Play and commit one game. Raises `GameFailed` (every lease aborted), or `GameCancelled` if `cancel` was
        set while the game waited for its leases."""
        with self._concurrency_slots():
            leases = self._lease_all(cancel)
            try:
                result = self._play(task_id, seed, leases)
                self._commit(task_id, leases, result)
                return result
            except BaseException as exc:
                self._leases.abort(leases.values())
                if isinstance(exc, (GameFailed, KeyboardInterrupt, SystemExit)):
                    raise
                raise GameFailed(f"game {task_id} failed: {exc!r}") from exc

    def _play(self, task_id: str, seed: int, leases: dict[str, _Lease]) -> GameRecord:
        start = time.monotonic()
        env = self.env_factory()
        env.reset(seed=seed)
        with contextlib.ExitStack() as drawn:
            statics = self._draw_statics(env, drawn)
            turns = self._play_turns(env, leases, statics)
        record = GameRecord(
            task_id=task_id,
            seed=seed,
            agent_rewards={agent: float(r) for agent, r in env.outcome().items()},
            role_rewards={role: float(r) for role, r in env.outcome_by_role().items()},
            episodes={name: lease.episode_id for name, lease in leases.items()},
            policy_versions={name: lease.lease.policy_version for name, lease in leases.items()},
            invalid_actions=env.invalid_actions_by_role,
            replies=env.replies_by_role,
            seconds=time.monotonic() - start,
            turns=turns,
            winner=env.winner,
            teams={env.role_of(agent): env.team_of(agent) for agent in env.possible_agents},
            time=time.time(),
            co_players=self._co_players(env, leases, statics),
        )
        env.close()
        return record

    def _play_turns(self, env: GameEnv, leases: dict[str, _Lease], statics: dict[str, Endpoint]) -> int:
        """Seat a player for every agent and play the game to its end; returns the turns played."""
        players: dict[str, Any] = {}
        turns = 0
        try:
            for agent in env.possible_agents:
                players[agent] = self.player_factory(self._seat(env, agent, leases, statics))
            for agent in env.agent_iter():
                observation, _, terminated, truncated, _ = env.last()
                if terminated or truncated:
                    env.step(None)
                    continue
                env.step(players[agent].act(str(observation)))
                turns += 1
        finally:
            _close(players.values())
        return turns

    def _draw_statics(self, env: GameEnv, drawn: contextlib.ExitStack) -> dict[str, Endpoint]:
        """Every static server this game seats -> the endpoint it plays on: its own, or for a pool of snapshots the
        snapshot drawn for this game (held by `drawn` until the game ends)."""
        statics = {}
        for server in {self.role_servers.get(env.role_of(agent)) for agent in env.possible_agents}:
            endpoint = self.endpoints.get(server) if server is not None else None
            if endpoint is None or endpoint.trainable:
                continue
            statics[server] = endpoint if endpoint.snapshots is None else drawn.enter_context(endpoint.snapshots.draw())
        return statics

    def _co_players(self, env: GameEnv, leases: dict[str, _Lease],
                    statics: dict[str, Endpoint]) -> dict[str, CoPlayer]:
        """Who played each role: its server and the policy version that played (the game's provenance)."""
        players = {}
        for role in sorted({env.role_of(agent) for agent in env.possible_agents}):
            server = self.role_servers[role]
            if server is None:
                players[role] = CoPlayer()
            elif server in leases:
                players[role] = CoPlayer(server=server, policy_version=leases[server].lease.policy_version)
            else:
                endpoint = statics[server]
                players[role] = CoPlayer(server=server, policy_version=endpoint.policy_version,
                                         snapshot_of=endpoint.snapshot_of)
        return players

    def _seat(self, env: GameEnv, agent: str, leases: dict[str, _Lease], statics: dict[str, Endpoint]) -> Seat:
        role = env.role_of(agent)
        if role not in self.role_servers:
            raise GameFailed(f"the env dealt role '{role}' to {agent}, but the topology has no role '{role}'")
        server = self.role_servers[role]
        seat = Seat(agent, role, server, system_prompt=env.system_prompt(agent), max_tokens=self.settings.max_tokens,
                    temperature=self.settings.temperature, env=env)
        if server is None:
            return seat
        if self.endpoints[server].trainable:
            lease = leases[server].lease
            return replace(seat, base_url=lease.base_url, api_key=lease.api_key, model=lease.model, trainable=True)
        endpoint = statics[server]
        return replace(seat, base_url=endpoint.base_url, api_key=endpoint.api_key, model=endpoint.model)

    def _default_player(self, seat: Seat) -> LLMAgent | ScriptedAgent:
        # One shared client per fixed static server; a lease or a drawn snapshot gets its own.
        shared = None if seat.server is None or seat.trainable else self._static_clients.get(seat.server)
        return default_player(seat, shared)

    # --- leasing: all or nothing, never holding one while waiting for another -------------------------------------

    def _lease_all(self, cancel: threading.Event) -> dict[str, _Lease]:
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

    def _try_lease_all(self) -> tuple[dict[str, _Lease] | None, str, bool]:
        """One try: (the leases, "", True), or (None, why not, whether every server answered and is only busy)."""
        states = {name: self.monitor.state(name) for name in self.linked}
        unreachable = [name for name, state in states.items() if state is None]
        if unreachable:
            return None, "unreachable: " + ", ".join(unreachable), False
        busy = {name: state for name, state in states.items() if state != EngineState.ROLLING}
        if busy:
            return None, ", ".join(f"{name} is {state.value}" for name, state in busy.items()), True
        futures = {name: self._io.submit(self._leases.begin, name) for name in self.linked}
        leases, errors = {}, {}
        for name, future in futures.items():
            try:
                leases[name] = future.result()
            except (SwarmError, httpx.HTTPError) as exc:
                errors[name] = exc
        if not errors:
            return leases, "", True
        self._leases.abort(leases.values())
        self.monitor.forget(errors)
        # A server that turned busy meanwhile says how long to wait: keep waiting, as for a busy state.
        return None, "; ".join(f"{name}: {exc}" for name, exc in errors.items()), all(map(_says_wait, errors.values()))

    def _concurrency_slots(self) -> _Slots:
        return _Slots([self._limits[name] for name in sorted(self._limits) if name in self.linked])

    # --- commit ----------------------------------------------------------------------------------------------------

    def _commit(self, task_id: str, leases: dict[str, _Lease], result: GameRecord) -> None:
        """Every linked server gets its episode with the rewards of the roles it plays, or none does.

        One server: `end` is atomic and idempotent by itself. Several: a two-phase commit (`marl.two_phase`):
        prepare everywhere, the decision written to the log, then commit everywhere; a server that misses the
        commit gets it from the log (re-drive, or the server's own deadline)."""
        outputs = {name: self._output(name, result) for name in leases}
        if len(leases) == 1:
            (name, lease), = leases.items()
            try:
                self.endpoints[name].client.end_episode(task_id, lease.episode_id, outputs[name], timeout=60)
            except (SwarmError, httpx.HTTPError) as exc:
                raise GameFailed(f"game {task_id}: end failed on {name}: {exc}") from exc
            self._leases.forget(lease)
            return
        parts = {name: Part(self.endpoints[name].client, task_id, lease.episode_id, outputs[name])
                 for name, lease in leases.items()}
        outcome = commit_game(self.decisions, f"{task_id}-{uuid.uuid4().hex[:12]}", parts)  # one id per attempt
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
        """Abort every lease still held (Ctrl-C); returns how many."""
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


@dataclass
class _Lease:
    server: str
    episode_id: str
    lease: EpisodeLease
    renewed_at: float = field(default_factory=time.monotonic)


class _HeldLeases:
    """Every lease the coordinator holds: begun here, kept alive, forgotten once ended, aborted on failure or Ctrl-C."""

    def __init__(self, endpoints: Mapping[str, Endpoint], io: ThreadPoolExecutor):
        self.endpoints, self.io = endpoints, io
        self._open: dict[tuple[str, str], _Lease] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._keep_alive, name="coordinator-keepalive", daemon=True).start()

    def begin(self, server: str) -> _Lease:
        episode_id, lease = self.endpoints[server].client.begin_episode(timeout=_LEASE_ATTEMPT_S)
        held = _Lease(server, episode_id, lease)
        with self._lock:
            self._open[(server, episode_id)] = held
        return held

    def forget(self, held: _Lease) -> None:
        with self._lock:
            self._open.pop((held.server, held.episode_id), None)

    def abort(self, leases: Iterable[_Lease]) -> None:
        """Abort the leases still held (one already ended, prepared or aborted is left alone)."""
        for held in list(leases):
            with self._lock:
                if (held.server, held.episode_id) not in self._open:
                    continue
            try:
                self.endpoints[held.server].client.abort_episode(held.episode_id, timeout=10)
            except (SwarmError, httpx.HTTPError) as exc:  # the server is gone: its lease dies with it (or expires)
                log.warning("could not abort %s on %s: %s", held.episode_id, held.server, exc)
            self.forget(held)

    def abort_all(self) -> int:
        with self._lock:
            held = list(self._open.values())
        self.abort(held)
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

    def _renew(self, lease: _Lease) -> None:
        try:
            self.endpoints[lease.server].client.renew_episode(lease.episode_id, timeout=10)
        except (SwarmError, httpx.HTTPError) as exc:  # gone or ended meanwhile: the game finds out by itself
            log.debug("could not renew %s on %s: %s", lease.episode_id, lease.server, exc)


def _close(players: Iterable[Any]) -> None:
    """Close every player that can be closed (a player's `close()` is optional)."""
    for player in players:
        close = getattr(player, "close", None)
        if close is not None:
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - a player that cannot clean up must not fail the game
                log.warning("could not close player %r: %s", player, exc)


def _says_wait(exc: Exception) -> bool:
    return isinstance(exc, SwarmError) and exc.error is not None and exc.error.retry_after_s is not None


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
