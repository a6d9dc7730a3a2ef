"""The wire protocol between swarm servers and everything that talks to them.

Every request body, response body and error body of the control plane, the episode (lease) API and the
OpenAI-compatible data plane is defined here, once, as pydantic v2 models. The server (`servers/`) and the
client (`marl.client`) both import this module; it imports nothing else of the project.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# --------------------------------------------------------------------------------------------------------------
# Routes and headers (one place, so server and client cannot drift apart)
# --------------------------------------------------------------------------------------------------------------

ROUTE_CONFIG = "/control/config"
ROUTE_START = "/control/start"
ROUTE_STOP = "/control/stop"
ROUTE_STATUS = "/control/status"
ROUTE_POOL = "/control/pool"
ROUTE_MONITOR = "/control/monitor"  # everything `marl overwatch` shows, in one call
ROUTE_BEGIN = "/episodes/begin"
ROUTE_EPISODE = "/episodes/{episode_id}"  # GET: can the episode continue?
ROUTE_END = "/episodes/{episode_id}/end"
ROUTE_ABORT = "/episodes/{episode_id}/abort"
ROUTE_RENEW = "/episodes/{episode_id}/renew"
ROUTE_HEALTH = "/health"
ROUTE_CHAT = "/v1/chat/completions"
ROUTE_MODELS = "/v1/models"
ROUTE_METRICS = "/metrics"  # Prometheus text format, no auth (counts only, as vLLM's)

#: Header that tags a data-plane call with the agent (role) that made it. The request's `user` field works too.
AGENT_HEADER = "X-Marl-Agent"
#: Agent tag used when a call carries neither the header nor `user`.
DEFAULT_AGENT = "default"


class _Strict(BaseModel):
    """Requests reject unknown fields: a typo in a config key must fail loudly, not be ignored."""

    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------


class EngineState(str, enum.Enum):
    OFFLINE = "OFFLINE"  # process up, no model loaded; waiting for config + start
    BOOTING = "BOOTING"  # loading the model (and the trainer)
    ROLLING = "ROLLING"  # granting leases, serving calls
    ROLLING_POST = "ROLLING_POST"  # batch complete: no new leases, running ones may finish
    WEIGHT_SYNCING = "WEIGHT_SYNCING"  # training step + publishing the new weights
    STATIC = "STATIC"  # `marl serve --static`: serves the model, no leases, no training


class ErrorInfo(BaseModel):
    """OpenAI-shaped error (`{"error": {...}}`), plus what a client needs to decide whether to retry."""

    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    state: EngineState | None = None
    #: Set when the refusal is temporary ("wait"): the client may retry after this many seconds.
    retry_after_s: float | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# --------------------------------------------------------------------------------------------------------------
# Training configuration (synced by clients, owned by the server)
# --------------------------------------------------------------------------------------------------------------


class TrainConfig(_Strict):
    """Every hyperparameter of a server's rollout pool and trainer, with its default.

    Clients send overrides through `POST /control/config` (`SwarmClient.sync_train_config`).
    """

    # Rollout pool and batch assembly
    job: str = Field("default", min_length=1, description="Job name: task ids are namespaced by it.")
    batch_size: int = Field(4, ge=1, description="GRPO groups per training step.")
    num_repeat: int = Field(4, ge=1, description="Episodes per group (GRPO group size).")
    max_leases: int = Field(256, ge=1, description="Leases that may run at once; more begin calls wait.")
    lease_patience_s: float = Field(300.0, gt=0, description="A lease idle this long expires; its slot is re-queued.")
    max_staleness: int = Field(
        1, ge=0, description="Samples produced this many policy versions before the trained one are dropped (counted)."
    )
    # Optimisation (GRPO + PPO-clip)
    learning_rate: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = Field(1.0, gt=0)
    clip_eps_low: float = Field(0.2, gt=0, description="PPO ratio clip below 1.")
    clip_eps_high: float = Field(0.28, gt=0, description="PPO ratio clip above 1.")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the frozen initial model; 0 disables it.")
    normalize_advantage_std: bool = Field(True, description="Divide group-relative advantages by the group std.")
    skip_zero_variance_groups: bool = Field(True, description="Skip groups whose rewards are all equal (counted).")
    micro_batch_tokens: int = Field(4096, ge=16, description="Token budget of one forward/backward micro-batch.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each batch.")
    gradient_checkpointing: bool = Field(False, description="Recompute each layer's activations in the backward pass:"
                                         " far less memory on long conversations, about a third more compute.")
    # Checkpoints
    save_freq: int = Field(1, ge=0, description="Checkpoint every N steps; 0 disables checkpoints.")
    keep_checkpoints: int = Field(2, ge=1)
    seed: int = 0


class ConfigResponse(BaseModel):
    config: TrainConfig
    changed: bool


# --------------------------------------------------------------------------------------------------------------
# Status and pool
# --------------------------------------------------------------------------------------------------------------


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


class StepRecord(BaseModel):
    """One training step's metrics (a line of the server's metrics.jsonl)."""

    step: int
    time: float  # unix time the step finished
    metrics: dict[str, float] = {}


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


# --------------------------------------------------------------------------------------------------------------
# Episodes (leases)
# --------------------------------------------------------------------------------------------------------------


class BeginEpisodeRequest(_Strict):
    client_id: str = Field(min_length=1, description="Identifies the holder: only it may end or abort the lease.")


class EpisodeLease(BaseModel):
    episode_id: str
    base_url: str  # OpenAI base URL, e.g. http://host:port/v1
    api_key: str  # opaque, server-issued, valid only while the lease lives
    model: str
    generation: int
    patience_s: float
    policy_version: int  # the weights that serve this whole episode (weights change only once leases drained)


class EndEpisodeRequest(_Strict):
    client_id: str = Field(min_length=1)
    task_id: str = Field(min_length=1, description="Episodes of the same task form a GRPO group (per agent).")
    reward: float
    agent_rewards: dict[str, float] | None = Field(
        None, description="Reward per agent tag; agents not listed get `reward`."
    )
    metadata: dict[str, Any] = {}


class EndEpisodeResponse(BaseModel):
    episode_id: str
    samples: int
    trainable_tokens: int
    pool: PoolInfo


class ClientRequest(_Strict):
    """Body of abort / renew: who is asking."""

    client_id: str = Field(min_length=1)


class AbortEpisodeResponse(BaseModel):
    episode_id: str
    disposition: Literal["requeued", "discarded"]


class EpisodeState(BaseModel):
    episode_id: str
    can_continue: bool
    reason: str
    state: EngineState
    idle_s: float | None = None
    patience_s: float | None = None


# --------------------------------------------------------------------------------------------------------------
# Samples (what the trainer consumes; also shown by the episode viewer)
# --------------------------------------------------------------------------------------------------------------


class Sample(BaseModel):
    """One training sequence: merged calls of one agent, with an interleaved loss mask.

    `token_ids`, `loss_mask` and `logprobs` have equal length; `logprobs[i]` is the behaviour policy's logprob of
    `token_ids[i]` where `loss_mask[i] == 1`, and 0.0 elsewhere.
    """

    episode_id: str
    agent: str
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    reward: float
    policy_version: int  # oldest policy version among the merged calls
    num_calls: int


# --------------------------------------------------------------------------------------------------------------
# OpenAI-compatible data plane
# --------------------------------------------------------------------------------------------------------------


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    # Unknown OpenAI parameters (frequency_penalty, ...) are accepted and ignored, as vLLM does.
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=1, description="Only n=1: each sample must be its own recorded call.")
    user: str | None = None
    logprobs: bool = False
    return_token_ids: bool = Field(False, description="vLLM extension: include prompt and completion token ids.")


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "marl"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
