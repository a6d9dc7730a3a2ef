"""How the coordinator reaches each server of a topology, and the leases it holds on them.

One type per way of reaching a server, so a field is present exactly where it means something:

    TrainableEndpoint     a swarm server (local or remote): every game leases an episode through its `SwarmClient`
    StaticEndpoint        an OpenAI-compatible URL (a local static server, an external API, a served checkpoint)
    SnapshotPoolEndpoint  a `past_of` server: no URL of its own; every game draws one of its snapshots

`Endpoint` is their union: code that needs one kind checks it with `isinstance`, or reads `trainable`. A `HeldLease`
is one episode the coordinator holds on a trainable server while its game runs.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from marl.protocol import EpisodeLease, TrainConfig

if TYPE_CHECKING:
    from marl.client import SwarmClient

__all__ = ["Endpoint", "HeldLease", "SnapshotPoolEndpoint", "SnapshotSource", "StaticEndpoint", "TrainableEndpoint"]


@dataclass
class TrainableEndpoint:
    """A swarm server whose episodes are leased and trained on."""

    name: str
    client: SwarmClient  # replaced when the server moves (a Ray actor restarted elsewhere)
    max_concurrency: int | None = None
    #: Synced (and the engine started) whenever the server is found OFFLINE, e.g. after a crash and restart.
    train_config: TrainConfig | None = None
    trainable: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if isinstance(self.train_config, Mapping):  # the shape before 0.2: the topology's config went as a dict
            warnings.warn("TrainableEndpoint(train_config=dict) is deprecated: pass a marl.TrainConfig",
                          DeprecationWarning, stacklevel=3)
            self.train_config = TrainConfig.model_validate(dict(self.train_config))


@dataclass
class StaticEndpoint:
    """A fixed model behind an OpenAI-compatible URL: nothing is leased or recorded."""

    name: str
    base_url: str
    model: str | None = None
    api_key: str = "none"
    max_concurrency: int | None = None
    #: A served checkpoint: its policy version, and the trainable server it is a snapshot of (recorded as the game's
    #: provenance; None: unknown, e.g. an external model).
    policy_version: int | None = None
    snapshot_of: str | None = None
    trainable: ClassVar[bool] = False


class SnapshotSource(Protocol):
    """A pool of static servers on past checkpoints of a trainable server (`marl.league.SnapshotPool`)."""

    def draw(self) -> contextlib.AbstractContextManager[StaticEndpoint]:
        """A static endpoint on one snapshot (with its `policy_version` and `snapshot_of`), kept serving until the
        context exits."""


@dataclass
class SnapshotPoolEndpoint:
    """A `past_of` server: each game draws one snapshot of the pool and holds it to the end."""

    name: str
    snapshots: SnapshotSource
    max_concurrency: ClassVar[None] = None
    trainable: ClassVar[bool] = False


Endpoint = TrainableEndpoint | StaticEndpoint | SnapshotPoolEndpoint


@dataclass
class HeldLease:
    """One episode the coordinator holds on a trainable server, from begin until it is ended, prepared or aborted."""

    server: str
    episode_id: str
    lease: EpisodeLease
    renewed_at: float = field(default_factory=time.monotonic)


def legacy_endpoint(name: str, client: SwarmClient | None = None, base_url: str | None = None, api_key: str = "none",
             model: str | None = None, max_concurrency: int | None = None,
             train_config: TrainConfig | None = None,
             policy_version: int | None = None, snapshot_of: str | None = None,
             snapshots: SnapshotSource | None = None) -> Endpoint:
    """The endpoint that the old one-record `Endpoint(...)` call described (kept for one release, deprecated)."""
    if snapshots is not None:
        return SnapshotPoolEndpoint(name, snapshots)
    if client is not None:
        return TrainableEndpoint(name, client, max_concurrency, train_config)
    if base_url is None:
        raise TypeError(f"endpoint {name!r}: give client= (a swarm server), base_url= (static) or snapshots=")
    return StaticEndpoint(name, base_url, model, api_key, max_concurrency, policy_version, snapshot_of)
