"""marl: train heterogeneous teams of LLM agents with multi-agent RL.

Every model lives on its own swarm server (`servers/`); agents reach it through an OpenAI-compatible endpoint that
the server hands out per episode (a lease). This package is the orchestration side and needs no GPU:

- `SwarmClient`: typed, thread-safe HTTP client of one swarm server (config, start/stop, status, episode leases).
- `EpisodeOutput`: what an episode reports (reward, per-agent rewards, metadata).
- `SwarmError`, `SwarmRefused`, `SwarmTimeout`: what a failed server call raises; `ErrorCode`: their `.code`.
- `marl.protocol`: the wire protocol (request/response models) shared with the servers.

Names are imported lazily, so `import marl` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

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
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from marl.client import Episode, EpisodeOutput, SwarmClient, SwarmError, SwarmRefused, SwarmTimeout
    from marl.protocol import ADMIN_TOKEN_ENV, RUNNING_STATES, EngineState, EpisodeLease, ErrorCode, TrainConfig


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'marl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: the next lookup skips __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
