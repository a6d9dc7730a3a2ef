"""Reading a role's policy off its server: N replies at every information state it plays, counted by the action
each names (marl/eval/info_states.py says what is asked and how a reply is read).

A role of a trainable (or past_of) server is read at the checkpoints asked for (`initial`, `latest`, a step, a
directory: as `marl eval` names them), each served by a static `marl serve`; a role of a static server is read off
its model; a scripted role's policy is the script's own probabilities, exactly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import openai

from marl.eval.exploitability import PlayerPolicy, StatePolicy
from marl.eval.info_states import InfoState, PolicySeats, PromptedState, info_states
from marl.league.snapshots import (
    INITIAL,
    LATEST,
    Snapshot,
    SnapshotError,
    StaticFleet,
    resolve_snapshot,
    role_checkpoints,
)
from marl.runner.endpoints import StaticEndpoint
from marl.topology import ServerKind, Topology

SCRIPTED = "scripted"


@dataclass(frozen=True)
class ReadSettings:
    samples: int = 64  # replies per information state
    temperature: float = 1.0
    max_tokens: int = 16
    concurrency: int = 16
    seed: int = 0
    choice: bool = False  # hold each reply to the legal moves, as the role's games do (`roles.R.sampling.choice`)


@dataclass(frozen=True)
class RoleSource:
    """What plays a role at one measurement: a snapshot to serve, a static server's model, or the env's script."""

    role: str
    label: str
    snapshot: Snapshot | None = None  # None: scripted
    choice: bool = False  # the role's replies are held to the legal moves (`roles.R.sampling.choice`)


def role_sources(topology: Topology, seats: PolicySeats, run_dir: Path,
                 choices: Mapping[str, Sequence[str]]) -> dict[str, list[RoleSource]]:
    """Per role the seats play, what to read: the checkpoints chosen (default `latest`) of a trainable or past_of
    server's role, the model of a static one, the script of a scripted one. Raises `SnapshotError`."""
    roles = list(dict.fromkeys(r for p in range(seats.game.num_players()) for r in seats.roles_at(p)))
    for role in choices:
        if role not in roles:
            raise SnapshotError(f"unknown role {role!r}; the measured roles: {', '.join(roles)}")
    servers = topology.spec.servers
    sources: dict[str, list[RoleSource]] = {}
    for role in roles:
        server, sampling = topology.server_of(role), topology.spec.roles[role].sampling
        held = bool(sampling and sampling.choice)
        if server is None:
            sources[role] = [RoleSource(role, SCRIPTED)]
        elif servers[server].trainable or servers[server].past_of is not None:
            learner = role_checkpoints(topology, role)
            refs = choices.get(role, [LATEST])
            sources[role] = [RoleSource(role, ref, resolve_snapshot(topology, run_dir, learner, ref,
                                                                    latest_may_be_initial=INITIAL in refs), held)
                             for ref in refs]
        elif servers[server].kind is ServerKind.LOCAL_STATIC:
            if role in choices:
                raise SnapshotError(f"role {role} is played by static server {server}: it has no checkpoints")
            sources[role] = [RoleSource(role, "static", Snapshot(server, None, servers[server].model or "",
                                                                 trainable=False, revision=servers[server].revision),
                                        held)]
        else:
            raise SnapshotError(f"role {role} is played by {server}, an endpoint marl does not serve: read a policy"
                                " off a local server (trainable, past_of or static) or a scripted role")
    return sources


def read_policy(seats: PolicySeats, source: RoleSource, fleet: StaticFleet, settings: ReadSettings,
                on_state: Callable[[int, int], None] = lambda done, total: None) -> list[PlayerPolicy]:
    """The role's policy as each player it plays (one `PlayerPolicy` per player)."""
    players = [p for p in range(seats.game.num_players()) if source.role in seats.roles_at(p)]
    infos = [info for info in info_states(seats.game) if info.player in players]
    if source.snapshot is None:
        states = [StatePolicy(info, exact=seats.scripted(info, source.role)) for info in infos]
    else:
        endpoint = fleet.endpoints([source.snapshot])[source.snapshot]
        prompts = [seats.prompt(info, source.role) for info in infos]
        states = sample_states(endpoint, prompts, replace(settings, choice=source.choice), on_state)
    return [PlayerPolicy(source.role, source.label, p, [s for s in states if s.info.player == p]) for p in players]


def sample_states(endpoint: StaticEndpoint, prompts: Sequence[PromptedState], settings: ReadSettings,
                  on_state: Callable[[int, int], None] = lambda done, total: None) -> list[StatePolicy]:
    """`settings.samples` replies to each prompt, concurrently (the engine batches them), counted by action."""
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=2, timeout=600)
    states = []
    with ThreadPoolExecutor(settings.concurrency) as pool:
        for i, prompt in enumerate(prompts):
            replies = pool.map(lambda k, p=prompt: _reply(client, endpoint.model, p, settings, k),
                               range(settings.samples))
            states.append(_count(prompt.info, [prompt.parse(reply) for reply in replies]))
            on_state(i + 1, len(prompts))
    client.close()
    return states


def _reply(client: openai.OpenAI, model: str | None, prompt: PromptedState, settings: ReadSettings, k: int) -> str:
    # a seed per (state, sample): the same settings read the same replies again
    seed = int.from_bytes(hashlib.sha256(f"{settings.seed}/{prompt.info.key}/{k}".encode()).digest()[:6], "big")
    held = {"structured_outputs": {"choice": prompt.moves}} if settings.choice and prompt.moves else None
    response = client.chat.completions.create(model=model or "default", messages=prompt.messages,  # type: ignore[arg-type]
                                              max_tokens=settings.max_tokens, temperature=settings.temperature,
                                              seed=seed, extra_body=held)
    return response.choices[0].message.content or ""


def _count(info: InfoState, actions: Sequence[int | None]) -> StatePolicy:
    counts = {a: 0 for a in info.actions}
    for action in actions:
        if action is not None:
            counts[action] += 1
    return StatePolicy(info, counts, sum(action is None for action in actions))
