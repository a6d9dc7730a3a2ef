"""Reading a role's policy off its server: N replies at every information state it plays, counted by the action
each names (marl/eval/info_states.py says what is asked and how a reply is read).

A role of a trainable (or past_of) server is read at the checkpoints asked for (`initial`, `latest`, a step, a
directory: as `marl eval` names them), each served by a static `marl serve`; a role of a static server is read off
its model; a scripted role's policy is the script's own probabilities, exactly.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import openai

from marl.eval.exploitability import PlayerPolicy, StatePolicy
from marl.eval.info_states import InfoState, NotMeasurable, PolicySeats, PromptedState, info_states
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
    exact: bool = False  # a held role's policy from its token logprobs instead of samples (`read_exactly`)


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
        read = read_exactly if settings.exact and source.choice else sample_states
        states = read(endpoint, prompts, replace(settings, choice=source.choice), on_state)
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


def read_exactly(endpoint: StaticEndpoint, prompts: Sequence[PromptedState], settings: ReadSettings,
                 on_state: Callable[[int, int], None] = lambda done, total: None) -> list[StatePolicy]:
    """Each prompt's policy as a held role plays it, exactly: every legal move is asked for once, held to itself,
    with its token logprobs (the model's own), and `held_probabilities` turns them into what sampling held to all
    the moves at `settings.temperature` would pick. Tens of times cheaper than sampling, and without its noise."""
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=2, timeout=600)
    with ThreadPoolExecutor(settings.concurrency) as pool:
        paths = [{move: pool.submit(_move_logprobs, client, endpoint.model, prompt, move, settings.max_tokens)
                  for move in prompt.moves} for prompt in prompts]
        states = []
        for i, (prompt, moves) in enumerate(zip(prompts, paths)):
            shares = held_probabilities({move: path.result() for move, path in moves.items()}, settings.temperature)
            states.append(StatePolicy(prompt.info, exact={prompt.parse(move): share for move, share in shares.items()}))
            on_state(i + 1, len(prompts))
    client.close()
    return states


def _move_logprobs(client: openai.OpenAI, model: str | None, prompt: PromptedState, move: str,
                   max_tokens: int) -> list[tuple[str, float]]:
    """The tokens that spell `move` as the reply, each with the model's logprob there: (token, logprob) each."""
    response = client.chat.completions.create(model=model or "default", messages=prompt.messages,  # type: ignore[arg-type]
                                              max_tokens=max_tokens, temperature=1.0, seed=0, logprobs=True,
                                              extra_body={"structured_outputs": {"choice": [move]}})
    reply = response.choices[0]
    tokens, text = [], ""
    for entry in (reply.logprobs.content if reply.logprobs else None) or []:
        if text == move:  # what follows ends the reply, and holding picks no end over another
            break
        tokens.append((entry.token, entry.logprob))
        text += entry.token
    if text != move:
        raise NotMeasurable(f"the reply held to {move!r} came back as {reply.message.content!r} with tokens"
                            f" {[t for t, _ in tokens]}: it cannot be read exactly (read it by sampling)")
    return tokens


def held_probabilities(paths: Mapping[str, Sequence[tuple[str, float]]], temperature: float) -> dict[str, float]:
    """What sampling held to these moves picks, from each move's tokens and their logprobs: at each token the held
    sampler renormalises the model's probabilities (at `temperature`) over the tokens that continue some move, so a
    move's share is the product, along its tokens, of its token's share among its siblings in the moves' trie."""
    if temperature <= 0:
        raise NotMeasurable("an exact reading at temperature 0 is the greedy move; read it with --temperature > 0")
    moves = list(paths)
    for a in moves:
        for b in moves:
            if a != b and [t for t, _ in paths[b][:len(paths[a])]] == [t for t, _ in paths[a]]:
                raise NotMeasurable(f"the tokens of move {a!r} begin those of {b!r}: an exact reading would need"
                                    " the end token's probability (read it by sampling)")
    siblings: dict[tuple[str, ...], dict[str, float]] = {}  # prefix -> next token -> its logprob / temperature
    for path in paths.values():
        for k, (token, logprob) in enumerate(path):
            siblings.setdefault(tuple(t for t, _ in path[:k]), {}).setdefault(token, logprob / temperature)
    shares = {}
    for move, path in paths.items():
        log_share = 0.0
        for k, (token, _) in enumerate(path):
            scores = siblings[tuple(t for t, _ in path[:k])]
            top = max(scores.values())
            log_share += scores[token] - top - math.log(sum(math.exp(v - top) for v in scores.values()))
        shares[move] = math.exp(log_share)
    return shares


def _count(info: InfoState, actions: Sequence[int | None]) -> StatePolicy:
    counts = {a: 0 for a in info.actions}
    for action in actions:
        if action is not None:
            counts[action] += 1
    return StatePolicy(info, counts, sum(action is None for action in actions))
