"""The wire protocol between swarm servers and everything that talks to them.

Every request body, response body and error body of the control plane, the episode (lease) API and the
OpenAI-compatible data plane is defined here, once, as pydantic v2 models. The server (`servers/`) and the
client (`marl.client`) both import this module; it imports nothing else of the project.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

# --------------------------------------------------------------------------------------------------------------
# Routes and headers (one place, so server and client cannot drift apart)
# --------------------------------------------------------------------------------------------------------------

ROUTE_CONFIG = "/control/config"
ROUTE_START = "/control/start"
ROUTE_STOP = "/control/stop"
ROUTE_STATUS = "/control/status"
ROUTE_POOL = "/control/pool"
#: A server of LoRA policies: POST loads a frozen policy (a past adapter, served untrained), GET lists them.
ROUTE_FROZEN = "/control/frozen"
ROUTE_FROZEN_ONE = "/control/frozen/{name}"  # DELETE: unload it (its engine slot is freed)
ROUTE_MONITOR = "/control/monitor"  # everything `marl overwatch` shows, in one call
ROUTE_BEGIN = "/episodes/begin"
ROUTE_EPISODE = "/episodes/{episode_id}"  # GET: can the episode continue?
ROUTE_END = "/episodes/{episode_id}/end"
ROUTE_PREPARE = "/episodes/{episode_id}/prepare"  # two-phase commit, phase one: recorded, not yet in the pool
ROUTE_COMMIT = "/episodes/{episode_id}/commit"  # phase two: a prepared episode enters the pool
ROUTE_ABORT = "/episodes/{episode_id}/abort"
ROUTE_RENEW = "/episodes/{episode_id}/renew"
ROUTE_HEALTH = "/health"
ROUTE_CHAT = "/v1/chat/completions"
ROUTE_RESPONSES = "/v1/responses"  # OpenAI Responses API, translated to chat completions
ROUTE_MESSAGES = "/v1/messages"  # Anthropic Messages API, translated to chat completions
ROUTE_COMPLETIONS = "/v1/completions"  # text or token-id prompt in, token ids and logprobs out
#: The data-plane routes that run a model call under a lease key (an Authorization bearer, or Anthropic `x-api-key`).
DATA_PLANE_CALL_ROUTES = (ROUTE_CHAT, ROUTE_RESPONSES, ROUTE_MESSAGES, ROUTE_COMPLETIONS)
ROUTE_MODELS = "/v1/models"
ROUTE_METRICS = "/metrics"  # Prometheus text format, no auth (counts only, as vLLM's)

#: Header that tags a data-plane call with the agent (role) that made it; marl's own clients set it once, on the
#: OpenAI client's default headers. A call without it is tagged by the request's `user` field (for third-party
#: clients that cannot set headers); when both are sent, the header wins.
AGENT_HEADER = "X-Marl-Agent"
#: Agent tag used when a call carries neither the header nor `user`.
DEFAULT_AGENT = "default"


def agent_headers(agent: str) -> dict[str, str]:
    """The headers that tag a data-plane call with `agent` (its role): every marl client sets them through this."""
    return {AGENT_HEADER: agent}
#: A non-streaming chat completion's response header: `engine;dur=<ms>, marl;dur=<ms>`. `engine`: the engine's wall
#: time for the call (waiting for a slot or a weight swap, prefill, decode); `marl`: the server's own, from its first
#: sight of the request to its reply, less the engine's (the lease's key, the body, the prompt, the reply, recording;
#: not the reply's serialisation). What else a client sees is the network's and its own.
SERVER_TIMING_HEADER = "Server-Timing"
TIMING_ENGINE = "engine"
TIMING_MARL = "marl"
#: Environment variable holding a server's admin token (read by `marl serve`, clients, `marl run`, overwatch).
ADMIN_TOKEN_ENV = "MARL_ADMIN_TOKEN"
#: Every episode key starts with this, so the control plane can tell a misplaced episode key from a wrong token.
EPISODE_KEY_PREFIX = "marl-ep-"
#: Routes under these prefixes need the admin token (the rest: a lease key on the data plane, or nothing).
ADMIN_ROUTE_PREFIXES = ("/control/", "/episodes/")
#: Seconds a server keeps an idle keep-alive connection open: longer than clients keep theirs (httpx, and so the
#: openai SDK: 5 s). With equal timeouts a client may send a call on a connection the server is closing at that
#: instant and get a connection error; a call under a lease is not retried (it could have been recorded), so a whole
#: game would be lost. Waits of more than 5 s between one seat's calls are the rule in long games.
SERVER_KEEP_ALIVE_S = 75
#: Seconds marl's own clients keep an idle connection pooled: shorter than the server's, longer than a seat's wait.
CLIENT_KEEP_ALIVE_S = 60
#: Default limit on a request body (`marl serve --max-body-mb`); a larger one is refused with 413 before it is read.
DEFAULT_MAX_BODY_MB = 16.0
#: Longest id a client may choose (client_id, task_id, game_id, an agent tag).
MAX_ID_LENGTH = 512
#: Agent tags an episode's end may reward (`agent_rewards`): each listed agent is at least one ledger row.
MAX_AGENT_REWARDS = 1024
#: The model aliases `marl serve --model` builds into its cache (servers/model_files.py `KNOWN_MODELS`), named here so
#: that `marl topology show` can check a local server's model without importing servers/.
MODEL_ALIASES = ("smollm2-135m",)
#: Query parameter of end and commit: `?include_pool=true` asks for the pool's progress in the reply (`pool`), which
#: costs the server three ledger reads; without it `pool` is None. (A query parameter, not a body field: the body's
#: digest is what makes a repeated end answerable, and asking for the pool must not make a repeat a different end.)
INCLUDE_POOL_PARAM = "include_pool"
#: Query parameter of the control routes (config, status, pool, monitor) naming one policy of a server of several.
POLICY_PARAM = "policy"


# vLLM's command line, as `marl run` asks `marl serve` for it (a local server's `vllm:` section) and `marl serve`
# builds it (servers/engines/vllm_process.py): defined once, for both to check against.
#: vLLM's `--dtype` values (`ModelDType` in vllm/config/model.py, 0.32).
VLLM_DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")
#: Flags marl sets itself, which `extra_args` may not repeat: the setting that gives each, or None (marl's own).
VLLM_MANAGED_FLAGS: dict[str, str | None] = {
    "--model": None, "--host": None, "--port": None, "--api-key": None, "--worker-extension-cls": None,
    "--logits-processors": None,
    "--max-model-len": "max_model_len", "--gpu-memory-utilization": "gpu_memory_utilization",
    "--kv-cache-memory-bytes": "kv_cache_gb", "--tensor-parallel-size": "tensor_parallel_size",
    "-tp": "tensor_parallel_size", "--data-parallel-size": "data_parallel_size", "-dp": "data_parallel_size",
    "--dtype": "dtype", "--max-num-seqs": "max_num_seqs", "--enable-sleep-mode": "sleep_between_steps",
    "--weight-transfer-config": "weight_sync",
    "--enable-lora": None, "--max-loras": None, "--max-lora-rank": None,  # from the server's LoRA policies
}
#: How a trainer's weights reach vLLM (`vllm.weight_sync`): `disk` writes a safetensors directory that vLLM reloads;
#: `ipc` (vLLM on the trainer's GPU) and `nccl` (vLLM on GPUs of its own) go through vLLM's weight-transfer engine
#: (`--weight-transfer-config`, CUDA only), with the disk as the fallback; `auto` picks by device and placement.
VLLM_WEIGHT_SYNC_MODES = ("auto", "disk", "ipc", "nccl")
#: Default `--gpu-memory-utilization` on CUDA: a trainable server's vLLM shares its GPU with a trainer rank, whose
#: fp32 shards of weights and AdamW state stay resident between steps, so it takes half; a static server's vLLM has
#: the GPU to itself but leaves a margin for other processes' CUDA contexts. These are `marl serve`'s defaults; `marl
#: run` passes the share `marl plan` sizes for the model instead (marl/plan/topology_plan.py, utilization_beside).
VLLM_SHARED_GPU_UTILIZATION = 0.5
VLLM_OWN_GPU_UTILIZATION = 0.9

# Placement: which GPUs a server's engine and trainer ranks use (a topology server's `placement:`, which `marl run`
# passes as `marl serve --engine-gpus 0 --trainer-gpus 1,2`; docs/architecture.md, "Placement").
#: Deprecated, not used: where `marl trainer-node` connected (ranks on other machines are Ray actors now).
TRAINER_RENDEZVOUS_PORT = 29500


def gpu_list_text(gpus: list[int] | tuple[int, ...]) -> str:
    """GPU indices as a flag's value and as CUDA_VISIBLE_DEVICES: [0, 1, 2] -> "0,1,2"."""
    return ",".join(str(gpu) for gpu in gpus)


def parse_gpu_list(text: str) -> list[int]:
    """A flag's GPU indices: "0,1,4-6" -> [0, 1, 4, 5, 6]. ValueError for a bad, negative or repeated index."""
    gpus: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{text!r} is not a list of GPU indices, e.g. 0,1 or 0-7")
        gpus += range(int(first), int(last if dash else first) + 1)
    if not gpus or len(set(gpus)) != len(gpus):
        raise ValueError(f"{text!r}: GPU indices must be given once each, e.g. 0,1 or 0-7")
    return gpus

# Numbers on the wire are numbers: no `true` for 1, no "yes" for true, no 1.0 for an int (floats do take ints).
Int = StrictInt
Bool = StrictBool
#: A finite number (raw JSON may say NaN or Infinity; a reward like that would poison a whole GRPO group).
Real = Annotated[float, Field(strict=True, allow_inf_nan=False)]
#: The range of a seed (torch and every other RNG take 64 bits).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH)]
#: A policy's name: it is the lease's `model`, and part of its episode ids and keys (`POLICY_SEPARATOR`).
PolicyName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
#: Between a policy's name and the rest of its episode ids and keys on a server of several policies: the server finds
#: an episode's or a key's policy from it (no policy name holds it).
POLICY_SEPARATOR = "."
#: Between a policy's name and its version in a frozen policy's name (`speaker@3`: policy speaker's adapter at version
#: 3, served unrecorded and never trained): no policy name holds it, so a frozen name never is a policy's.
FROZEN_SEPARATOR = "@"
#: A frozen policy's name: `<policy>@<label>`.
FrozenName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}@[A-Za-z0-9_-]{1,64}$")]
#: Every key of a server's frozen policies starts with this (one key per server, handed out by the load route).
FROZEN_KEY_PREFIX = "marl-frozen-"


def frozen_name(policy: str, version: int) -> str:
    """The frozen policy of `policy` at policy version `version`: `speaker@3`."""
    return f"{policy}{FROZEN_SEPARATOR}{version}"


#: Deepest nesting of lists and objects a request may have (deeper JSON would exhaust the recursion of whoever
#: serializes it next: the ledger's json.dumps, a template).
MAX_NESTING = 64


def check_text_and_nesting(value: Any) -> None:
    """Raise ValueError if a string anywhere in `value` is not encodable text (JSON's "\\udfff" escape decodes to a
    lone surrogate, which no tokenizer or database takes), or if it nests deeper than MAX_NESTING."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise ValueError(f"{where or 'a string'} is not valid Unicode text (a lone surrogate at"
                                     f" character {exc.start}); send UTF-8 text") from None
            continue
        if depth > MAX_NESTING:
            raise ValueError(f"{where or 'the body'} nests lists and objects deeper than {MAX_NESTING} levels")
        if isinstance(item, dict):
            for key, inner in item.items():
                path = f"{where}.{key}" if where else str(key)
                stack += [(key, f"a key of {where or 'the body'}", depth + 1), (inner, path, depth + 1)]
        elif isinstance(item, (list, tuple)):
            stack += [(inner, f"{where}.{i}" if where else str(i), depth + 1) for i, inner in enumerate(item)]


class _Request(BaseModel):
    """Every request body: its text must be encodable (checked before anything is stored or tokenized)."""

    @model_validator(mode="before")
    @classmethod
    def _encodable_text(cls, data: Any) -> Any:
        check_text_and_nesting(data)
        return data


class _Strict(_Request):
    """Requests reject unknown fields: a typo in a config key must fail loudly, not be ignored."""

    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------------------------------------------
# Engine states and errors
# --------------------------------------------------------------------------------------------------------------


class EngineState(str, enum.Enum):
    OFFLINE = "OFFLINE"  # process up, no model loaded; waiting for config + start
    BOOTING = "BOOTING"  # loading the model (and the trainer)
    ROLLING = "ROLLING"  # granting leases, serving calls
    ROLLING_POST = "ROLLING_POST"  # batch complete: no new leases, running ones may finish
    WEIGHT_SYNCING = "WEIGHT_SYNCING"  # training step + publishing the new weights
    STATIC = "STATIC"  # `marl serve --static`: serves the model, no leases, no training


#: States of a trainable engine that has been started (serving, draining or training).
RUNNING_STATES = frozenset({EngineState.ROLLING, EngineState.ROLLING_POST, EngineState.WEIGHT_SYNCING})


class ErrorType(enum.StrEnum):
    """OpenAI's error `type`: the broad class of an error."""

    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    PERMISSION = "permission_error"
    SERVER = "server_error"


class ErrorCode(enum.StrEnum):
    """Every `error.code` a swarm server sends. Clients branch on these, never on the message text."""

    # 400: the request itself is wrong
    INVALID_REQUEST = "invalid_request"  # body or parameters fail validation
    INVALID_MESSAGES = "invalid_messages"  # messages cannot be rendered into a prompt
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt + max_tokens over the model's context
    UNSUPPORTED_VALUE = "unsupported_value"  # a parameter value this server does not support (it says which)
    # 401 / 403: who is asking
    UNAUTHORIZED = "unauthorized"  # control plane: missing or wrong admin token
    INVALID_API_KEY = "invalid_api_key"  # data plane: missing, unknown or dead episode key
    NOT_LEASE_HOLDER = "not_lease_holder"  # another client holds the episode
    # 404 / 405: what is asked for does not exist
    EPISODE_NOT_FOUND = "episode_not_found"
    MODEL_NOT_FOUND = "model_not_found"
    POLICY_NOT_FOUND = "policy_not_found"  # a `policy` this server does not train
    POLICY_REQUIRED = "policy_required"  # 400: the server trains several policies and the call names none
    FROZEN_POLICY_NOT_FOUND = "frozen_policy_not_found"  # unloading a frozen policy that is not loaded
    ROUTE_NOT_FOUND = "route_not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    # 413: the body is over the server's limit (marl serve --max-body-mb)
    REQUEST_TOO_LARGE = "request_too_large"
    # 409: not in this state (do something else first)
    ENGINE_NOT_OFFLINE = "engine_not_offline"
    STATIC_SERVER = "static_server"
    NO_POLICIES = "no_policies"  # frozen policies need a server of LoRA policies
    FROZEN_POLICY_EXISTS = "frozen_policy_exists"  # a frozen policy of that name is loaded from another adapter
    EPISODE_ALREADY_ENDED = "episode_already_ended"  # ended, prepared or committed with another body; abort too late
    EPISODE_NOT_PREPARED = "episode_not_prepared"  # commit of an episode that is still running
    EPISODE_ABORTED = "episode_aborted"  # commit of a prepared episode that was aborted (or timed out: presumed abort)
    # 409 or 503: no lease now (503 with retry_after_s while BOOTING / ROLLING_POST / WEIGHT_SYNCING)
    ENGINE_NOT_ROLLING = "engine_not_rolling"
    # 503: wait and retry (retry_after_s is set)
    NO_FREE_SLOT = "no_free_slot"
    # `overlap`: a step trains and enough episodes wait for the next ones that a lease begun now would be trained
    # more than `max_staleness` versions late (servers.training.loop bounds the rollouts)
    ROLLOUTS_AHEAD = "rollouts_ahead"
    ENGINE_BOOTING = "engine_booting"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    LEDGER_UNAVAILABLE = "ledger_unavailable"  # the ledger write failed; nothing changed, the lease is still live
    # end or prepare waited (`servers.episodes.recorder.CALLS_WAIT_S`) for the lease's calls still generating, and some
    # still are: nothing changed, the lease is still live; the retry records them once they finish
    CALLS_IN_FLIGHT = "calls_in_flight"
    # 5xx: the server failed
    ENGINE_ERROR = "engine_error"  # generation failed
    # the model's logprobs overflowed (NaN or inf: an adapter's huge weights); the call is not recorded
    NON_FINITE_OUTPUT = "non_finite_output"
    INTERNAL_ERROR = "internal_error"  # anything unexpected
    HTTP_ERROR = "http_error"  # another HTTP-level refusal


def error_type_of(code: ErrorCode) -> ErrorType:
    """The OpenAI error type that goes with a code (who is at fault): one table for every server and the proxy."""
    return _ERROR_TYPE_OF_CODE.get(code, ErrorType.INVALID_REQUEST)


_ERROR_TYPE_OF_CODE = {
    ErrorCode.UNAUTHORIZED: ErrorType.AUTHENTICATION,
    ErrorCode.INVALID_API_KEY: ErrorType.AUTHENTICATION,
    ErrorCode.NOT_LEASE_HOLDER: ErrorType.PERMISSION,
    ErrorCode.ENGINE_ERROR: ErrorType.SERVER,
    ErrorCode.NON_FINITE_OUTPUT: ErrorType.SERVER,
    ErrorCode.INTERNAL_ERROR: ErrorType.SERVER,
    ErrorCode.LEDGER_UNAVAILABLE: ErrorType.SERVER,
}


class ErrorInfo(BaseModel):
    """OpenAI-shaped error (`{"error": {...}}`), plus what a client needs to decide whether to retry."""

    message: str
    type: str = ErrorType.INVALID_REQUEST.value
    #: An `ErrorCode` value from a swarm server; a str here so that errors from other servers still parse.
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


class GRPOConfig(_Strict):
    """The GRPO trainer's section of a `TrainConfig` (`train.grpo`): the objective and the optimiser."""

    learning_rate: Real = Field(1e-5, gt=0)
    weight_decay: Real = Field(0.0, ge=0)
    adam_betas: tuple[Real, Real] = (0.9, 0.999)
    max_grad_norm: Real = Field(1.0, gt=0)
    clip_eps_low: Real = Field(0.2, gt=0, description="PPO ratio clip below 1.")
    clip_eps_high: Real = Field(0.28, gt=0, description="PPO ratio clip above 1.")
    importance_cap: Real = Field(2.0, ge=1, description="Cap of the importance weight pi_start / pi_behaviour of a"
                                 " token generated by an older policy than the one the step starts from (`overlap`;"
                                 " servers/trainers/grpo.py, step 2).")
    kl_coef: Real = Field(0.0, ge=0, description="KL penalty to the frozen initial model (k3, per token); 0 disables"
                          " it. Above 0 it also acts on groups whose rewards are all equal (trained with advantage"
                          " 0): what pulls a policy that stopped exploring back (docs/design.md).")
    entropy_coef: Real = Field(0.0, ge=0, description="Bonus on the sampling entropy of every trained token"
                               " (l_t - entropy_coef * H_t): resists a policy concentrating on one reply; 0 disables"
                               " it. Above 0 it also acts on groups whose rewards are all equal, as kl_coef does.")
    normalize_advantage_std: Bool = Field(True, description="Divide group-relative advantages by the group std.")
    skip_zero_variance_groups: Bool = Field(True, description="Skip groups whose rewards are all equal (counted),"
                                            " unless kl_coef or entropy_coef > 0.")
    micro_batch_tokens: Int = Field(4096, ge=16, description="Token budget of one forward/backward micro-batch.")
    ppo_epochs: Int = Field(1, ge=1, description="Passes over each batch.")
    gradient_checkpointing: Bool = Field(False, description="Recompute each layer's activations in the backward pass:"
                                         " far less memory on long conversations, about a third more compute.")
    recompute_logprobs: Literal["auto"] | Bool = Field(
        "auto", description="Take the PPO ratio against the trainer's own logprobs of the weights the step starts"
        " from (one no-grad forward over the batch before the first pass) instead of the engine's recorded ones,"
        " which stay in the samples (their gap is `logprob_diff_*`). auto: on when the engine's numerics may differ"
        " from the trainer's (vLLM, or another dtype than the trainer's, or both not float32), resolved once when the"
        " server boots; a trainer built outside a server takes auto as off. servers/trainers/grpo.py, step 2.")


class FSDPConfig(GRPOConfig):
    """The FSDP2 trainer's section (`train.fsdp`): GRPO's knobs, the policy sharded over `ranks` processes."""

    ranks: Int = Field(2, ge=1, description="Processes the policy is sharded over (one GPU each on CUDA).")
    mixed_precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="What the forward and backward compute in: bf16 (parameters gathered in bf16, gradients"
        " reduced in fp32; the sharded weights and AdamW's state stay fp32), fp32, or auto: bf16 on CUDA, fp32 on the"
        " CPU. Like `ranks`, read when the ranks start.")


#: What a LoRA adapter wraps when `target_modules` is left out: every linear layer of a Llama/Qwen decoder.
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The policy name of a server without `policies:`: its one full-weight policy.
DEFAULT_POLICY = "default"


class LoraSpec(_Strict):
    """A LoRA policy's adapter (`policies.NAME.lora`), in `peft.LoraConfig`'s vocabulary: the update of a wrapped
    linear layer W is (alpha / rank) * B @ A, with A: rank x in and B: out x rank (B starts at zero)."""

    rank: Int = Field(16, ge=1, le=256, description="LoRA rank r.")
    alpha: Real = Field(32.0, gt=0, description="LoRA alpha: the update is scaled by alpha / rank.")
    dropout: Real = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training.")
    target_modules: tuple[str, ...] = Field(LORA_DEFAULT_TARGETS, min_length=1, description="Names of the linear"
                                            " layers to adapt (their last dotted component).")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


#: Trainer name -> the config class of its section in `TrainConfig` (the section's key is the trainer's name).
TRAINER_SECTIONS: dict[str, type[BaseModel]] = {"grpo": GRPOConfig, "fsdp": FSDPConfig}


class TrainConfig(_Strict):
    """A trainable server's configuration: rollout pool settings, then the section of the trainer it runs.

    Clients send it through `POST /control/config` (`SwarmClient.sync_train_config`). The pool settings are the
    same whatever the trainer; `trainer` names the trainer, whose own knobs live in the section of that name
    (`grpo` today), so a new trainer adds a section without touching the pool's. For AgentJet's flat call
    (`{"batch_size": 4, "num_repeat": 4, "learning_rate": 1e-5}`), keys of the chosen trainer's section given at
    the top level are moved into it; any other unknown key is refused.
    """

    # Rollout pool and batch assembly
    job: str = Field("default", min_length=1, max_length=MAX_ID_LENGTH, description="Job name: task ids are"
                     " namespaced by it.")
    batch_size: Int = Field(4, ge=1, description="GRPO groups per training step.")
    num_repeat: Int = Field(4, ge=1, description="Episodes per group (GRPO group size).")
    max_leases: Int = Field(256, ge=1, description="Leases that may run at once; more begin calls wait.")
    lease_patience_s: Real = Field(300.0, gt=0, description="A lease idle this long expires; its slot is re-queued.")
    max_staleness: Int = Field(
        1, ge=0, description="Samples produced this many policy versions before the trained one are dropped (counted)."
    )
    overlap: Bool = Field(False, description="Train a complete batch while leases go on rolling on the current"
                          " weights (no drain); the new weights replace the old between two generations. Samples"
                          " then span versions: the trainer weighs older tokens (grpo.importance_cap).")
    # Checkpoints
    save_freq: Int = Field(1, ge=0, description="Checkpoint every N steps; 0 disables checkpoints.")
    keep_checkpoints: Int = Field(2, ge=1)
    keep_sample_tokens_steps: Int | None = Field(
        None, ge=0, description="After each checkpoint, empty the token payloads of samples trained more than this"
        " many steps before it (their rows, rewards and versions stay; `marl episode show` then shows no tokens), so"
        " the ledger stops growing with every token of a long run. None: keep every sample whole.")
    seed: Int = Field(0, ge=0, le=SEED_MAX)
    # The trainer
    trainer: Literal["grpo", "fsdp"] = Field("grpo", description="Which trainer steps the policy; its knobs are the"
                                                               " section of the same name.")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig, description="The GRPO trainer's settings.")
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig, description="The FSDP2 trainer's settings: GRPO's, sharded"
                                                                     " over `ranks` processes.")

    @model_validator(mode="before")
    @classmethod
    def _flat_trainer_keys(cls, data: Any) -> Any:
        """Move the chosen trainer's keys given at the top level (AgentJet's flat dict) into its section."""
        if not isinstance(data, dict):
            return data
        name = data.get("trainer", "grpo")
        section_class = TRAINER_SECTIONS.get(name) if isinstance(name, str) else None
        flat = [k for k in data if section_class and k in section_class.model_fields and k not in cls.model_fields]
        if not flat:
            return data
        data = dict(data)
        section = data.get(name) or {}
        section = dict(section) if isinstance(section, dict) else section.model_dump(exclude_unset=True)
        for key in flat:
            if key in section:
                raise ValueError(f"{key} is given twice: at the top level and in {name}.{key}; keep one")
            section[key] = data.pop(key)
        data[name] = section
        return data

    @property
    def trainer_section(self) -> BaseModel:
        """The settings of the chosen trainer (`self.grpo` when `trainer` is "grpo")."""
        return getattr(self, self.trainer)


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


# --------------------------------------------------------------------------------------------------------------
# Episodes (leases)
# --------------------------------------------------------------------------------------------------------------


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
    `decision_log` (the coordinator's, `marl.decision_log`) what was decided for `game_id`: commit if it says so,
    abort if it says abort or nothing; without a decision log the episode is aborted (presumed abort)."""

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


# --------------------------------------------------------------------------------------------------------------
# OpenAI-compatible data plane
# --------------------------------------------------------------------------------------------------------------


class ContentPart(BaseModel):
    """One part of a message's content (`{"type": "text", "text": ...}`); parts of other types carry no text."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: Bool = False


#: The most strings a `structured_outputs.choice` may list, and the longest one (a move's name, a label).
MAX_CHOICES, MAX_CHOICE_CHARS = 64, 256


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extension, its `choice` form only: the reply is exactly one of these strings
    (each spelled as the tokenizer spells it alone, then the end of the reply). The logprobs recorded stay the
    model's own, as for a forced tool call (docs/design.md, "The other APIs, tool choice")."""

    model_config = ConfigDict(extra="forbid")

    choice: list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]] = Field(
        min_length=1, max_length=MAX_CHOICES)

    @model_validator(mode="before")
    @classmethod
    def _choice_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and (other := sorted(k for k in data if k != "choice")):
            raise ValueError(f"structured_outputs {other} is not supported here: only choice (a list of strings)")
        return data


class ChatCompletionRequest(_Request):
    # Unknown OpenAI parameters (frequency_penalty, ...) are accepted and ignored, as vLLM does.
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    temperature: Real = Field(1.0, ge=0, le=2)
    top_p: Real = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = Field(None, max_length=16)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    seed: Int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: Int = Field(1, ge=1, le=1, description="Only n=1: each sample must be its own recorded call.")
    user: str | None = Field(None, max_length=MAX_ID_LENGTH, description="Tags the call with an agent when the"
                             f" {AGENT_HEADER} header does not.")
    logprobs: Bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=0, description="Not supported: the server records and returns"
                                     " the sampled token's logprob only (omit it, or send 0).")
    return_token_ids: Bool = Field(False, description="vLLM extension: include prompt and completion token ids.")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM extension, `choice` only: the"
                                                         " reply is exactly one of the strings listed.")

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _no_top_logprobs(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            raise ValueError("top_logprobs is not supported by this server: it returns the logprob of each sampled"
                             " token only (logprobs: true); omit top_logprobs or send 0")
        return value


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
    stop_reason: str | None = None  # vLLM extension: the stop string that ended the reply, if one did


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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "marl"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def __getattr__(name: str):
    """`Sample` moved to `servers.episodes.samples` (it never crosses the wire); the old name works for one release."""
    if name == "Sample":
        import warnings
        warnings.warn("marl.protocol.Sample moved to servers.episodes.samples.Sample", DeprecationWarning, stacklevel=2)
        from servers.episodes.samples import Sample
        return Sample
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parse_server_timing(value: str) -> dict[str, float]:
    """A `Server-Timing` header's durations in milliseconds by name (`engine;dur=1.5, marl;dur=0.4`); a metric without
    a duration is left out."""
    timings = {}
    for metric in value.split(","):
        name, *params = (part.strip() for part in metric.split(";"))
        durations = [float(v[4:]) for v in params if v.startswith("dur=")]
        if name and durations:
            timings[name] = durations[0]
    return timings
