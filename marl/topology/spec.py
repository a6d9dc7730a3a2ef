"""The spec: what a topology YAML says, as typed pydantic models, with the rules that concern one object at a time.

Servers come in five kinds (`ServerSpec.kind`), told apart by which keys are set:

    model:               + trainable: true   local trainable   `marl run` starts `marl serve --model MODEL`
    model:               + trainable: false  local static      `marl run` starts `marl serve --model MODEL --static`
    swarm_url:           + trainable: true   remote swarm      a swarm server someone else started
    url: + model:                            external OpenAI   a fixed OpenAI-compatible endpoint (e.g. vLLM)
    past_of: {server: S}                     past snapshots    `marl run` serves past checkpoints of the local
                                                               trainable server S statically (marl/league/__init__.py);
                                                               each game draws one: a league of S's past selves

A rule about one server, role, env or run section is a validator here; it reports at the key it is about (e.g.
`servers.big.device`) through `_raise_rules`, so one object's problems are all reported at once. Rules that relate
objects (a role naming a server, run.repeats against num_repeat) live in `checks.py`.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from marl.protocol import (
    MODEL_ALIASES,
    VLLM_DTYPES,
    VLLM_MANAGED_FLAGS,
    VLLM_WEIGHT_SYNC_MODES,
    LoraSpec,
    TrainConfig,
)

from .importing import import_path_problem

#: Names of servers, roles and teams: they become agent tags, directory names and dotlist keys (so no dots).
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
NAME_RULE = "names may contain letters, digits, '_' and '-' (no dots or spaces)"
#: The pydantic error type of the rules below; `load.py` shows their message as is.
RULE_ERROR = "topology_rule"

#: (key path relative to the object, message); an empty path is the object itself.
Rule = tuple[tuple[str, ...], str]


def rule_error(message: str) -> PydanticCustomError:
    # The message travels in the context: a template would read the "{...}" of YAML examples as placeholders.
    return PydanticCustomError(RULE_ERROR, "{message}", {"message": message})


def _raise_rules(model: BaseModel, rules: Sequence[Rule]) -> None:
    """Raise every broken rule at once, each at its own key (pydantic prefixes the object's location)."""
    if rules:
        details = [InitErrorDetails(type=rule_error(message), loc=loc, input=getattr(model, loc[0], None) if loc
                                    else None) for loc, message in rules]
        raise ValidationError.from_exception_data(type(model).__name__, details)


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerKind(str, enum.Enum):
    LOCAL_TRAINABLE = "local trainable"
    LOCAL_STATIC = "local static"
    REMOTE_SWARM = "remote swarm"
    EXTERNAL_OPENAI = "external OpenAI"
    PAST_SNAPSHOTS = "past snapshots"


class PastOfSpec(_Spec):
    """Which past checkpoints of a trainable server a `past_of` server plays (see marl/league/__init__.py)."""

    server: str = Field(description="The local trainable server whose checkpoints are played.")
    policy: str | None = Field(None, description="The LoRA policy of that server whose checkpoints are played"
                               " (required where it has policies): the server itself serves them, as frozen"
                               " policies on its engine (policy@version), with no model loaded again.")
    pool: Literal["latest", "uniform"] = Field("latest", description="latest: the k newest snapshots; uniform: k"
                                               " snapshots drawn uniformly from every one seen so far (a reservoir"
                                               " sample, updated as checkpoints appear). The initial model counts.")
    k: int = Field(3, ge=1, description="Snapshots served at once, one static server each; every game draws one"
                                        " of them uniformly.")




class VLLMSpec(_Spec):
    """How vLLM runs for a local server with `engine: vllm` (passed as `marl serve --vllm-*`; docs/backends.md), or
    on a remote swarm or external server (there it only informs `marl plan`)."""

    max_model_len: int | None = Field(None, ge=1, description="Longest prompt + completion in tokens (default: the"
                                      " model's context; a longer one is capped to it). One sequence this long must"
                                      " fit the KV cache.")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="Share of the GPU's memory vLLM may take (weights, activations, CUDA graphs and,"
        " without kv_cache_gb, the KV cache); vLLM refuses to start unless that much is free. Default on CUDA: 0.5"
        " for a trainable server (its trainer's rank 0 shares the GPU and keeps its fp32 weight, gradient and AdamW"
        " shards there between steps), 0.9 for a static one. With kv_cache_gb set, it is only that start-up check.")
    kv_cache_gb: float | None = Field(None, gt=0, description="KV cache size in GiB; wins over"
                                      " gpu_memory_utilization for the KV cache. Default: 1 on the CPU; on CUDA, what"
                                      " gpu_memory_utilization leaves after the weights and activations.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs each replica of the model is split across.")
    data_parallel_size: int = Field(1, ge=1, description="Replicas of the model, each on tensor_parallel_size GPUs.")
    dtype: Literal[VLLM_DTYPES] | None = Field(None, description="Weights and activations (default: float32 on the"
                                               " CPU, so logprobs match the trainer's fp32 forward; bfloat16 on CUDA).")
    max_num_seqs: int | None = Field(None, ge=1, description="Sequences vLLM runs at once (default: vLLM's).")
    extra_args: list[str] = Field(default_factory=list, description="More arguments for vLLM's command line, appended"
                                  " as they are, e.g. [--enable-chunked-prefill, --swap-space=8]. The flags marl sets"
                                  " (the keys above, --model, --host, --port, ...) are refused.")
    sleep_between_steps: Literal["auto", True, False] = Field(
        "auto", description="Sleep mode (CUDA only): before each training step vLLM offloads its weights and drops its"
        " KV cache so the trainer has the GPU, and the weight sync wakes it. auto: on CUDA for a trainable server"
        " whose placement.engine_gpus and trainer_gpus overlap (both default to GPU 0); off when they are disjoint.")
    weight_sync: Literal[VLLM_WEIGHT_SYNC_MODES] = Field(
        "auto", description="How the trainer's weights reach vLLM after each step: disk (a safetensors directory"
        " that vLLM reloads), ipc (CUDA IPC handles: each trainer rank hands its gathered copy to the vLLM worker on"
        " its GPU), nccl (a broadcast from the trainer, with the trainer's NCCL library named for vLLM), both through"
        " vLLM's weight-transfer engine with the disk as the fallback. auto: the disk on the CPU; on CUDA ipc when"
        " every engine GPU is a trainer GPU (any tensor x data parallel size), nccl when they are disjoint and the"
        " trainer's NCCL library is found, else the disk (`marl plan` prints which). Not yet run on a GPU.")

    @field_validator("extra_args")
    @classmethod
    def _not_managed(cls, extra_args: list[str]) -> list[str]:
        problems = []
        for arg in extra_args:
            flag = arg.split("=", 1)[0]
            flag = flag.replace("_", "-") if flag.startswith("--") else flag  # vLLM reads --max_model_len too
            if flag in VLLM_MANAGED_FLAGS:
                key = VLLM_MANAGED_FLAGS[flag]
                problems.append(f"{arg!r}: marl sets {flag} itself" + (f": set vllm.{key} instead" if key else ""))
        if problems:
            raise rule_error("; ".join(problems))
        return extra_args


GPUIndices = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class PlacementSpec(_Spec):
    """Which GPUs of its machine a server's engine and trainer ranks use (docs/architecture.md, "Placement").

    Indices count the GPUs `marl serve` sees (under Ray: the ones Ray gave its actor). Local servers get them as
    CUDA_VISIBLE_DEVICES of every process they start; for a remote swarm or external server they only describe its
    machine to `marl plan`. Left out: the engine on GPU 0 and trainer rank r on GPU r, as without placement.
    """

    gpu_memory_gb: float | None = Field(None, gt=0, description="Memory of one GPU in GB, for `marl plan` (default"
                                        " for a local server: what torch.cuda reports).")
    host_memory_gb: float | None = Field(None, gt=0, description="Host memory of the server's machine in GB, for"
                                         " `marl plan`: checked against what the box holds beside its GPUs"
                                         " (sleeping vLLMs' weights, checkpoint staging); unset: printed, not"
                                         " checked.")
    engine_gpus: GPUIndices | None = Field(None, description="GPUs of the inference engine: one for the torch"
                                           " engine; vllm.tensor_parallel_size x data_parallel_size for vLLM"
                                           " (default: [0]).")
    trainer_gpus: GPUIndices | None = Field(None, description="GPUs of the trainer, one rank per GPU on each node:"
                                            " train.fsdp.ranks = nodes x their number (ranks defaults to it); one"
                                            " for trainer: grpo (default: rank r on GPU r).")
    nodes: int = Field(1, ge=1, description="Machines the trainer's ranks and vLLM's replicas may span, under"
                       " run.ray: 1 packs the server, its ranks and replicas onto one node, more lets Ray place them"
                       " on as few nodes as hold them (each rank and each replica after the first its own bundle:"
                       " rank_resources, replica_resources). For `marl plan`: nodes x trainer_gpus ranks.")
    rendezvous_port: int | None = Field(None, ge=1, le=65535, description="Deprecated, not used: ranks on other"
                                        " machines are Ray actors now (run.ray), not `marl trainer-node`.")

    @model_validator(mode="after")
    def _unique(self) -> PlacementSpec:
        _raise_rules(self, [((key,), f"GPU {gpus[i]} is listed twice: list each GPU once, e.g. [0, 1]")
                            for key in ("engine_gpus", "trainer_gpus") if (gpus := getattr(self, key))
                            for i in range(len(gpus)) if gpus[i] in gpus[:i]])
        return self

    def shares_gpu(self) -> bool:
        """Do the engine and the trainer use a GPU in common (the defaults: GPU 0 both)?"""
        return bool(set(self.engine_gpus or [0]) & set(self.trainer_gpus or [0]))


class PolicySpec(_Spec):
    """One LoRA policy of a trainable server (`servers.S.policies.NAME`): its adapter, and what of the server's
    `train:` it changes (e.g. `train: {grpo: {learning_rate: 1.0e-4}}`); each policy is its own learner."""

    lora: LoraSpec = Field(default_factory=LoraSpec, description="The adapter: rank, alpha, dropout,"
                           " target_modules (peft's LoraConfig vocabulary).")
    train: dict[str, Any] = Field(default_factory=dict, description="Keys of the server's train: this policy sets"
                                  " otherwise (merged into it, sections key by key).")


class ServerSpec(_Spec):
    """One model server. Which keys are set decides its kind (see the module docstring)."""

    model: str | None = Field(None, description="Local: a Hugging Face id (org/name: from the Hugging Face cache, or"
                                                " downloaded there), a model directory or an alias. External: the"
                                                " model id to request. Remote swarm: optional, the model it is"
                                                " expected to serve.")
    revision: str | None = Field(None, min_length=1, description="With a model: given by its Hugging Face id: the"
                                 " branch, tag or commit (default: main). Local: what `marl serve --revision`"
                                 " loads; remote or external: the one whose config `marl plan` reads.")
    trainable: bool = False
    # local servers only
    device: str | None = Field(None, description="Local: cpu or cuda (default: cuda when available).")
    port: int | None = Field(None, ge=1, le=65535, description="Local: fixed port (default: a free one).")
    prefix_cache_gb: float | None = Field(None, ge=0, description="Local: memory for the keys/values of finished "
                                          "calls that the next turn of a conversation reuses (default 2; 0: off).")
    engine: Literal["torch", "vllm"] | None = Field(None, description="Local: the inference engine: torch (default)"
                                                    " or vllm (a subprocess in its own virtualenv: make vllm).")
    vllm: VLLMSpec | None = Field(None, description="Local, with engine: vllm: how vLLM runs (max_model_len,"
                                  " gpu_memory_utilization or kv_cache_gb, parallel sizes, dtype, max_num_seqs,"
                                  " extra_args, sleep_between_steps). Remote swarm or external: how the vLLM"
                                  " there runs, for `marl plan` (marl run starts nothing there).")
    placement: PlacementSpec | None = Field(None, description="Which GPUs the engine and the trainer's ranks use"
                                            " (engine_gpus, trainer_gpus, nodes, gpu_memory_gb). Local: set for"
                                            " every process the server starts; remote swarm or external: describes"
                                            " that machine for `marl plan`.")
    resources: dict[str, Annotated[float, Field(ge=0)]] | None = Field(
        None, description="Local, with run.ray: what the server's Ray actor asks of a node: CPU (default 1), GPU,"
                          " memory (bytes) or any custom resource, e.g. {GPU: 1} or {node_b: 1} (docs/ray.md)."
                          " Without run.ray it is not used.")
    rank_resources: dict[str, Annotated[float, Field(ge=0)]] | None = Field(
        None, description="Local, with run.ray and train.trainer: fsdp: what each trainer rank's Ray actor asks (its"
                          " bundle of the server's placement group): default {CPU: 1}, plus {GPU: 1} on GPUs; a"
                          " custom resource pins ranks to nodes (docs/ray.md). Without run.ray it is not used.")
    replica_resources: dict[str, Annotated[float, Field(ge=0)]] | None = Field(
        None, description="Local, with run.ray, engine: vllm and vllm.data_parallel_size > 1: what each vLLM replica"
                          " after the first asks (a Ray actor in a bundle of its own; the first runs beside the"
                          " server, in resources): default {CPU: 1}, plus {GPU: tensor_parallel_size} on GPUs"
                          " (docs/ray.md). Without run.ray it is not used.")
    # external OpenAI endpoint
    url: str | None = Field(None, description="External: OpenAI base URL, e.g. http://host:8000/v1.")
    api_key_env: str | None = Field(None, description="External: environment variable holding the API key.")
    # remote swarm server
    swarm_url: str | None = Field(None, description="Remote swarm server root URL, e.g. http://gpu-box:10086.")
    admin_token_env: str | None = Field(None, description="Remote swarm: environment variable holding the admin token.")
    # trainable servers
    train: TrainConfig | None = Field(None, description="Trainable: the config synced to the server (with"
                                       " policies: every policy's defaults).")
    policies: dict[str, PolicySpec] | None = Field(None, description="Trainable: LoRA policies of this one base"
                                                   " model, each trained on its own (roles name theirs: policy:).")
    # a league of past selves
    past_of: PastOfSpec | None = Field(None, description="Past snapshots: serve past checkpoints of a local"
                                                         " trainable server, e.g. past_of: {server: learner}.")

    @property
    def kind(self) -> ServerKind:
        if self.past_of is not None:
            return ServerKind.PAST_SNAPSHOTS
        if self.swarm_url is not None:
            return ServerKind.REMOTE_SWARM
        if self.url is not None:
            return ServerKind.EXTERNAL_OPENAI
        return ServerKind.LOCAL_TRAINABLE if self.trainable else ServerKind.LOCAL_STATIC

    @property
    def is_local(self) -> bool:
        """Runs on this machine, started by `marl run` (past snapshots too: one `marl serve --static` per snapshot)."""
        return self.kind in (ServerKind.LOCAL_TRAINABLE, ServerKind.LOCAL_STATIC, ServerKind.PAST_SNAPSHOTS)

    @property
    def overlaps(self) -> bool:
        """A learner of this server trains beside its rollouts (`train.overlap`, or a policy's): its engine keeps
        generating during every step, so it never sleeps for one."""
        base = bool(self.train and self.train.overlap)
        return any(bool(p.train.get("overlap", base)) for p in self.policies.values()) if self.policies else base

    def policy_train(self, policy: str) -> TrainConfig:
        """The config synced for `policy`: the server's `train:` with the policy's own keys merged in."""
        return _merged_train(self.train or TrainConfig(), self.policies[policy].train)  # type: ignore[index]

    @model_validator(mode="after")
    def _rules(self) -> ServerSpec:
        kind_rules = _kind_rules(self)
        if kind_rules:  # its kind cannot be told: the other rules would only guess
            _raise_rules(self, kind_rules)
        _raise_rules(self, [*_placement_rules(self), *_revision_rules(self), *_external_rules(self),
                            *_swarm_rules(self), *_past_of_rules(self), *_train_rules(self), *_vllm_rules(self),
                            *_policy_rules(self)])
        _raise_rules(self, _gpu_rules(self))  # after the others: they read train and vllm as valid
        _default_ranks(self)
        return self


def _kind_rules(s: ServerSpec) -> list[Rule]:
    if s.past_of is not None:
        return [((key,), f"{key} does not apply to a past_of server: it serves the checkpoints of"
                         f" servers.{s.past_of.server} (and its model for the initial snapshot): remove {key}")
                for key in ("model", "revision", "url", "swarm_url") if getattr(s, key) is not None]
    if s.url is not None and s.swarm_url is not None:
        return [((), "both url (an external OpenAI endpoint) and swarm_url (a remote swarm server) are set: keep"
                     " swarm_url for a swarm server you train, url for a fixed OpenAI-compatible endpoint")]
    if s.model is None and s.url is None and s.swarm_url is None:
        return [((), "says neither what nor where the model is: give model: (a local server that `marl run` starts,"
                     " e.g. model: smollm2-135m), url: + model: (an external OpenAI endpoint), swarm_url: (a"
                     " remote swarm server), or past_of: (past checkpoints of a trainable server)")]
    return []


def _placement_rules(s: ServerSpec) -> list[Rule]:
    """Keys that only apply to local servers, or only to remote ones; URLs that are not URLs."""
    rules: list[Rule] = []
    if not s.is_local:
        which = "url" if s.kind is ServerKind.EXTERNAL_OPENAI else "swarm_url"
        rules += [((key,), f"{key} only applies to a local server that `marl run` starts, but this server is remote"
                           f" ({which}: is set): remove {key}, or remove {which} to run it locally")
                  for key in ("device", "port", "prefix_cache_gb", "engine", "resources", "rank_resources",
                              "replica_resources")
                  if getattr(s, key) is not None]  # vllm: and placement: describe the remote machine (marl plan)
    else:
        rules += [((key,), f"{key} only applies to remote servers (url: or swarm_url:); `marl run` makes its own"
                           " tokens for the servers it starts: remove it")
                  for key in ("api_key_env", "admin_token_env") if getattr(s, key) is not None]
    for key, url in (("url", s.url), ("swarm_url", s.swarm_url)):
        if url is not None and not re.match(r"^https?://[^/\s]+", url):
            example = "http://host:8000" + ("/v1" if key == "url" else "")
            rules.append(((key,), f"{url!r} is not an http(s) URL, e.g. {example}"))
    return rules


def _revision_rules(s: ServerSpec) -> list[Rule]:
    """A revision is one of a Hugging Face id's (whether `model` names a directory here is `check_local_models`'s)."""
    if s.revision is None or s.past_of is not None:
        return []
    if s.model is None:
        return [(("revision",), "a revision of which model? model: is not set: give model: (a Hugging Face id),"
                                " or remove revision")]
    if s.model in MODEL_ALIASES:
        return [(("revision",), f"{s.model} is an alias marl builds, which has no revisions: remove revision, or"
                                " name the model by its Hugging Face id")]
    return []


def _external_rules(s: ServerSpec) -> list[Rule]:
    if s.kind is not ServerKind.EXTERNAL_OPENAI:
        return []
    rules: list[Rule] = []
    if s.model is None:
        rules.append((("model",), "an external OpenAI endpoint needs the model id to request, e.g."
                                  " model: Qwen/Qwen3-235B-A22B-Instruct-2507"))
    if s.trainable:
        rules.append((("trainable",), "an external OpenAI endpoint cannot be trained: set trainable: false, or run"
                                      " `marl serve` on that machine and give its swarm_url: instead of url:"))
    if s.admin_token_env is not None:
        rules.append((("admin_token_env",), "an external OpenAI endpoint has no admin token; for its API key use"
                                            " api_key_env:"))
    return rules


def _swarm_rules(s: ServerSpec) -> list[Rule]:
    if s.kind is not ServerKind.REMOTE_SWARM:
        return []
    rules: list[Rule] = []
    if not s.trainable:
        rules.append((("trainable",), "a remote swarm server is one you train: set trainable: true; for a frozen"
                                      " remote model give its OpenAI endpoint instead (url: http://host:port/v1"
                                      " and model:)"))
    if s.api_key_env is not None:
        rules.append((("api_key_env",), "a swarm server hands out a key per episode; api_key_env is for external"
                                        " OpenAI endpoints (url:). For its admin token use admin_token_env:"))
    return rules


def _past_of_rules(s: ServerSpec) -> list[Rule]:
    if s.kind is not ServerKind.PAST_SNAPSHOTS:
        return []
    rules: list[Rule] = []
    if s.trainable:
        rules.append((("trainable",), "a past_of server plays frozen checkpoints: remove trainable: (the server it"
                                      f" is a past of, servers.{s.past_of.server}, is the one that trains)"))
    if s.port is not None:
        rules.append((("port",), "a past_of server runs one process per snapshot, each on a free port: remove port"))
    rules += [((key,), f"a past_of server's snapshots run on the machine of `marl run`, not as Ray actors: remove"
                       f" {key}") for key in ("resources", "rank_resources", "replica_resources")
              if getattr(s, key) is not None]
    return rules


def _vllm_rules(s: ServerSpec) -> list[Rule]:
    if s.vllm is None or not s.is_local:
        return []  # a remote server's vllm: only describes the vLLM there (for marl plan)
    if s.kind is ServerKind.PAST_SNAPSHOTS:
        return [(("vllm",), "a past_of server's snapshots are served by the torch engine: remove vllm")]
    if s.engine != "vllm":
        return [(("vllm",), f"vllm: applies to engine: vllm, but this server's engine is {s.engine or 'torch'}"
                            " (the default): set engine: vllm, or remove vllm")]
    if s.vllm.sleep_between_steps is True and s.device == "cpu":
        return [(("vllm", "sleep_between_steps"), "sleep mode needs CUDA (the CPU build of vLLM has none): set it"
                                                  " to auto or false, or device: cuda")]
    if s.vllm.sleep_between_steps is True and s.overlaps:
        return [(("vllm", "sleep_between_steps"), "train.overlap keeps vLLM generating during every training step,"
                                                  " so it cannot sleep for one: set sleep_between_steps to auto or"
                                                  " false (the trainer must then fit beside vLLM), or overlap: false")]
    return []


def _merged_train(base: TrainConfig, changes: dict[str, Any]) -> TrainConfig:
    data = base.model_dump()
    for key, value in changes.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    return TrainConfig.model_validate(data)


def _policy_rules(s: ServerSpec) -> list[Rule]:
    if not s.policies:
        return [(("policies",), "policies: is empty: name at least one, e.g. policies: {speaker: {lora: {rank:"
                                " 16}}}, or remove it")] if s.policies is not None else []
    if not s.trainable or s.kind not in (ServerKind.LOCAL_TRAINABLE, ServerKind.REMOTE_SWARM):
        return [(("policies",), "only a trainable swarm server trains policies (model: + trainable: true, or"
                                " swarm_url:): remove policies, or set trainable: true")]
    rules: list[Rule] = [(("policies", name), f"bad policy name {name!r}: {NAME_RULE}") for name in s.policies
                         if not NAME_RE.match(name)]  # fmt: skip
    merged: dict[str, TrainConfig] = {}
    for name in s.policies:
        try:
            merged[name] = s.policy_train(name)
        except ValidationError as exc:
            rules.append((("policies", name, "train"), f"does not make a valid train config: {exc.errors()[0]['msg']}"
                                                       f" at {'.'.join(map(str, exc.errors()[0]['loc']))}"))
    return rules + _shared_trainer_rules(merged)


def _shared_trainer_rules(merged: dict[str, TrainConfig]) -> list[Rule]:
    """A server's policies share one trainer (servers.entrypoint.lora_trainer_factory): one kind, and under fsdp
    the same ranks, started once for all of them."""
    if not merged:
        return []
    first, config = next(iter(merged.items()))
    rules: list[Rule] = []
    for name, other in merged.items():
        if other.trainer != config.trainer:
            rules.append((("policies", name, "train"), f"trains with trainer: {other.trainer}, policy {first} with"
                                                       f" {config.trainer}: the policies of a server share one"
                                                       " trainer; give them all the same trainer"))
        elif config.trainer == "fsdp" and (other.fsdp.ranks, other.fsdp.mixed_precision) != (
                config.fsdp.ranks, config.fsdp.mixed_precision):  # fmt: skip
            rules.append((("policies", name, "train"), f"fsdp.ranks / fsdp.mixed_precision differ from policy"
                                                       f" {first}'s: the policies of a server share their FSDP"
                                                       " ranks; give them the same ones"))
    return rules


def _train_rules(s: ServerSpec) -> list[Rule]:
    if s.trainable and s.train is None and s.kind not in (ServerKind.EXTERNAL_OPENAI, ServerKind.PAST_SNAPSHOTS):
        return [(("train",), "a trainable server needs its training config: add train: (a TrainConfig), e.g."
                             " train: {job: my-job, batch_size: 4, num_repeat: 4, learning_rate: 2.0e-5};"
                             " or set trainable: false")]
    if not s.trainable and s.train is not None:
        return [(("train",), "a static server does not train: remove train:, or set trainable: true")]
    return []


def _gpu_rules(s: ServerSpec) -> list[Rule]:
    """placement: against the server's kind, device, engine and trainer."""
    p = s.placement
    if p is None:
        return []
    if s.kind is ServerKind.PAST_SNAPSHOTS:
        return [(("placement",), "a past_of server's snapshots are placed by marl run, one process each: remove"
                                 " placement")]
    rules: list[Rule] = [(("placement", key), f"device: cpu uses no GPU: remove placement.{key}, or set device:"
                                              " cuda")
                         for key in ("engine_gpus", "trainer_gpus") if s.device == "cpu" and getattr(p, key)]
    return rules + _engine_gpu_rules(s, p) + _trainer_gpu_rules(s, p)


def _engine_gpu_rules(s: ServerSpec, p: PlacementSpec) -> list[Rule]:
    if p.engine_gpus is None:
        return []
    count = len(p.engine_gpus)
    if s.engine == "vllm" or (not s.is_local and s.vllm is not None):
        vllm = s.vllm or VLLMSpec()
        want = vllm.tensor_parallel_size * vllm.data_parallel_size
        if count != want:
            return [(("placement", "engine_gpus"), f"vLLM runs on vllm.tensor_parallel_size x data_parallel_size ="
                                                   f" {want} GPUs, but engine_gpus lists {count}: list {want}, or"
                                                   " change those sizes")]
    elif s.is_local and count > 1:
        return [(("placement", "engine_gpus"), f"the torch engine runs on one GPU, but engine_gpus lists {count}:"
                                               " list one, or use engine: vllm with vllm.tensor_parallel_size")]
    return []


def _trainer_gpu_rules(s: ServerSpec, p: PlacementSpec) -> list[Rule]:
    gpus, nodes = ("placement", "trainer_gpus"), ("placement", "nodes")
    # vLLM's replicas after the first are Ray actors of their own, which may run on other machines (run.ray)
    spread = p.nodes > 1 and not (s.engine == "vllm" and s.vllm is not None and s.vllm.data_parallel_size > 1)
    if not s.trainable or s.train is None:
        return ([(gpus, "a static server does not train: remove placement.trainer_gpus")] * (p.trainer_gpus is not None)
                + [(nodes, "a static server has no trainer ranks to spread, nor vLLM replicas"
                           " (vllm.data_parallel_size): remove placement.nodes")] * spread)
    train, per_node = s.train, len(p.trainer_gpus or ())
    if train.trainer == "grpo":
        return ([(gpus, f"trainer: grpo trains in one process on one GPU, but trainer_gpus lists {per_node}: list"
                        " one, or set train.trainer: fsdp (one rank per GPU)")] * (per_node > 1)
                + [(nodes, "trainer: grpo trains on one machine: set train.trainer: fsdp to spread ranks over"
                           " nodes (or vllm.data_parallel_size > 1 to spread replicas), or remove placement.nodes")]
                * spread)
    ranks, given = train.fsdp.ranks, "ranks" in train.fsdp.model_fields_set
    if per_node and given and ranks != p.nodes * per_node:
        return [(gpus, f"train.fsdp.ranks is {ranks}, but nodes x len(trainer_gpus) = {p.nodes} x {per_node} ="
                       f" {p.nodes * per_node} ranks (one per GPU): make them equal, or leave train.fsdp.ranks"
                       " out (it defaults to that)")]
    return []  # without trainer_gpus, Ray places each rank where a bundle fits (marl/topology/bundles.py)


def _default_ranks(s: ServerSpec) -> None:
    """train.fsdp.ranks left out follows the placement: one rank per trainer GPU on each node."""
    p, train = s.placement, s.train
    if p and p.trainer_gpus and train and train.trainer == "fsdp" and "ranks" not in train.fsdp.model_fields_set:
        train.fsdp.ranks = p.nodes * len(p.trainer_gpus)


class SamplingSpec(_Spec):
    """A role's own sampling settings (`roles.R.sampling`), sent with every call of its LLM agents and recorded in
    games.jsonl. A setting left out is the run's (`run.temperature`, `run.max_tokens`) or, for `top_p` and `stop`,
    the server's default (1.0, none)."""

    temperature: float | None = Field(None, ge=0, le=2, description="Sampling temperature (default: run.temperature).")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling: the smallest set of tokens whose"
                                " probability reaches top_p (default: 1, every token).")
    max_tokens: int | None = Field(None, ge=1, description="Longest reply per turn (default: run.max_tokens).")
    stop: list[str] | None = Field(None, max_length=16, description="Strings that end a reply (one string or a list"
                                   " of up to 16); the reply stops before the first one.")
    choice: bool | None = Field(None, description="Hold each reply to one of the env's legal moves (the server's"
                                " structured_outputs choice): no invalid reply, and the model's own preference"
                                " among the moves. A turn of free text is not held.")

    @field_validator("stop", mode="before")
    @classmethod
    def _one_or_more(cls, stop: Any) -> Any:
        return [stop] if isinstance(stop, str) else stop

    @field_validator("stop")
    @classmethod
    def _not_empty(cls, stop: list[str] | None) -> list[str] | None:
        if stop is not None and not all(stop):
            raise rule_error("an empty stop string would end every reply before it starts: remove it")
        return stop

    def overrides(self) -> dict[str, Any]:
        """The settings this role sets, by name (those left out are not there)."""
        return self.model_dump(exclude_none=True)


class RoleSpec(_Spec):
    """One role: played by a model server (`server`) or by the env's scripted policy (`scripted: true`).

    `count` and `team` restate what the env deals (`dealt_roles()`): left out, they are taken from the env; given,
    they must agree with it (checked at load). `sampling` overrides the run's sampling settings for this role's LLM
    agents.
    """

    server: str | None = None
    policy: str | None = Field(None, description="Which of its server's LoRA policies plays this role (required"
                               " where the server has several).")
    scripted: bool = False
    count: int | None = Field(None, ge=1, description="How many agents play this role in one game (default: the"
                                                      " env's count).")
    team: str | None = Field(None, description="Team name (default: the env's team of this role).")
    sampling: SamplingSpec | None = Field(None, description="This role's temperature, top_p, max_tokens and stop,"
                                          " overriding run.temperature and run.max_tokens (a model-played role only).")

    @field_validator("team")
    @classmethod
    def _team_name(cls, team: str | None) -> str | None:
        if team is not None and not NAME_RE.match(team):
            raise rule_error(f"bad team name {team!r}: {NAME_RULE}")
        return team

    @model_validator(mode="after")
    def _one_player(self) -> RoleSpec:
        if self.server is not None and self.scripted:
            _raise_rules(self, [((), f"both server: {self.server} and scripted: true; a role is played by a model"
                                     " server or by the env's scripted policy, not both: remove one")])
        if self.scripted and self.sampling is not None:
            _raise_rules(self, [(("sampling",), "a scripted role samples no model: remove sampling, or play the"
                                                " role with a server")])
        return self


#: The env class that plays a TextArena game id (`env.textarena`).
TEXTARENA_CLASS = "envs.textarena_env:TextArenaEnv"
#: The env class that plays an OpenSpiel game (`env.openspiel`).
OPENSPIEL_CLASS = "envs.openspiel_env:OpenSpielEnv"
#: The keys that name a game of a suite instead of `class:`, and the class that plays it.
GAME_SUITES = {"textarena": TEXTARENA_CLASS, "openspiel": OPENSPIEL_CLASS}


class EnvSpec(_Spec):
    class_path: str = Field(alias="class", description="Import path of the env: 'module:Class' or 'module:factory'"
                                                       " (a function that returns the env).")
    textarena: str | None = Field(None, description="A TextArena game id (SecretMafia-v0, KuhnPoker-v0), instead of"
                                  " class: played by envs.textarena_env:TextArenaEnv, env.args its arguments"
                                  " (num_players, shared_role, teams, game_args).")
    openspiel: str | None = Field(None, description="An OpenSpiel game name (kuhn_poker, leduc_poker, liars_dice),"
                                  " instead of class: played by envs.openspiel_env:OpenSpielEnv, env.args its"
                                  " arguments (params, shared_role, deals, scripted_policy, invalid_penalty).")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the env class or factory.")

    @model_validator(mode="before")
    @classmethod
    def _suite_game(cls, data: Any) -> Any:
        """`textarena: ID` is `class: envs.textarena_env:TextArenaEnv` with `args.game: ID`; `openspiel: NAME` the
        same with `envs.openspiel_env:OpenSpielEnv`."""
        if not isinstance(data, dict):
            return data
        named = [suite for suite in GAME_SUITES if data.get(suite) is not None]
        if len(named) > 1:
            raise rule_error(f"both {named[0]}: and {named[1]}:; an env is one game: remove one")
        if not named:
            return data
        suite, game, args = named[0], data[named[0]], data.get("args") or {}
        if data.get("class", GAME_SUITES[suite]) != GAME_SUITES[suite]:
            raise rule_error(f"both class: {data['class']} and {suite}: {game}; an env is a class or a game of"
                             f" {suite}, not both: remove one")
        if not isinstance(args, dict) or args.get("game", game) != game:
            raise rule_error(f"args.game ({args.get('game') if isinstance(args, dict) else args!r}) is not {suite}:"
                             f" {game}: remove args.game ({suite}: names the game)")
        return {**data, "class": GAME_SUITES[suite], "args": {"game": game, **args}}

    @field_validator("class_path")
    @classmethod
    def _import_path(cls, path: str) -> str:
        if problem := import_path_problem(path):
            raise rule_error(problem)
        return path

    @property
    def module(self) -> str:
        return self.class_path.partition(":")[0]

    @property
    def qualname(self) -> str:
        """The env's name in messages: the TextArena or OpenSpiel game, or the class (factory) name."""
        return self.textarena or self.openspiel or self.class_path.partition(":")[2]

    @property
    def suite(self) -> str | None:
        """The key that names the game (`textarena`, `openspiel`), None for an env given by `class:`."""
        return next((suite for suite in GAME_SUITES if getattr(self, suite) is not None), None)


class RaySpec(_Spec):
    """Run the local servers as Ray actors, and optionally the games as Ray tasks (docs/ray.md)."""

    address: str = Field(description="local: a private Ray instance that this run starts and stops; auto: the"
                         " cluster this machine joined (`ray start`); ray://HOST:PORT: a Ray client connection;"
                         " HOST:PORT: a cluster's head (GCS) address.")
    spread_games: bool = Field(False, description="Play each game as a Ray task on any node instead of in a thread"
                               " of `marl run` (leases and commits stay with `marl run`).")

    @field_validator("address")
    @classmethod
    def _address(cls, address: str) -> str:
        if address in ("local", "auto") or re.match(r"^(ray://)?[^/\s:]+:\d+$", address):
            return address
        raise rule_error(f"{address!r} is not a Ray address: local (a private instance), auto (the cluster of"
                         " this machine), ray://HOST:PORT (Ray client) or HOST:PORT (a cluster's head)")


class ExploreSpec(_Spec):
    """Exploring starts (docs/design.md): a share of tasks open with moves drawn uniformly from the legal moves."""

    share: float = Field(gt=0, le=1, description="Share of tasks (a task's repeats alike: one GRPO group) whose"
                         " first moves are drawn uniformly from the legal moves instead of asked of the models.")
    moves: int = Field(1, ge=1, description="How many of the game's first moves are drawn (any player's).")
    trained: bool = Field(False, description="Ask each drawn move of the model with its reply held to it, so it is"
                          " trained like a sampled move, and draw the moves per repeat (a GRPO group compares them);"
                          " false: tell it to the players, never trained, alike for a task's repeats.")


class RunSpec(_Spec):
    games: int | None = Field(None, ge=1, description="Total games (None: until max_steps).")
    max_steps: int | None = Field(None, ge=1, description="Stop once every trainable learner (server, or LoRA policy)"
                                  " is at policy version max_steps or later: the slowest one decides.")
    repeats: int | None = Field(None, ge=1, description="Games per task id (= every trainable server's num_repeat).")
    concurrency: int = Field(8, ge=1, description="Games in flight.")
    per_server_concurrency: int | None = Field(None, ge=1, description="Cap of concurrent leases per server.")
    lease_timeout_s: float = Field(60.0, gt=0)
    max_tokens: int = Field(64, ge=1, description="Longest reply of an LLM agent per turn.")
    temperature: float = Field(1.0, ge=0, le=2, description="Sampling temperature of the LLM agents.")
    seed: int = 0
    run_dir: Path | None = Field(None, description="Output directory (default: runs/<name>).")
    max_failures: int = Field(5, ge=1, description="A game that fails this many times in a row ends the run (exit 1,"
                              " with its last failure); a failed game is replayed with the same task id. Also how"
                              " often a server that keeps stopping with an error is revived.")
    eval_every: int | None = Field(None, ge=1, description="Every this many training steps (and at step 0), play"
                                   " eval_games greedy games between checkpoints, in the background, into"
                                   " evals.jsonl (None: off). Needs checkpoints at those steps.")
    eval_games: int = Field(8, ge=1, description="Games per pairing of each run.eval_every evaluation.")
    eval_exploitability: bool = Field(False, description="With run.eval_every, in a two-player zero-sum OpenSpiel"
                                      " game (or TextArena's one-round KuhnPoker): each evaluation also measures"
                                      " how far `latest` is from a Nash equilibrium (OpenSpiel's exact best"
                                      " response), into exploitability.jsonl and exploitability.png.")
    transcripts: Literal["full", "summary", "off"] = Field(
        "full", description="What games.jsonl keeps of each game for `marl games show`: full (every turn's"
        " observation and reply, each cut to 2000 characters, 64000 a game, and the env's summary), summary (the"
        " env's summary and the replies), off (neither).")
    ray: RaySpec | None = Field(None, description="Run on a Ray cluster (None: everything on this machine).")
    stall_batches: int = Field(10, ge=2, description="A trainable learner that took no training step in this many"
                               " batches' worth of games (batch_size x num_repeat each, plus run.concurrency) is"
                               " stalled: its pool cannot fill (a role that never calls the model, say). The run"
                               " then says why and acts as run.on_stall says.")
    explore: ExploreSpec | None = Field(None, description="Exploring starts (None: every move asked of its player):"
                                        " states a learner's own policy avoids are still reached and trained.")
    on_stall: Literal["stop", "warn"] = Field("stop", description="What a stalled learner does to the run: stop"
                                              " (exit 1, with the reason) or warn (say it once and go on).")

    @field_validator("transcripts", mode="before")
    @classmethod
    def _off_is_not_false(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML (and key=value overrides) read a bare `off` as false

    @model_validator(mode="after")
    def _stops(self) -> RunSpec:
        if self.games is None and self.max_steps is None:
            _raise_rules(self, [((), "the run never stops: set run.max_steps (training steps every trainable server"
                                     " must take) or run.games (total games)")])
        return self


class TopologySpec(_Spec):
    name: str = Field(min_length=1)
    description: str | None = None
    servers: dict[str, ServerSpec] = Field(default_factory=dict)
    roles: dict[str, RoleSpec] = Field(min_length=1)
    env: EnvSpec
    # Validated when left out too: a run without `run:` never stops, and RunSpec says so.
    run: RunSpec = Field(default_factory=dict, validate_default=True)  # type: ignore[arg-type]
