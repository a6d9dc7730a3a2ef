"""marl: train heterogeneous teams of LLM agents with multi-agent RL.

Every model lives on its own swarm server (`servers/`); agents reach it through an OpenAI-compatible endpoint that
the server hands out per episode (a lease). This package is the orchestration side and needs no GPU. What user code
imports from `marl` (its `__all__`, pinned by tests/project/test_public_api.py):

- one server: `SwarmClient` (typed, thread-safe HTTP client: config, start/stop, status, episode leases), `Episode`,
  `EpisodeOutput`; `SwarmError`, `SwarmRefused`, `SwarmTimeout` (a failed call) with `ErrorCode` (their `.code`);
  from the wire protocol `TrainConfig`, `EpisodeLease`, `EngineState`, `RUNNING_STATES`, `ADMIN_TOKEN_ENV`;
- games across servers: `Coordinator` (one game as a transaction), how it reaches each server
  (`TrainableEndpoint`, `StaticEndpoint`, `SnapshotPoolEndpoint`), `GameSettings`, `Seat`, `GameFailed`,
  `GameCancelled`; many games: `play_games`, `episodes`, `tasks`, `RunStats`, `FailedAttempt`, `CallbackFailed`;
- players: `LLMAgent`, `ScriptedAgent`, `default_player`;
- records: `GameRecord` (a games.jsonl row), `Sampling`, `CoPlayer`, `read_games`;
- envs: `TextAECEnv`, `GameEnv`, `RoleInfo`, `InvalidAction` (from `envs.base`; docs/envs.md);
- topologies: `Topology` (`Topology.load(path, overrides)`), `TopologyError`.
`marl.protocol` holds the whole wire protocol.

Names are imported lazily, so `import marl` stays cheap. A public name that moves or is renamed keeps working where
it was, with a DeprecationWarning, for at least one release (CHANGELOG.md says which).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from marl import moved

__version__ = "0.1.0"

moved.install()  # old paths of moved modules keep importing, warning (marl/moved.py)

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "SwarmClient": "marl.client",
    "Episode": "marl.client",
    "EpisodeOutput": "marl.client",
    "SwarmError": "marl.client",
    "SwarmRefused": "marl.client",
    "SwarmTimeout": "marl.client",
    "ADMIN_TOKEN_ENV": "marl.protocol",
    "RUNNING_STATES": "marl.protocol",
    "EngineState": "marl.protocol",
    "EpisodeLease": "marl.protocol",
    "ErrorCode": "marl.protocol",
    "TrainConfig": "marl.protocol",
    "Coordinator": "marl.transaction.coordinator",
    "GameCancelled": "marl.transaction.coordinator",
    "TrainableEndpoint": "marl.runner.endpoints",
    "StaticEndpoint": "marl.runner.endpoints",
    "SnapshotPoolEndpoint": "marl.runner.endpoints",
    "GameFailed": "marl.games.table",
    "GameSettings": "marl.games.table",
    "Seat": "marl.games.table",
    "default_player": "marl.games.table",
    "play_games": "marl.games.schedule",
    "tasks": "marl.games.schedule",
    "episodes": "marl.games.schedule",
    "RunStats": "marl.games.schedule",
    "FailedAttempt": "marl.games.schedule",
    "CallbackFailed": "marl.games.schedule",
    "LLMAgent": "marl.agents",
    "ScriptedAgent": "marl.agents",
    "GameRecord": "marl.games.record",
    "Sampling": "marl.games.record",
    "CoPlayer": "marl.games.record",
    "read_games": "marl.games.record",
    "TextAECEnv": "envs.base",
    "GameEnv": "envs.base",
    "RoleInfo": "envs.base",
    "InvalidAction": "envs.base",
    "Topology": "marl.topology",
    "TopologyError": "marl.topology",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from envs.base import GameEnv, InvalidAction, RoleInfo, TextAECEnv
    from marl.agents import LLMAgent, ScriptedAgent
    from marl.client import Episode, EpisodeOutput, SwarmClient, SwarmError, SwarmRefused, SwarmTimeout
    from marl.games.record import CoPlayer, GameRecord, Sampling, read_games
    from marl.games.schedule import CallbackFailed, FailedAttempt, RunStats, episodes, play_games, tasks
    from marl.games.table import GameFailed, GameSettings, Seat, default_player
    from marl.protocol import ADMIN_TOKEN_ENV, RUNNING_STATES, EngineState, EpisodeLease, ErrorCode, TrainConfig
    from marl.runner.endpoints import SnapshotPoolEndpoint, StaticEndpoint, TrainableEndpoint
    from marl.topology import Topology, TopologyError
    from marl.transaction.coordinator import Coordinator, GameCancelled


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'marl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: the next lookup skips __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
