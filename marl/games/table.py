"""One game at a table: seat a player for every agent of a PettingZoo AEC game and play it to its end.

The coordinator (marl/transaction/coordinator.py) leases and commits; a `GameTable` plays what happens in between, on
the leases and static endpoints it is handed: it describes every agent's `Seat` (a trainable role gets the credentials
of its server's lease, tagged with the role; a static role its endpoint, or the snapshot drawn for this game; a scripted
role the env), asks the `player_factory` for an object with `act(observation) -> reply` (default: `default_player`,
an OpenAI-SDK `LLMAgent` or the env's scripted policy; `marl.agents.agentscope` gives AgentScope agents), plays, and
returns the game's `GameRecord` with its provenance (`co_players`) and, per `run.transcripts`, its transcript (every
turn's observation and reply) and the env's `summary()`. With `run.explore` (`ExploringStarts`) a share of tasks
open with moves drawn uniformly from the legal ones: each is told to its player as if it had chosen it
(`remember(observation, move)`), so the model answers only from the state those moves reach, or (`trained`) asked of
it with the reply held to the drawn move (`act_held(observation, moves)`), so it is trained like a sampled one.
It holds no connection, lock or thread, so `run.ray.spread_games` can send it to a Ray task
(marl/runner/ray_cluster.py).
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import openai

from envs.base import EPISODE_OPTION, GameEnv
from marl.agents import LLMAgent, ScriptedAgent
from marl.client import connection_limits
from marl.games.record import CoPlayer, GameRecord, Sampling, TranscriptRecorder

if TYPE_CHECKING:
    from marl.runner.endpoints import HeldLease, StaticEndpoint

log = logging.getLogger("marl.games.table")


class GameFailed(Exception):
    """A game could not be played or committed; all of its leases were aborted (or had already ended)."""


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
    top_p: float | None = None  # None: not sent (the server's default)
    stop: tuple[str, ...] | None = None  # None: no stop strings
    choice: bool = False  # True: each reply held to one of the env's legal moves at that turn
    env: Any = field(default=None, repr=False, compare=False)  # the game's env, for scripted play

    @property
    def agent_tag(self) -> str:
        """What the server records the seat's calls under (the `X-Marl-Agent` header): the role."""
        return self.role

    @property
    def sampling(self) -> Sampling:
        """How this seat's model samples: the run's settings, overridden by its role's `sampling:`."""
        return Sampling(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, stop=self.stop,
                        choice=self.choice)


def default_player(seat: Seat, client: openai.OpenAI | None = None) -> LLMAgent | ScriptedAgent:
    """The env's scripted policy for a scripted seat, else an `LLMAgent` on the seat's endpoint.

    `client` is an OpenAI client to reuse (the coordinator shares one per static server); default: a new one for the
    seat's endpoint, without retries on a lease (a retried call could be recorded twice).
    """
    if seat.server is None:
        return ScriptedAgent(seat.env, seat.agent)
    if client is None:
        client = openai.OpenAI(base_url=seat.base_url, api_key=seat.api_key, max_retries=0 if seat.trainable else 2,
                               timeout=600, http_client=seats_http_client())
    moves = (lambda: seat.env.legal_actions(seat.agent)) if seat.choice else None
    return LLMAgent(client, seat.model, system_prompt=seat.system_prompt, max_tokens=seat.max_tokens,
                    temperature=seat.temperature, top_p=seat.top_p, stop=seat.stop, agent_tag=seat.agent_tag,
                    choices=moves)


@functools.cache
def seats_http_client() -> openai.DefaultHttpxClient:
    """The connection pool of every seat's own OpenAI client in this process (thread-safe). An OpenAI client with a
    pool of its own costs about 65 ms of CPU to make (its SSL context loads the CA bundle), several per game; on this
    shared one, 0.2 ms."""
    return openai.DefaultHttpxClient(limits=connection_limits(1000))


@dataclass(frozen=True)
class ExploringStarts:
    """`run.explore`: in `share` of the tasks (every repeat of a task alike: one GRPO group), the game's first `moves`
    moves are drawn uniformly from the legal moves instead of asked of the players. An on-policy learner only sees
    the states its own policy reaches, and a state it has learned to avoid (Kuhn Poker's call with a King after
    checking, once it nearly always bets a King) it stops learning while other states' gradients move it: an
    exploring start reaches it anyway (docs/design.md, "Learning Kuhn Poker on chips"). A turn whose env lists no
    legal moves (free text) is asked of its player as usual.

    `trained`: each drawn move is asked of the model with its reply held to that move (`act_held`), so it is recorded
    and trained like a sampled one, and the moves are drawn per repeat: a GRPO group then compares the moves of its
    first turns under one deal, which on-policy sampling cannot once the policy is nearly sure of one of them.
    Untrained (the default), the moves are told to the players and never trained, alike for a task's repeats."""

    share: float
    moves: int = 1
    trained: bool = False

    def draws(self, seed: int, episode: int = 0) -> random.Random | None:
        """The stream of this game's forced moves (None: it is played as usual): whether from the task's seed alone,
        which moves from it too, or (`trained`) from the seed and the repeat."""
        if random.Random(f"explore/{seed}").random() >= self.share:
            return None
        return random.Random(f"explore/{seed}/{episode}" if self.trained else f"explore/{seed}/moves")


@dataclass
class GameSettings:
    max_tokens: int = 64  # run.max_tokens
    temperature: float = 1.0  # run.temperature
    lease_timeout_s: float = 60.0  # give up leasing a game after this long (the game is then retried)
    transcripts: str = "full"  # run.transcripts: what of each game its GameRecord keeps (full, summary, off)
    #: role -> the sampling settings it sets itself (a topology's `roles.R.sampling`: temperature, top_p,
    #: max_tokens, stop), overriding max_tokens and temperature above for that role's seats
    sampling: dict[str, dict[str, Any]] = field(default_factory=dict)
    explore: ExploringStarts | None = None  # run.explore (None: every move asked of its player)

    def __post_init__(self) -> None:
        for role, overrides in self.sampling.items():  # a misspelt setting must not be dropped without a word
            if unknown := sorted(set(overrides) - set(Sampling.model_fields)):
                raise ValueError(f"sampling of role {role!r}: unknown settings {unknown}; known:"
                                 f" {sorted(Sampling.model_fields)}")

    def sampling_of(self, role: str) -> Sampling:
        """How `role`'s seats sample: the run's settings, then the role's own."""
        run = Sampling(max_tokens=self.max_tokens, temperature=self.temperature)
        return run.model_copy(update=Sampling(**self.sampling.get(role, {})).model_dump(exclude_unset=True))


class GameTable:
    """What playing one game takes once its leases and static endpoints are fixed: the env, who plays each role, the
    sampling settings, the players. It holds no connection, lock or thread, so it can be sent to another process (a
    Ray task, marl/runner/ray_cluster.py) when `env_factory` and `player_factory` can be pickled."""

    def __init__(self, env_factory: Callable[[], GameEnv], role_servers: Mapping[str, str | None],
                 settings: GameSettings, player_factory: Callable[[Seat], Any] | None = None):
        """`player_factory`: see `Coordinator`; None: `default_player`."""
        self.env_factory, self.role_servers, self.settings = env_factory, dict(role_servers), settings
        self.player_factory = player_factory

    def play(self, task_id: str, seed: int, leases: Mapping[str, HeldLease], statics: Mapping[str, StaticEndpoint],
             shared_client: Callable[[Seat], openai.OpenAI | None] = lambda seat: None, *, episode: int = 0
             ) -> GameRecord:
        """Play one game to its end on `leases` (one per trainable server it seats) and `statics` (the endpoint of
        every static server it seats); commits nothing. `shared_client(seat)`: an OpenAI client for a static seat
        that the default player may reuse (None: a client of its own). `episode`: which repeat of its task this
        game is (0, 1, ...), given to the env as `reset`'s option `EPISODE_OPTION` (envs/base.py)."""
        start = time.monotonic()
        env = self.env_factory()
        env.reset(seed=seed, options={EPISODE_OPTION: episode})
        transcript = TranscriptRecorder(self.settings.transcripts)
        forced = _ForcedMoves(self.settings.explore, seed, episode)
        turns = self._play_turns(env, leases, statics, shared_client, transcript, forced)
        transcript.summarize(env)
        record = GameRecord(
            task_id=task_id,
            seed=seed,
            episode=episode,
            agent_rewards={agent: float(r) for agent, r in env.outcome().items()},
            role_rewards={role: float(r) for role, r in env.outcome_by_role().items()},
            episodes={name: lease.episode_id for name, lease in leases.items()},
            policy_versions={name: lease.lease.policy_version for name, lease in leases.items()},
            invalid_actions=env.invalid_actions_by_role,
            replies=env.replies_by_role,
            seconds=time.monotonic() - start,
            turns=turns,
            winner=env.winner,
            goals=goals_by_role(env),
            actions=actions_by_role(env),
            teams={env.role_of(agent): env.team_of(agent) for agent in env.possible_agents},
            time=time.time(),
            co_players=self._co_players(env, leases, statics),
            sampling=self._sampling(env),
            forced_moves=forced.played,
            **transcript.fields(),
        )
        env.close()
        return record

    def _play_turns(self, env: GameEnv, leases: Mapping[str, HeldLease], statics: Mapping[str, StaticEndpoint],
                    shared_client: Callable[[Seat], openai.OpenAI | None], transcript: TranscriptRecorder,
                    forced: _ForcedMoves) -> int:
        """Seat a player for every agent and play the game to its end, noting each turn in `transcript`; returns
        the turns played. A turn `forced` draws is played by `forced.play` (told, or asked held to the move)."""
        players: dict[str, Any] = {}
        turns = 0
        try:
            for agent in env.possible_agents:
                seat = self._seat(env, agent, leases, statics)
                if self.player_factory is not None:
                    players[agent] = self.player_factory(seat)
                else:
                    players[agent] = default_player(seat, None if seat.server is None or seat.trainable
                                                    else shared_client(seat))
            for agent in env.agent_iter():
                observation, _, terminated, truncated, _ = env.last()
                if terminated or truncated:
                    env.step(None)
                    continue
                move = forced.next_move(env, agent)
                if move is None:
                    _step(env, agent, str(observation), players[agent].act(str(observation)), transcript)
                else:
                    reply = forced.play(players[agent], str(observation), move)
                    _step(env, agent, str(observation), reply, transcript, forced=True)
                turns += 1
        finally:
            close_players(players.values())
        return turns

    def _sampling(self, env: GameEnv) -> dict[str, Sampling]:
        """How each role played by a model sampled this game."""
        roles = sorted({env.role_of(agent) for agent in env.possible_agents})
        return {role: self.settings.sampling_of(role) for role in roles if self.role_servers.get(role) is not None}

    def _co_players(self, env: GameEnv, leases: Mapping[str, HeldLease],
                    statics: Mapping[str, StaticEndpoint]) -> dict[str, CoPlayer]:
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

    def _seat(self, env: GameEnv, agent: str, leases: Mapping[str, HeldLease],
              statics: Mapping[str, StaticEndpoint]) -> Seat:
        role = env.role_of(agent)
        if role not in self.role_servers:
            raise GameFailed(f"the env dealt role '{role}' to {agent}, but the topology has no role '{role}'")
        server = self.role_servers[role]
        seat = Seat(agent, role, server, system_prompt=env.system_prompt(agent), env=env,
                    **dict(self.settings.sampling_of(role)))
        if server is None:
            return seat
        if server in leases:
            lease = leases[server].lease
            return replace(seat, base_url=lease.base_url, api_key=lease.api_key, model=lease.model, trainable=True)
        endpoint = statics[server]
        return replace(seat, base_url=endpoint.base_url, api_key=endpoint.api_key, model=endpoint.model)


class _ForcedMoves:
    """One game's exploring start: the moves `ExploringStarts` draws for its first turns, counted as played."""

    def __init__(self, explore: ExploringStarts | None, seed: int, episode: int = 0):
        self.rng = explore.draws(seed, episode) if explore is not None else None
        self.left, self.played = (explore.moves if self.rng is not None else 0), 0
        self.trained = explore is not None and explore.trained

    def next_move(self, env: GameEnv, agent: str) -> str | None:
        """The move to play for `agent` now, or None (asked of its player): one of its legal moves, uniformly, while
        the start lasts. A turn without listed moves ends the start."""
        if self.left <= 0:
            return None
        legal = list(getattr(env, "legal_actions", lambda _agent: None)(agent) or [])
        if not legal:
            self.left = 0
            return None
        self.left, self.played = self.left - 1, self.played + 1
        return self.rng.choice(legal)

    def play(self, player: Any, observation: str, move: str) -> str:
        """Play `move` for `player`: asked of its model held to it (`trained`), or told to it; the reply to play."""
        method = "act_held" if self.trained else "remember"
        if getattr(player, method, None) is None:
            what = "asked with its reply held to it" if self.trained else "told one it did not choose"
            raise GameFailed(f"run.explore draws moves for the players, and {type(player).__name__} cannot be {what}:"
                             f" give it a `{method}(observation, {'moves' if self.trained else 'move'})` method, or"
                             " drop run.explore")
        if self.trained:
            return player.act_held(observation, [move])
        player.remember(observation, move)
        return move


def _step(env: GameEnv, agent: str, observation: str, reply: Any, transcript: TranscriptRecorder, *,
          forced: bool = False) -> None:
    """Play `agent`'s reply and note the turn; it was invalid if the env's count of its invalid replies grew."""
    role, before = env.role_of(agent), _invalid_replies(env, agent)
    env.step(reply)
    after = _invalid_replies(env, agent)
    transcript.add(agent, role, observation, str(reply), None if before is None or after is None else after > before,
                   forced=forced)


def _invalid_replies(env: GameEnv, agent: str) -> int | None:
    """How many invalid replies `agent` made this game, if the env counts them (`TextAECEnv.invalid_actions`)."""
    counts = getattr(env, "invalid_actions", None)
    return counts.get(agent) if isinstance(counts, Mapping) else None


def goals_by_role(env: GameEnv) -> dict[str, bool]:
    """Each role's goal met or not, where the env says (`goal_met`; a role of several agents: every one met it)."""
    goal_met = getattr(env, "goal_met", None)  # an env written to the contract before goals existed has none
    said = {agent: goal_met(agent) for agent in env.possible_agents} if goal_met is not None else {}
    goals: dict[str, bool] = {}
    for agent, met in said.items():
        if met is not None:
            role = env.role_of(agent)
            goals[role] = goals.get(role, True) and bool(met)
    return goals


def actions_by_role(env: GameEnv) -> dict[str, list[str]]:
    """The env's `action_labels()` (optional: what each agent did, as categories) gathered by role."""
    labels = getattr(env, "action_labels", None)
    try:
        said = labels() if labels is not None else {}
    except Exception as exc:  # noqa: BLE001 - a bug in what only describes the game must not cost it; said loudly
        log.warning("%s.action_labels() raised %r: the game's actions are not recorded", type(env).__name__, exc)
        return {}
    out: dict[str, list[str]] = {}
    for agent, labels_of_agent in said.items():
        out.setdefault(env.role_of(agent), []).extend(str(label) for label in labels_of_agent)
    return out


def close_players(players: Iterable[Any]) -> None:
    """Close every player that can be closed (a player's `close()` is optional)."""
    for player in players:
        close = getattr(player, "close", None)
        if close is not None:
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - a player that cannot clean up must not fail the game
                log.warning("could not close player %r: %s", player, exc)
