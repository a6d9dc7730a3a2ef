"""Routes, headers and limits: where each call goes and what bounds it (one place, so server and client cannot
drift apart); also vLLM's command-line and placement constants that `marl run` and `marl serve` both check."""

from __future__ import annotations

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
