"""`marl check-env`'s games: one trainable swarm server (`marl serve` on 127.0.0.1) playing every role of the env,
a topology of that one server built in memory, games played by the coordinator as `marl run` plays them, and the
GRPO step their episodes complete.

The games are played in pairs of one deal (`run.repeats` 2; 1 for an odd `--games`), each deal a GRPO group per role
that called its model, and a step trains one group (`batch_size` 1): the first step starts as soon as the first deal
ended, as in a run, and the check waits for one after the last game (a role whose agents never had a turn leaves no
group to train: a game of the tiny model's invalid replies may end before the other side moves). A game that fails
ends the games at once (`run.max_failures` 1): the env raised, or the server refused.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from marl.testing.env_target import CheckFailed, CheckOptions, env_section

if TYPE_CHECKING:
    from marl.client import SwarmClient
    from marl.games.record import GameRecord
    from marl.topology import Topology

#: the topology's one server
SERVER = "model"
#: a tiny model's context: long enough for any env's conversation (its rotary positions cost no weights)
TINY_CONTEXT = 32768
#: how long the GRPO step may take once the games ended
STEP_TIMEOUT_S = 120.0


@dataclass
class Played:
    records: list[GameRecord]
    data_dir: Path  # the server's: its ledger
    log_path: Path
    server: str = SERVER
    problems: list[str] = field(default_factory=list)  # games that failed, a step that never came


def topology_dict(options: CheckOptions, roles: Mapping[str, int], model: str, device: str | None) -> dict:
    """A topology of one trainable server playing every role, training one group a step."""
    repeats = 2 if options.games % 2 == 0 else 1
    server: dict[str, Any] = {"model": model, "trainable": True,
                              "train": {"job": "check-env", "batch_size": 1, "num_repeat": repeats, "save_freq": 0}}
    if device is not None:
        server["device"] = device
    return {"name": "check-env", "servers": {SERVER: server},
            "roles": {role: {"server": SERVER} for role in roles},
            "env": env_section(options.target, options.args),
            "run": {"games": options.games, "repeats": repeats, "concurrency": 2, "max_tokens": options.max_tokens,
                    "max_failures": 1}}


def play_on_tiny_server(options: CheckOptions, roles: Mapping[str, int], work: Path,
                        say: Callable[[str], None]) -> Played:
    """Start the server, play `options.games` games on it, wait for a GRPO step on them, stop it."""
    from marl.client import SwarmClient, SwarmError
    from marl.runner.launch import ServerStartError, last_error_line
    from marl.testing.serving import server_process
    from marl.topology import Topology, TopologyError

    model, device = _model(options, work)
    try:
        topology = Topology.from_dict(topology_dict(options, roles, model, device))
    except TopologyError as exc:
        raise CheckFailed(str(exc)) from None
    (work / "topology.yaml").write_text(yaml.safe_dump(topology.to_dict(), sort_keys=False))
    data_dir, started = work / "server", time.monotonic()
    played = Played([], data_dir, work / "server.log")
    try:
        with server_process(model, data_dir, device=device, served_name=None, log_path=played.log_path) as proc:
            client = SwarmClient(proc.url, admin_token=proc.admin_token, max_wait_s=300)
            client.auto_sync_train_config_and_start_engine(topology.spec.servers[SERVER].train)
            what = "a tiny random model" if options.model is None else model
            say(f"server: {what}, trainable, on {proc.url}: engine running in {time.monotonic() - started:.1f}s")
            _play(topology, client, work, played, say)
            if not played.problems:
                _wait_for_step(client, played, say)
    except ServerStartError as exc:
        raise CheckFailed(str(exc)) from None
    except SwarmError as exc:  # the server refused or died: its log says why
        last = last_error_line(played.log_path)
        raise CheckFailed(f"the server failed: {str(exc).splitlines()[0]}" + (f"; its log: {last}" if last else "")
                          ) from None
    return played


def _model(options: CheckOptions, work: Path) -> tuple[str, str | None]:
    """The model to serve and its device: `--model` where the server puts it, else a tiny one built here (CPU)."""
    if options.model is not None:
        return options.model, None
    from transformers.utils import logging as transformers_logging

    from marl.testing.tiny_model import build_tiny_model

    transformers_logging.disable_progress_bar()  # "Writing model shards": noise beside the check's lines
    return str(build_tiny_model(work / "tiny-model", max_position_embeddings=TINY_CONTEXT)), "cpu"


def _play(topology: Topology, client: SwarmClient, work: Path, played: Played, say: Callable[[str], None]) -> None:
    """The games, through the coordinator as `marl run` plays them; each recorded in games.jsonl."""
    from marl.games.record import append_game
    from marl.games.schedule import episodes, play_games
    from marl.runner.endpoints import TrainableEndpoint
    from marl.transaction.coordinator import Coordinator, GameSettings

    run, started = topology.spec.run, time.monotonic()
    endpoint = TrainableEndpoint(SERVER, client=client, train_config=topology.spec.servers[SERVER].train)
    coordinator = Coordinator(
        env_factory=topology.make_env, role_servers=topology.role_learners(), endpoints={SERVER: endpoint},
        settings=GameSettings(lease_timeout_s=run.lease_timeout_s, max_tokens=run.max_tokens,
                              temperature=run.temperature, transcripts=run.transcripts),
        linked_servers=topology.linked_learners())
    try:  # a failed game is the verdict's reason: the schedule's warning about it would say it twice more
        with open(work / "games.jsonl", "w") as games_file, _quiet("marl.games.schedule"):
            stats = play_games(coordinator, episodes(topology.name, run.repeats, run.seed),
                               concurrency=run.concurrency, games=run.games, max_failures=run.max_failures,
                               on_result=lambda record: append_game(games_file, record))
    finally:
        coordinator.close()
    played.records = list(stats.results)
    say(f"games: {stats.games} of {run.games} played in {time.monotonic() - started:.1f}s"
        f" ({run.concurrency} at a time), {stats.failed} failed")
    if stats.error:
        played.problems.append(f"a game failed: {stats.error}")
    elif stats.games < (run.games or 0):
        played.problems.append(f"only {stats.games} of {run.games} games were played")


def _step_text(metrics: Mapping[str, float]) -> str:
    """The last step's metrics in words."""
    groups, flat = metrics.get("groups", 0), metrics.get("groups_zero_variance", 0)
    text = (f"the last step trained {metrics.get('samples', 0):.0f} samples ({metrics.get('tokens_trained', 0):.0f}"
            f" tokens) of {groups:.0f} GRPO group{'s' if groups != 1 else ''} in {metrics.get('seconds', 0):.1f}s")
    return text + (f" ({flat:.0f} with one reward throughout: nothing to learn)" if flat else "")


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """`logger`'s warnings left out while the block runs (its errors still show)."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _wait_for_step(client: SwarmClient, played: Played, say: Callable[[str], None]) -> None:
    """Wait for a training step on the games' episodes (one may have run while they played); a problem if no group
    is complete to train on, or none came in time."""
    from marl.protocol import EngineState

    started = time.monotonic()
    while time.monotonic() - started < STEP_TIMEOUT_S:
        status = client.status()
        if status.policy_version >= 1:
            steps = client.monitor().recent_steps
            say(f"training: policy version {status.policy_version}; " + _step_text(steps[-1].metrics if steps else {}))
            return
        pool = client.pool()
        if status.state == EngineState.ROLLING and pool.complete_groups < pool.batch_size:
            played.problems.append(f"no training step: the games left no complete GRPO group to train on"
                                   f" ({pool.pending_episodes} episodes in the pool)")
            return
        time.sleep(0.1)
    played.problems.append(f"no training step within {STEP_TIMEOUT_S:.0f}s of the last game (server state"
                           f" {client.status().state.value}; log: {played.log_path})")
