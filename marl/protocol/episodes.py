"""The episode (lease) API's bodies: begin, end, the two-phase prepare/commit/abort, and an episode's state."""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from marl.protocol.control import PoolInfo
from marl.protocol.errors import EngineState
from marl.protocol.fields import Id, PolicyName, Real, _Strict
from marl.protocol.routes import MAX_AGENT_REWARDS, MAX_ID_LENGTH


class BeginEpisodeRequest(_Strict):
    client_id: Id = Field(description="Identifies the holder: only it may end or abort the lease.")
    policy: PolicyName | None = Field(None, description="Which of the server's policies the episode trains"
                                      " (required where it trains several; default: its only one).")


class EpisodeLease(BaseModel):
    episode_id: str
    base_url: str  # OpenAI base URL, e.g. http://host:port/v1
    api_key: str  # opaque, server-issued, valid only while the lease lives
    model: str
    generation: int
    patience_s: float
    policy_version: int  # the weights that serve this whole episode (weights change only once leases drained)


class EndEpisodeRequest(_Strict):
    """Body of end (and of prepare, which adds the game's fields). Sending the same body again is always safe: the
    server answers with the outcome it stored (`replayed`); a different body for an ended episode is refused (409)."""

    client_id: Id
    task_id: Id = Field(description="Episodes of the same task form a GRPO group (per agent).")
    reward: Real
    agent_rewards: dict[Annotated[str, Field(max_length=MAX_ID_LENGTH)], Real] | None = Field(
        None, max_length=MAX_AGENT_REWARDS,
        description="Reward per agent tag; agents not listed get `reward`. An agent listed that made no call in"
                    " the episode gets an empty sample (no token): it counts in its GRPO group, as its baseline.",
    )
    metadata: dict[str, Any] = {}


class EndEpisodeResponse(BaseModel):
    episode_id: str
    samples: int
    trainable_tokens: int
    pool: PoolInfo | None = None  # only when asked for (`?include_pool=true`, INCLUDE_POOL_PARAM)
    replayed: bool = False  # True: the episode had been recorded already; this is the stored outcome


#: How long a prepared episode waits for its commit or abort by default, before the server resolves it itself.
DEFAULT_PREPARE_TIMEOUT_S = 300.0


class PrepareEpisodeRequest(EndEpisodeRequest):
    """Phase one of a game's two-phase commit: the episode is validated and recorded durably as PREPARED (its lease
    key dies), but it enters the pool only on commit. Not committed or aborted within `timeout_s`, the server asks
    `decision_log` (the coordinator's, `marl.transaction.decision_log`) what was decided for `game_id`: commit if it
    says so, abort if it says abort or nothing; without a decision log the episode is aborted (presumed abort)."""

    game_id: Id
    timeout_s: Real = Field(DEFAULT_PREPARE_TIMEOUT_S, gt=0, le=7 * 24 * 3600)
    decision_log: str | None = Field(None, min_length=1, max_length=4096, description="Path of the coordinator's"
                                     " decision log, as this server sees it (a file both can reach).")


class PrepareEpisodeResponse(BaseModel):
    episode_id: str
    samples: int
    trainable_tokens: int
    deadline: float  # unix time at which the server resolves the episode itself if nobody has
    replayed: bool = False


class ClientRequest(_Strict):
    """Body of abort / renew / commit: who is asking."""

    client_id: Id


class AbortEpisodeResponse(BaseModel):
    episode_id: str
    #: requeued: its slot went back to the pool (aborted while ROLLING); discarded: after the batch filled, or a
    #: prepared episode dropped.
    disposition: Literal["requeued", "discarded"]
    replayed: bool = False  # True: it had been aborted already


class EpisodePhase(enum.StrEnum):
    """Where an episode is on its way into the pool."""

    RUNNING = "running"  # its lease is live
    PREPARED = "prepared"  # recorded, waiting for commit or abort
    ENDED = "ended"  # in the pool (ended, or prepared and committed)
    ABORTED = "aborted"  # a prepared episode that was aborted
    GONE = "gone"  # not running and not recorded: aborted, expired, closed by an engine stop, or never existed


class EpisodeState(BaseModel):
    episode_id: str
    can_continue: bool
    reason: str
    state: EngineState
    idle_s: float | None = None
    patience_s: float | None = None
    phase: EpisodePhase = EpisodePhase.RUNNING
