"""A topology's memory plan: for each server whose devices are known, what each device holds, and whether it fits.

A local server on the CPU is planned against this machine's memory (all local CPU servers share it). A server on
GPUs (local with `device: cuda`, or remote / external with a `placement:` that states its box) is planned per GPU:
the engine's GPUs hold vLLM (or the torch engine), the trainer's GPUs one rank each; a GPU in both holds the two,
and the check is made at the two moments that matter:

- rollouts: the engine awake, the trainer rank holding its shards between steps; and when vLLM starts (or restarts
  after a crash) it refuses unless `gpu_memory_utilization` x the GPU is free, with that rank already there;
- a training step: the trainer rank at its peak, the engine asleep (sleep mode) or awake.

What does not fit becomes a `Problem` at the topology key to change (`servers.S.vllm.max_model_len`, ...), which
`marl plan` prints and `marl run` refuses to start with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from marl.protocol import VLLM_OWN_GPU_UTILIZATION
from marl.topology.bundles import RayBundles, ray_bundles
from marl.topology.problems import Problem

from .architecture import Architecture, UnknownModel, architecture_of
from .box import HostLoad, host_load, weight_sync_way
from .memory import (
    GB,
    GIB,
    Parts,
    TrainerSetting,
    VLLMSetting,
    activations,
    disk_per_checkpoint,
    engine_torch,
    engine_vllm,
    engine_vllm_asleep,
    largest_tensor,
    trainer_rank,
)

__all__ = ["DeviceLoad", "ServerPlan", "TopologyPlan", "plan_topology"]

#: Conversation length the torch engine's running batch is sized for (a game's conversation, prompt and replies).
TORCH_ENGINE_TOKENS_PER_SEQUENCE = 2048
#: The torch engine's largest running batch (servers/engines/torch_engine.py, max_batch_size).
TORCH_ENGINE_MAX_BATCH = 64
#: The torch engine's prefix cache when a server does not set prefix_cache_gb (servers/engines/prefix_cache.py).
DEFAULT_PREFIX_CACHE_GB = 2.0


@dataclass
class DeviceLoad:
    """One device of a server (a GPU, or the host's memory) at its two moments: rollouts and a training step."""

    device: str
    capacity: float
    rollouts: Parts
    step: Parts | None = None  # None: nothing trains here
    save: Parts | None = None  # while a checkpoint is written (None: no sharded trainer saves here)

    @property
    def peak(self) -> float:
        return max(parts.total for parts in (self.rollouts, self.step, self.save) if parts is not None)


@dataclass
class ServerPlan:
    server: str
    summary: str  # the model and how it runs
    devices: list[DeviceLoad] = field(default_factory=list)
    disk_per_step: Parts = field(default_factory=Parts)
    disk_per_checkpoint: Parts = field(default_factory=Parts)
    notes: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    #: How the weights reach the engine after a step (ipc, nccl, disk, in process); None: nothing trains
    weights: str | None = None
    #: The box's host memory (a server on GPUs)
    host: HostLoad | None = None
    save_every: int = 0  # train.save_freq (0: no checkpoints)
    #: Settings the topology leaves out, as the plan sizes them (key under the server -> value); `marl run` passes
    #: them to the local servers it starts.
    defaults: dict[str, Any] = field(default_factory=dict)


@dataclass
class TopologyPlan:
    servers: list[ServerPlan]
    skipped: list[str]  # servers whose devices the topology does not state

    @property
    def problems(self) -> list[Problem]:
        return [p for s in self.servers for p in s.problems]


def plan_topology(spec: Any, *, base_dir: Path | None = None, host_memory: float | None = None,
                  local_gpu_memory: float | None = None) -> TopologyPlan:  # fmt: skip
    """Plan every server of a `TopologySpec` whose devices are known (see the module docstring)."""
    plans, skipped = [], []
    for name, server in spec.servers.items():
        if server.past_of is not None and server.past_of.policy is not None:
            continue  # adapters on its source server's engine (frozen policies): no process or model of its own
        plan = _plan_server(name, server, spec, base_dir, local_gpu_memory)
        if plan is None:
            skipped.append(name)
        else:
            plans.append(plan)
    cpu_plans = [p for p in plans if p.devices and p.devices[0].device == "host"]
    if cpu_plans:
        _check_host(cpu_plans, host_memory if host_memory is not None else _host_memory())
    return TopologyPlan(plans, skipped)


def _plan_server(name: str, server: Any, spec: Any, base_dir: Path | None,
                 local_gpu_memory: float | None) -> ServerPlan | None:  # fmt: skip
    key = f"servers.{name}"
    placement = getattr(server, "placement", None)
    model, revision = server.model, server.revision
    if server.past_of is not None:
        source = spec.servers[server.past_of.server]
        model, revision = source.model, source.revision
    if model is None or (not server.is_local and placement is None):
        return None
    try:
        arch = architecture_of(model, base_dir=base_dir, revision=revision)
    except UnknownModel as exc:
        return ServerPlan(name, str(model), problems=[Problem(f"{key}.model", str(exc))])
    if server.is_local and _device_of(server) == "cpu":
        return _plan_on_host(name, server, arch, spec)
    gpu_bytes = _gpu_bytes(placement, local_gpu_memory)
    if gpu_bytes is None:
        return ServerPlan(name, arch.name, problems=[Problem(f"{key}.placement.gpu_memory_gb", "the memory of"
                          " one GPU is needed to plan a CUDA server (none is visible here): e.g. gpu_memory_gb: 80")])
    return _plan_on_gpus(name, server, arch, gpu_bytes, spec)


def _device_of(server: Any) -> str:
    if server.device is not None:
        return "cuda" if server.device.startswith("cuda") else "cpu"
    import torch  # the default of `marl serve`: cuda when available

    return "cuda" if torch.cuda.is_available() else "cpu"


def _gpu_bytes(placement: Any, local_gpu_memory: float | None) -> float | None:
    if placement is not None and getattr(placement, "gpu_memory_gb", None):
        return placement.gpu_memory_gb * 1e9
    if local_gpu_memory is not None:
        return local_gpu_memory
    import torch

    return float(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None


def _host_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _check_host(plans: list[ServerPlan], host_memory: float) -> None:
    """Every local CPU server shares this machine's memory. What they hold for certain (weights, trainer state) must
    fit, or the plan is refused at the largest server; their peaks, which count caches at their budgets and a full
    micro-batch, only earn a warning (the OS can page, and short games never reach them)."""
    for plan in plans:
        plan.devices[0].capacity = host_memory
    certain = sum(_certain(p.devices[0].rollouts) for p in plans)
    peak = sum(p.devices[0].peak for p in plans)
    largest = max(plans, key=lambda p: p.devices[0].peak)
    if certain > host_memory:
        largest.problems.append(Problem(f"servers.{largest.server}", f"the local CPU servers hold {certain / GB:.1f}"
                                        f" GB of weights and trainer state at once, more than this machine's"
                                        f" {host_memory / GB:.1f} GB: run fewer or smaller models here, or move one"
                                        " to a GPU box"))  # fmt: skip
    elif peak > host_memory:
        largest.notes.append(f"warning: at their peaks the local CPU servers may need {peak / GB:.1f} GB, more than"
                             f" this machine's {host_memory / GB:.1f} GB: lower prefix_cache_gb or train"
                             " micro_batch_tokens if they page")


def _certain(parts: Parts) -> float:
    return sum(nbytes for what, nbytes in parts.items if "cache" not in what)


# ----------------------------------------------------------------------------------------------------------------
# Trainer settings from a server's train: section
# ----------------------------------------------------------------------------------------------------------------


def trainer_setting(server: Any, arch: Architecture, *, on_gpu: bool,
                    ranks: int | None = None) -> TrainerSetting | None:  # fmt: skip
    train = getattr(server, "train", None)
    if not server.trainable or train is None:
        return None
    section = train.trainer_section
    sharded = train.trainer == "fsdp"
    mixed = getattr(section, "mixed_precision", "fp32")
    bf16 = sharded and (mixed == "bf16" or (mixed == "auto" and on_gpu))
    return TrainerSetting(ranks=(ranks or section.ranks) if sharded else 1, compute_bytes=2 if bf16 else 4,
                          micro_batch_tokens=section.micro_batch_tokens, checkpointing=section.gradient_checkpointing,
                          kl_reference=section.kl_coef > 0, entropy_bonus=section.entropy_coef > 0,
                          sharded=sharded, on_gpu=on_gpu,
                          adapters=adapter_params(server, arch))  # fmt: skip


def adapter_params(server: Any, arch: Architecture) -> tuple[int, ...]:
    """Each LoRA policy's adapter parameters (empty: the server trains its model's own weights)."""
    policies = getattr(server, "policies", None) or {}
    return tuple(arch.lora_params(p.lora.rank, p.lora.target_modules) for p in policies.values())


def _disk(plan: ServerPlan, server: Any, arch: Architecture, setting: TrainerSetting | None, *,
          weights_through_disk: bool, weight_bytes: int) -> None:  # fmt: skip
    """Per step: the weights exported for the engine when they travel by disk (in the engine's dtype); per
    checkpoint (every train.save_freq steps): `disk_per_checkpoint`."""
    if setting is None:
        return
    p = arch.parameter_count()
    if weights_through_disk:
        plan.disk_per_step.add("weights for the engine", (max(setting.adapters) if setting.adapters else p)
                               * weight_bytes)  # fmt: skip
    if server.train.save_freq:
        plan.save_every = server.train.save_freq
        plan.disk_per_checkpoint = disk_per_checkpoint(arch, sharded=setting.sharded,
                                                       export_bytes=setting.compute_bytes, adapters=setting.adapters)


# ----------------------------------------------------------------------------------------------------------------
# A server on this machine's CPU
# ----------------------------------------------------------------------------------------------------------------


def _calls_at_once(name: str, spec: Any) -> int:
    """How many of this server's calls can run at once: its agents in every game in flight, up to the engine's batch."""
    seats = sum(role.count or 1 for role in spec.roles.values() if role.server == name)
    return max(1, min(TORCH_ENGINE_MAX_BATCH, spec.run.concurrency * max(seats, 1)))


def _torch_engine(name: str, server: Any, arch: Architecture, spec: Any, *, on_gpu: bool) -> Parts:
    """The torch engine of a server: bf16 on a GPU, fp32 on the CPU (servers/engines/torch_engine.py)."""
    prefix = server.prefix_cache_gb if server.prefix_cache_gb is not None else DEFAULT_PREFIX_CACHE_GB
    parts = engine_torch(arch, weight_bytes=2 if on_gpu else 4, sequences=_calls_at_once(name, spec),
                         tokens_per_sequence=TORCH_ENGINE_TOKENS_PER_SEQUENCE, prefix_cache_bytes=prefix * GIB,
                         on_gpu=on_gpu)  # fmt: skip
    return parts.add("LoRA adapters", sum(adapter_params(server, arch)) * (2 if on_gpu else 4))


def _plan_on_host(name: str, server: Any, arch: Architecture, spec: Any) -> ServerPlan:
    copies = server.past_of.k if server.past_of is not None else 1
    plan = ServerPlan(name, f"{arch.name} ({arch.parameter_count() / 1e9:.2f}B) on the CPU"
                      + (f", {copies} snapshots" if copies > 1 else ""))  # fmt: skip
    if server.engine == "vllm":
        kv = server.vllm.kv_cache_gb if server.vllm and server.vllm.kv_cache_gb else 1.0
        engine = Parts().add("vLLM weights (fp32)", 4 * arch.parameter_count()).add("vLLM KV cache", kv * GIB)
    else:
        engine = _torch_engine(name, server, arch, spec, on_gpu=False)
    rollouts = Parts().extend(engine, prefix="engine: ") if copies == 1 else Parts().add(
        f"{copies} engines", copies * engine.total)
    setting = trainer_setting(server, arch, on_gpu=False)
    step = None
    if setting is not None:
        resident, peak = trainer_rank(arch, setting)
        rollouts.add(f"trainer ({setting.ranks} ranks) between steps", setting.ranks * resident.total)
        step = Parts().extend(engine, prefix="engine: ").extend(peak, prefix="trainer: ")
        if setting.ranks > 1:  # every rank peaks at once, on the same host
            step.add(f"trainer: ranks 1-{setting.ranks - 1}", (setting.ranks - 1) * peak.total)
    plan.devices.append(DeviceLoad("host", 0.0, rollouts, step))
    if setting is not None:  # the CPU build of vLLM: disk unless set; the torch engine: as on a GPU
        mode = getattr(server.vllm, "weight_sync", "auto") if server.vllm is not None else "auto"
        plan.weights = (weight_sync_way(mode, on_cpu=True, engine_gpus=[], trainer_gpus=[]) if server.engine == "vllm"
                        else "disk" if setting.sharded else "in process")  # fmt: skip
    vllm_dtype = getattr(server.vllm, "dtype", None) if server.vllm is not None else None
    _disk(plan, server, arch, setting, weights_through_disk=plan.weights == "disk",
          weight_bytes=2 if server.engine == "vllm" and vllm_dtype in ("bfloat16", "float16", "half") else 4)
    if setting is not None:
        plan.notes.append(_trainer_note(arch, setting))
    if not plan.problems:
        plan.notes.append(f"torch engine sized for {TORCH_ENGINE_TOKENS_PER_SEQUENCE}-token conversations"
                          if server.engine != "vllm" else "vLLM's CPU build: KV cache from vllm.kv_cache_gb (1 GiB)")
    if server.is_local and spec.run.ray is not None and server.past_of is None:
        plan.notes.append(bundles_note(ray_bundles(server)))
    return plan


# ----------------------------------------------------------------------------------------------------------------
# A server on GPUs
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _GPUs:
    engine: list[int]
    trainer: list[int]
    shared: set[int]


def _gpus(server: Any, setting: TrainerSetting | None, replicas: int, bundles: RayBundles | None = None) -> _GPUs:
    """The placement's GPUs, or what `marl serve` does without one: the engine on GPUs 0.., rank r on GPU r. Under
    run.ray (`bundles`) each rank has the GPU of its own bundle: numbered after the server's, never shared."""
    if bundles is not None:
        engine = list(range(max(replicas, int(bundles.bundles[0].get("GPU", 0)))))
        per_rank = int(bundles.bundles[1].get("GPU", 0)) if bundles.ranks else 0
        trainer = list(range(len(engine), len(engine) + bundles.ranks)) if per_rank else []
        return _GPUs(engine, trainer, set())
    placement = getattr(server, "placement", None)
    engine = list(getattr(placement, "engine_gpus", None) or range(replicas))
    trainer = list(getattr(placement, "trainer_gpus", None) or (range(setting.ranks) if setting else []))
    return _GPUs(engine, trainer, set(engine) & set(trainer))


def utilization_beside(resident: float, gpu_bytes: float) -> float:
    """The GPU share vLLM can take beside a trainer rank that holds `resident` bytes between steps: what is left,
    less 5% of the GPU as a margin for what the plan does not count, in steps of 0.05 (vLLM's own default, 0.9, at
    most)."""
    share = int(((gpu_bytes - resident) / gpu_bytes - 0.05) * 20) / 20
    return min(VLLM_OWN_GPU_UTILIZATION, max(0.05, share))


def _vllm_setting(server: Any, arch: Architecture, gpu_bytes: float,
                  beside: float | None) -> tuple[VLLMSetting, int]:  # fmt: skip
    """vLLM's settings as `marl serve` would start it on this server's GPUs, and the max_model_len it serves.
    `beside`: what the trainer rank on the same GPU holds between steps (None: vLLM has its GPUs to itself)."""
    v = server.vllm

    def get(setting: str, default: Any) -> Any:
        value = getattr(v, setting, None) if v is not None else None
        return default if value is None else value

    default_utilization = VLLM_OWN_GPU_UTILIZATION if beside is None else utilization_beside(beside, gpu_bytes)
    kv_gb = get("kv_cache_gb", None)
    setting = VLLMSetting(
        gpu_bytes=gpu_bytes, utilization=get("gpu_memory_utilization", default_utilization),
        kv_cache_bytes=kv_gb * GIB if kv_gb is not None else None, tensor_parallel=get("tensor_parallel_size", 1),
        weight_bytes=4 if get("dtype", "auto") in ("float32", "float") else 2,
        max_num_seqs=get("max_num_seqs", VLLMSetting.max_num_seqs),
        cuda_graphs="--enforce-eager" not in get("extra_args", []),
    )  # fmt: skip
    return setting, min(get("max_model_len", arch.context_length), arch.context_length)


def _plan_on_gpus(name: str, server: Any, arch: Architecture, gpu_bytes: float, spec: Any) -> ServerPlan:
    key = f"servers.{name}"
    placement = getattr(server, "placement", None)
    per_node = len(placement.trainer_gpus or []) if placement is not None else 0
    setting = trainer_setting(server, arch, on_gpu=True, ranks=per_node * placement.nodes if per_node else None)
    uses_vllm = server.engine == "vllm" or not server.is_local
    v = server.vllm
    replicas = (v.tensor_parallel_size * v.data_parallel_size) if v is not None else 1
    bundles = ray_bundles(server) if server.is_local and spec.run.ray is not None else None  # as marl run places it
    ranked = bundles if bundles is not None and bundles.ranks else None  # ranks in bundles of their own
    gpus = _gpus(server, setting, replicas, ranked)
    elsewhere = bundles is not None and bool(bundles.ranks or bundles.replicas)  # actors maybe on other machines
    way = _weights_way(server, uses_vllm, setting, gpus, ray=elsewhere)
    if setting is not None:  # its group's communicator (ranks > 1), and rank 0's to vLLM over nccl
        setting = replace(setting, nccl_communicators=int(setting.ranks > 1) + int(way == "nccl"))
    plan = ServerPlan(name, f"{arch.name} ({arch.parameter_count() / 1e9:.1f}B), "
                      + ("vLLM" if uses_vllm else "torch engine") + f" on GPUs {_ids(gpus.engine)}"
                      + (f", {setting.ranks} trainer ranks on GPUs {_ids(gpus.trainer)}" if setting else ""),
                      weights=way)  # fmt: skip
    resident, peak = trainer_rank(arch, setting) if setting is not None else (Parts(), Parts())
    if uses_vllm:
        beside = resident.total if gpus.shared and setting is not None else None
        vllm_setting, max_model_len = _vllm_setting(server, arch, gpu_bytes, beside)
        vllm_setting = replace(vllm_setting, weight_transfer_nccl=way == "nccl")
        if v is None or (v.gpu_memory_utilization is None and v.kv_cache_gb is None):
            plan.defaults["vllm.gpu_memory_utilization"] = vllm_setting.utilization
        engine, kv = engine_vllm(arch, vllm_setting)
        _check_kv(plan, key, arch, vllm_setting, kv, max_model_len)
        # auto: replicas in bundles of their own (Ray) share no GPU with the trainer and never sleep, nor the first
        replicas_apart = bundles is not None and bool(bundles.replicas)
        sleeps = setting is not None and bool(gpus.shared) and not replicas_apart \
            if v is None or v.sleep_between_steps == "auto" else bool(v.sleep_between_steps)
        sleeps = sleeps and not server.overlaps  # overlap: vLLM generates during the step
        engine_in_step = engine_vllm_asleep(engine) if sleeps else engine.total
    else:
        engine = _torch_engine(name, server, arch, spec, on_gpu=True)
        vllm_setting, sleeps, engine_in_step = None, False, engine.total
    saves = setting is not None and setting.sharded and bool(server.train.save_freq)
    for group in _alike(sorted(set(gpus.engine) | set(gpus.trainer)), gpus):
        load = _gpu_load(group, gpu_bytes, gpus, engine, engine_in_step, resident, peak, sleeps)
        if saves and group[0] in gpus.trainer:
            load.save = _save_load(load, arch, setting)
        plan.devices.append(load)
        engine_refused = any(p.key.startswith(f"{key}.vllm.") for p in plan.problems)
        plan.problems += _gpu_problems(key, load, group[0] in gpus.shared, vllm_setting, resident, gpu_bytes,
                                       check_rollouts=not engine_refused)
    weight_bytes = vllm_setting.weight_bytes if vllm_setting is not None else 2
    _disk(plan, server, arch, setting, weights_through_disk=way == "disk", weight_bytes=weight_bytes)
    if setting is not None:
        plan.notes.append(_trainer_note(arch, setting))
    if bundles is not None:
        plan.notes.append(bundles_note(bundles))
    _box(plan, key, server, arch, setting, gpus, sleeps=sleeps)
    return plan


def bundles_note(bundles: RayBundles) -> str:
    """The server's Ray placement group, as `marl run` asks Ray for it (marl/topology/bundles.py)."""
    more = ""
    for what, at, number, count, bundle in (("trainer rank", 1, 0, bundles.ranks, bundles.rank_bundle),
                                            ("vLLM replica", 1 + bundles.ranks, 1, bundles.replicas,
                                             bundles.replica_bundle)):  # fmt: skip
        if count:
            more += (f"; {_span('bundle', at, count)}: {_span(what, number, count)},{' each' * (count > 1)}"
                     f" {_resources(bundle)}")
    engine = "its engine" if not bundles.replicas else "vLLM's first replica"
    return (f"Ray placement group ({bundles.strategy}): bundle 0: the server and {engine},"
            f" {_resources(bundles.bundles[0])}{more}")


def _span(what: str, first: int, count: int) -> str:
    """`bundle 3`, or `bundles 3-5` (`count` of them from `first`)."""
    return f"{what} {first}" if count == 1 else f"{what}s {first}-{first + count - 1}"


def _resources(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{key}: {amount:g}" for key, amount in bundle.items()) + "}"


def _save_load(load: DeviceLoad, arch: Architecture, s: TrainerSetting) -> Parts:
    """A trainer GPU while a checkpoint is written: as at rollouts (vLLM is awake: the checkpoint follows the weight
    sync), plus the export's gather, one full tensor at a time in the compute dtype on every rank."""
    gather = largest_tensor(arch) * s.compute_bytes
    return Parts().extend(load.rollouts).add("export gather (one full tensor)", gather)


def _box(plan: ServerPlan, key: str, server: Any, arch: Architecture, setting: TrainerSetting | None, gpus: _GPUs,
         *, sleeps: bool) -> None:  # fmt: skip
    """The box's host memory (marl/plan/box.py), its line and its problem."""
    placement = getattr(server, "placement", None)
    v = server.vllm
    tp, dp = (v.tensor_parallel_size, v.data_parallel_size) if v is not None else (1, 1)
    uses_vllm = server.engine == "vllm" or not server.is_local
    ranks_here = len(gpus.trainer) if setting is not None else 0
    # each data-parallel replica is a vLLM of its own: its API server, its engine core, and tp workers when tp > 1
    engine_processes = dp * (2 + (tp if tp > 1 else 0)) if uses_vllm else 0
    processes = int(server.is_local or server.trainable) + ranks_here + engine_processes
    capacity = getattr(placement, "host_memory_gb", None)
    load = host_load(arch, processes=processes, asleep_weights=len(gpus.engine) * _weights(arch, v) if sleeps else 0,
                     ranks_here=ranks_here,
                     ranks=setting.ranks if setting is not None else 1,
                     export_bytes=setting.compute_bytes if setting is not None else 2,
                     checkpoints=bool(setting is not None and setting.sharded and server.train.save_freq),
                     capacity=capacity * GB if capacity else None)  # fmt: skip
    plan.host = load
    if (problem := load.problem(key)) is not None:
        plan.problems.append(problem)


def _weights(arch: Architecture, v: Any) -> float:
    """One vLLM GPU's share of the weights, as its sleep mode offloads them."""
    tp = v.tensor_parallel_size if v is not None else 1
    dtype = getattr(v, "dtype", None) if v is not None else None
    return arch.parameter_count() * (4 if dtype in ("float32", "float") else 2) / tp


def _trainer_note(arch: Architecture, s: TrainerSetting) -> str:
    """Both activation figures (the step counts the configured one) and what loading costs a rank."""
    on = activations(arch, s.micro_batch_tokens, s.compute_bytes, checkpointing=True) / GB
    off = activations(arch, s.micro_batch_tokens, s.compute_bytes, checkpointing=False) / GB
    largest = arch.vocab_size * arch.hidden_size * 4 / GB  # the embeddings, broadcast whole before being sharded
    loading = (f"loading, a rank holds its shards and one full tensor at a time (at most {largest:.1f} GB)"
               if s.sharded else "loading reads the whole model in fp32, as the step keeps it")
    return (f"trainer: a {s.micro_batch_tokens}-token micro-batch's activations {on:.1f} GB with gradient"
            f" checkpointing, {off:.1f} GB without; {loading}")


def _ids(gpus: list[int]) -> str:
    """0-7 for a run of GPUs, 0,2,5 otherwise."""
    if len(gpus) > 2 and gpus == list(range(gpus[0], gpus[-1] + 1)):
        return f"{gpus[0]}-{gpus[-1]}"
    return ",".join(map(str, gpus)) if gpus else "-"


def _weights_way(server: Any, uses_vllm: bool, setting: TrainerSetting | None, gpus: _GPUs, *,
                 ray: bool = False) -> str | None:  # fmt: skip
    """How the weights reach the engine after a step: vLLM's way (marl/plan/box.py), the torch engine's tensors in
    the process (one-process trainer) or a directory (FSDP ranks); None: nothing trains. Under Ray (`ray`) `auto`
    is the disk: the ranks, or vLLM's replicas after the first, are actors that may run on other machines
    (servers/engines/vllm_process.py)."""
    if setting is None:
        return None
    if not uses_vllm:
        return "disk" if setting.sharded else "in process"
    mode = getattr(server.vllm, "weight_sync", "auto") if server.vllm is not None else "auto"
    if ray and mode == "auto":
        return "disk"
    return weight_sync_way(mode, on_cpu=False, engine_gpus=gpus.engine, trainer_gpus=gpus.trainer)


def _alike(gpu_ids: list[int], gpus: _GPUs) -> list[list[int]]:
    """GPUs grouped by what they hold (engine, trainer, or both): one row and one check per group."""
    groups: dict[tuple[bool, bool], list[int]] = {}
    for gpu in gpu_ids:
        groups.setdefault((gpu in gpus.engine, gpu in gpus.trainer), []).append(gpu)
    return list(groups.values())


def _gpu_load(group: list[int], gpu_bytes: float, gpus: _GPUs, engine: Parts, engine_in_step: float,
              resident: Parts, peak: Parts, sleeps: bool) -> DeviceLoad:  # fmt: skip
    rollouts, step, gpu = Parts(), None, group[0]
    if gpu in gpus.engine:
        rollouts.extend(engine, prefix="engine: ")
    if gpu in gpus.trainer:
        rollouts.extend(resident, prefix="trainer between steps: ")
        step = Parts().extend(peak, prefix="trainer step: ")
        if gpu in gpus.engine:
            step.add("engine asleep" if sleeps else "engine (awake)", engine_in_step)
    return DeviceLoad(("GPU " if len(group) == 1 else "GPUs ") + _ids(group), gpu_bytes, rollouts, step)


def _gpu_problems(key: str, load: DeviceLoad, shared: bool, vllm: VLLMSetting | None, resident: Parts,
                  gpu_bytes: float, *, check_rollouts: bool) -> list[Problem]:  # fmt: skip
    gb = gpu_bytes / GB
    if vllm is not None and shared and vllm.utilization * gpu_bytes + resident.total > gpu_bytes:
        most = max(0.0, (gpu_bytes - resident.total) / gpu_bytes)
        return [Problem(f"{key}.vllm.gpu_memory_utilization", f"{load.device}: vLLM starts only when"
                        f" {vllm.utilization:.2f} x {gb:.0f} GB is free, but the trainer rank there holds"
                        f" {resident.total / GB:.1f} GB between steps: set it to at most {most - 0.005:.2f}, or give"
                        " the trainer other GPUs (placement.trainer_gpus)")]  # fmt: skip
    problems = []
    if load.step is not None and load.step.total > gpu_bytes:
        what, most = max(load.step.items, key=lambda item: item[1])
        problems.append(Problem(f"{key}.train", f"{load.device}: a training step needs {load.step.total / GB:.1f} GB"
                                f" of {gb:.0f} GB (most: {what}, {most / GB:.1f} GB): lower micro_batch_tokens, turn"
                                " on gradient_checkpointing, or shard over more GPUs (fsdp ranks,"
                                " placement.trainer_gpus)"))  # fmt: skip
    if check_rollouts and load.save is not None and load.rollouts.total <= gpu_bytes < load.save.total:
        problems.append(Problem(f"{key}.vllm.gpu_memory_utilization" if shared else f"{key}.train.save_freq",
                                f"{load.device}: writing a checkpoint needs {load.save.total / GB:.1f} GB of {gb:.0f}"
                                " GB (vLLM awake, and the export's gather of one full tensor): leave vLLM less of"
                                " the GPU, or save less often"))  # fmt: skip
    if check_rollouts and load.rollouts.total > gpu_bytes:
        problems.append(Problem(f"{key}.placement", f"{load.device}: holds {load.rollouts.total / GB:.1f} GB during"
                                f" rollouts, more than its {gb:.0f} GB: give the engine and the trainer separate"
                                " GPUs, or lower vllm.gpu_memory_utilization"))  # fmt: skip
    return problems


def _check_kv(plan: ServerPlan, key: str, arch: Architecture, s: VLLMSetting, kv: float, max_model_len: int) -> None:
    per_token = arch.kv_bytes_per_token(s.weight_bytes, s.tensor_parallel)
    one_sequence = max_model_len * per_token
    if kv <= 0 and s.kv_cache_bytes is None:
        rest = s.utilization * s.gpu_bytes - kv
        plan.problems.append(Problem(f"{key}.vllm.tensor_parallel_size", f"the weights, activations and CUDA graphs"
                                     f" of one GPU's share of the model take {rest / GB:.1f} GB, more than vLLM's"
                                     f" {_setting_text(s)[2:]}: split the model over more GPUs (tensor_parallel_size"
                                     " and placement.engine_gpus), or raise vllm.gpu_memory_utilization"))
        return
    if kv < one_sequence:
        fits = int(max(kv, 0) // per_token)
        where = "kv_cache_gb" if s.kv_cache_bytes is not None else "gpu_memory_utilization"
        plan.problems.append(Problem(f"{key}.vllm.max_model_len", f"one {max_model_len}-token sequence needs"
                                     f" {one_sequence / GB:.2f} GB of KV cache per GPU, but vLLM has"
                                     f" {max(kv, 0) / GB:.2f} GB for it (vllm.{where} {_setting_text(s)}):"
                                     f" set max_model_len to at most {fits}, raise vllm.{where}, or split the model"
                                     " over more GPUs (vllm.tensor_parallel_size)"))  # fmt: skip
        return
    plan.notes.append(f"KV cache {kv / GB:.1f} GB per GPU: {kv / per_token / 1000:.0f}k tokens,"
                      f" {kv / one_sequence:.0f} sequences of the full {max_model_len} tokens")


def _setting_text(s: VLLMSetting) -> str:
    if s.kv_cache_bytes is not None:
        return f"= {s.kv_cache_bytes / GIB:.1f} GiB"
    return f"= {s.utilization:.2f} of {s.gpu_bytes / GB:.0f} GB"
