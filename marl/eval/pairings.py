"""Pairings: which snapshot plays each role, and one pairing's games, played on static servers.

A pairing seats a snapshot (marl/league/snapshots.py) in every role played by a trainable or a past_of server (a role of
a LoRA policy: a snapshot of that policy, its adapter on the server's base model); the other
roles play as the topology says (a local static server is started like a snapshot, an external endpoint is used as
it is, a scripted role is the env's). Every server is static, so games lease nothing and nothing is trained or
recorded on a server. Game i of every pairing plays task `eval-i` with seed `seed * 1_000_003 + i`
(`marl.games.schedule.tasks`), so pairings differ in who plays, never in what is played.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from marl.games.record import GameRecord
from marl.games.schedule import play_games, tasks
from marl.league.snapshots import (
    INITIAL,
    LATEST,
    Snapshot,
    SnapshotError,
    StaticFleet,
    resolve_snapshot,
    role_checkpoints,
)
from marl.runner.endpoints import Endpoint, StaticEndpoint
from marl.topology import ServerKind, Topology
from marl.transaction.coordinator import Coordinator, GameSettings


class EvalFailed(RuntimeError):
    """A pairing's games kept failing (the last failure says why)."""


@dataclass(frozen=True)
class EvalSettings:
    games: int = 16
    seed: int = 0
    temperature: float = 0.0  # greedy: an evaluation measures the policy, not its exploration
    concurrency: int = 4
    max_tokens: int = 64
    max_failures: int = 5
    lease_timeout_s: float = 60.0


@dataclass(frozen=True)
class Pairing:
    seats: dict[str, Snapshot]  # role -> the snapshot that plays it

    @property
    def label(self) -> str:
        return " ".join(f"{role}={snapshot.label}" for role, snapshot in self.seats.items()) or "(no model plays)"

    def describe(self) -> dict[str, dict]:
        return {role: {"server": s.server, "policy": s.policy, "version": s.version, "model": s.model,
                       "adapter": s.adapter, "label": s.label}
                for role, s in self.seats.items()}


def checkpointed_roles(topology: Topology) -> list[str]:
    """Roles played by a trainable or a past_of server (a LoRA policy's roles too): the ones a pairing chooses
    checkpoints for (file order)."""
    servers = topology.spec.servers
    return [role for role, server in topology.players().items()
            if server is not None and (servers[server].trainable or servers[server].past_of is not None)]


def plan_pairings(topology: Topology, run_dir: Path, choices: Mapping[str, Sequence[str]]) -> list[Pairing]:
    """Every combination of the checkpoints chosen per role (a role not chosen plays `latest`), in role order; a
    role's checkpoints are its learner's (`role_checkpoints`: a role of a LoRA policy plays that policy's).
    Raises `SnapshotError` for an unknown role, a role without checkpoints, or a checkpoint that does not exist
    (`latest` too, unless the role's list asks for `initial` as well: then both are the initial model, said so)."""
    roles = checkpointed_roles(topology)
    for role in choices:
        if role not in topology.spec.roles:
            raise SnapshotError(f"unknown role {role!r}; roles: {', '.join(topology.spec.roles)}")
        if role not in roles:
            who = topology.server_of(role) or "the env's script"
            raise SnapshotError(f"role {role} is played by {who}, which has no checkpoints: only roles of trainable"
                                f" or past_of servers take one ({', '.join(roles) or 'none here'})")
    options = []
    for role in roles:
        source = role_checkpoints(topology, role)
        refs = choices.get(role, [LATEST])
        options.append([resolve_snapshot(topology, run_dir, source, ref, latest_may_be_initial=INITIAL in refs)
                        for ref in refs])
    return [Pairing(dict(zip(roles, combination))) for combination in itertools.product(*options)]


def run_dir_of(topology: Topology, given: str | None) -> Path:
    """The run directory whose checkpoints an evaluation plays: `--run-dir` as given, which must exist (a typo must
    not play initial models as if trained), else `run.run_dir`. Raises `SnapshotError`."""
    if given is None:
        return Path(topology.spec.run.run_dir)
    if not Path(given).is_dir():
        raise SnapshotError(f"--run-dir {given}: no such directory; give the run directory `marl run` wrote"
                            " (runs/<name> by default, its checkpoints in servers/<server>/checkpoints)")
    return Path(given)


def fleet_devices(topology: Topology) -> dict[str, str | None]:
    """The device each server's snapshots load on: its own `device:`."""
    return {name: server.device for name, server in topology.spec.servers.items()}


def seat_endpoints(topology: Topology, pairing: Pairing,
                   fleet: StaticFleet) -> tuple[dict[str, Endpoint], dict[str, str | None]]:
    """(endpoints by name, role -> endpoint name) for the pairing's games; starts the snapshots not served yet."""
    servers = topology.spec.servers
    static_models = {role: Snapshot(server, None, servers[server].model, trainable=False,
                                    revision=servers[server].revision)
                     for role, server in topology.players().items()
                     if server is not None and servers[server].kind is ServerKind.LOCAL_STATIC}
    seats: dict[str, Snapshot] = {**static_models, **pairing.seats}
    served = fleet.endpoints(seats.values())
    endpoints = {endpoint.name: endpoint for endpoint in served.values()}
    role_servers: dict[str, str | None] = {}
    for role, server in topology.players().items():
        if role in seats:
            role_servers[role] = served[seats[role]].name
        elif server is not None:  # an external OpenAI endpoint, used as it is
            spec = servers[server]
            endpoints[server] = StaticEndpoint(server, base_url=spec.url, model=spec.model,
                                               api_key=os.environ.get(spec.api_key_env or "", "none"))
            role_servers[role] = server
        else:
            role_servers[role] = None
    return endpoints, role_servers


def play_pairing(topology: Topology, pairing: Pairing, fleet: StaticFleet, settings: EvalSettings, *,
                 should_stop: Callable[[], bool] = lambda: False) -> list[GameRecord]:
    """The pairing's games, in seed order. Raises `EvalFailed` when a game failed `max_failures` times in a row."""
    endpoints, role_servers = seat_endpoints(topology, pairing, fleet)
    coordinator = Coordinator(
        env_factory=topology.make_env, role_servers=role_servers, endpoints=endpoints, linked_servers=[],
        settings=GameSettings(max_tokens=settings.max_tokens, temperature=settings.temperature,
                              lease_timeout_s=settings.lease_timeout_s))
    try:
        stats = play_games(coordinator, tasks("eval", 1, settings.seed), concurrency=settings.concurrency,
                           games=settings.games, max_failures=settings.max_failures, should_stop=should_stop)
    finally:
        coordinator.close()
    if stats.error:
        raise EvalFailed(f"pairing {pairing.label}: {stats.error}")
    return sorted(stats.results, key=lambda game: game.seed)
