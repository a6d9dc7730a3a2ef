"""The wire protocol between swarm servers and everything that talks to them.

Every request body, response body and error body of the control plane, the episode (lease) API and the
OpenAI-compatible data plane is defined in this package, once, as pydantic v2 models. The server (`servers/`) and
the client (`marl.client`) both import it; it imports nothing else of the project. One module per concern:

- `routes`: routes, headers, limits, and the vLLM and placement constants both sides check;
- `fields`: the types every body is made of, and the base request models;
- `errors`: the engine's states and the error vocabulary (`ErrorCode`, the error body);
- `training`: the training configuration (`TrainConfig`, `GRPOConfig`, `FSDPConfig`, `LoraSpec`);
- `control`, `episodes`, `data_plane`: the bodies of the control plane, the episode API and the OpenAI routes.

Every name stays importable from `marl.protocol` itself, as before the split.
"""

from __future__ import annotations

from marl.protocol.control import (
    ErrorEvent,
    FrozenPolicy,
    FrozenPolicyList,
    GroupProgress,
    LeaseInfo,
    LoadFrozenPolicyRequest,
    MonitorSnapshot,
    PoolInfo,
    ServerStatus,
    StepRecord,
    TrainingProgress,
)
from marl.protocol.data_plane import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    AssistantMessage,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    ContentPart,
    DeltaMessage,
    FunctionCall,
    ModelCard,
    ModelList,
    StreamOptions,
    StructuredOutputs,
    TokenLogprob,
    ToolCall,
    Usage,
)
from marl.protocol.episodes import (
    DEFAULT_PREPARE_TIMEOUT_S,
    AbortEpisodeResponse,
    BeginEpisodeRequest,
    ClientRequest,
    EndEpisodeRequest,
    EndEpisodeResponse,
    EpisodeLease,
    EpisodePhase,
    EpisodeState,
    PrepareEpisodeRequest,
    PrepareEpisodeResponse,
)
from marl.protocol.errors import (
    _ERROR_TYPE_OF_CODE,
    RUNNING_STATES,
    EngineState,
    ErrorCode,
    ErrorInfo,
    ErrorResponse,
    ErrorType,
    error_type_of,
)
from marl.protocol.fields import (
    FROZEN_KEY_PREFIX,
    FROZEN_SEPARATOR,
    MAX_NESTING,
    POLICY_SEPARATOR,
    SEED_MAX,
    SEED_MIN,
    Bool,
    FrozenName,
    Id,
    Int,
    PolicyName,
    Real,
    _Request,
    _Strict,
    check_text_and_nesting,
    frozen_name,
)
from marl.protocol.routes import (
    ADMIN_ROUTE_PREFIXES,
    ADMIN_TOKEN_ENV,
    AGENT_HEADER,
    CLIENT_KEEP_ALIVE_S,
    DATA_PLANE_CALL_ROUTES,
    DEFAULT_AGENT,
    DEFAULT_MAX_BODY_MB,
    EPISODE_KEY_PREFIX,
    INCLUDE_POOL_PARAM,
    MAX_AGENT_REWARDS,
    MAX_ID_LENGTH,
    MODEL_ALIASES,
    POLICY_PARAM,
    ROUTE_ABORT,
    ROUTE_BEGIN,
    ROUTE_CHAT,
    ROUTE_COMMIT,
    ROUTE_COMPLETIONS,
    ROUTE_CONFIG,
    ROUTE_END,
    ROUTE_EPISODE,
    ROUTE_FROZEN,
    ROUTE_FROZEN_ONE,
    ROUTE_HEALTH,
    ROUTE_MESSAGES,
    ROUTE_METRICS,
    ROUTE_MODELS,
    ROUTE_MONITOR,
    ROUTE_POOL,
    ROUTE_PREPARE,
    ROUTE_RENEW,
    ROUTE_RESPONSES,
    ROUTE_START,
    ROUTE_STATUS,
    ROUTE_STOP,
    SERVER_KEEP_ALIVE_S,
    SERVER_TIMING_HEADER,
    TIMING_ENGINE,
    TIMING_MARL,
    TRAINER_RENDEZVOUS_PORT,
    VLLM_DTYPES,
    VLLM_MANAGED_FLAGS,
    VLLM_OWN_GPU_UTILIZATION,
    VLLM_SHARED_GPU_UTILIZATION,
    VLLM_WEIGHT_SYNC_MODES,
    agent_headers,
    gpu_list_text,
    parse_gpu_list,
    parse_server_timing,
)
from marl.protocol.training import (
    DEFAULT_POLICY,
    LORA_DEFAULT_TARGETS,
    TRAINER_SECTIONS,
    ConfigResponse,
    FSDPConfig,
    GRPOConfig,
    LoraSpec,
    TrainConfig,
)


def __getattr__(name: str):
    """`Sample` moved to `servers.episodes.samples` (it never crosses the wire); the old name works for one release."""
    if name == "Sample":
        import warnings
        warnings.warn("marl.protocol.Sample moved to servers.episodes.samples.Sample", DeprecationWarning, stacklevel=2)
        from servers.episodes.samples import Sample
        return Sample
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
