"""The control plane's bodies: a server's status, its pool and running leases, what `marl overwatch` reads in one
call, and the frozen policies of a server of LoRA policies."""

from __future__ import annotations

from pydantic import BaseModel, Field

from marl.protocol.errors import EngineState
from marl.protocol.fields import FrozenName, Int, _Strict


class LeaseInfo(BaseModel):
    episode_id: str
    client_id: str
    idle_s: float
    patience_s: float
    calls: int
    age_s: float


class GroupProgress(BaseModel):
    job: str
    task_id: str
    agent: str
    episodes: int


class PoolInfo(BaseModel):
    """How far the pool is from the next training step."""

    batch_size: int
    num_repeat: int
    complete_groups: int
    pending_episodes: int  # ended, durable, not yet trained on
    groups: list[GroupProgress] = []
    running_leases: int
    free_slots: int
    leases: list[LeaseInfo] = []
    requeued: int  # leases aborted or expired while ROLLING: their slot went back to the pool
    discarded: int  # leases aborted or expired after the batch was complete
    expired: int
    prepared_episodes: int = 0  # prepared (two-phase commit), waiting for their commit or abort


class ServerStatus(BaseModel):
    state: EngineState
    model: str
    policy_version: int
    generation: int  # bumps on every engine start: keys of an earlier generation are dead
    step: int
    static: bool
    pool: PoolInfo | None = None
    last_error: str | None = None
    metrics: dict[str, float] = {}
    #: A server of several policies: each one's own status (its state, version, pool, last step); the fields above
    #: then sum the pools and show the least advanced policy's state and version.
    policies: dict[str, ServerStatus] = {}


class StepRecord(BaseModel):
    """One training step's metrics (a line of the server's metrics.jsonl)."""

    step: int
    time: float  # unix time the step finished
    metrics: dict[str, float] = {}
    policy: str | None = None  # on a server of several policies, whose step (in its monitor's merged list)


class ErrorEvent(BaseModel):
    time: float  # unix time
    message: str


class TrainingProgress(BaseModel):
    """The training step in progress (a server in WEIGHT_SYNCING)."""

    step: int  # the policy version it will produce
    seconds: float  # since the step began
    samples: int
    done: int | None = None  # units of work done (GRPO: micro-batch passes); None: the trainer does not say
    total: int | None = None


class MonitorSnapshot(BaseModel):
    """What a monitor shows for one server, read in one call (`GET /control/monitor`)."""

    instance_id: str  # new on every server process start: a change means the server restarted
    started_at: float  # unix time the process started
    status: ServerStatus
    pool: PoolInfo | None = None  # detailed (groups and leases); None on a static server
    recent_steps: list[StepRecord] = []  # oldest first, up to the last 100 (read back from metrics.jsonl on restart)
    tokens_per_s: float = 0.0  # generated tokens per second over the last `rate_window_s`
    rate_window_s: float = 0.0
    errors: list[ErrorEvent] = []  # the latest errors, oldest first
    training: TrainingProgress | None = None  # while a training step runs



class LoadFrozenPolicyRequest(_Strict):
    """Serve a past adapter of a policy, frozen (`POST /control/frozen`): unleased, unrecorded, never trained, on the
    server's shared engine. Loading the same name from the same adapter again answers as the first load did."""

    name: FrozenName = Field(description="Its model name in calls, e.g. speaker@3.")
    adapter: str | None = Field(None, description="The PEFT adapter directory (a policy checkpoint's adapter/), on"
                                " the server's filesystem; null: the base model alone, which is what a fresh"
                                " adapter (B = 0, policy version 0) serves.")
    policy_version: Int | None = Field(None, ge=0, description="The version it was saved at (reported only).")


class FrozenPolicy(BaseModel):
    """A frozen policy a server serves: call it with `model: name` and `api_key` at the server's /v1."""

    name: str
    adapter: str | None
    policy_version: int | None
    api_key: str  # the server's key for its frozen policies (the same for all of them)


class FrozenPolicyList(BaseModel):
    data: list[FrozenPolicy]
