"""One rank of the FSDP2 trainer: its process's main loop and its shard of the policy.

A rank is a process spawned by `servers.trainers.fsdp_ranks.RankGroup`, or a Ray actor in the server's placement group
(servers.trainers.ray_ranks, possibly on another machine). Where it runs is a `RankPlace`, torchrun's variables (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), which it exports before anything touches CUDA,
together with its node's trainer GPUs as CUDA_VISIBLE_DEVICES (all of them: NCCL sees its peers on the node; LOCAL_RANK
picks the rank's own, `cuda:LOCAL_RANK`). It joins the torch.distributed group (gloo on CPU, nccl on one GPU per rank),
builds its shard of the policy without ever holding the whole model (servers.trainers.fsdp_model: meta device,
`fully_shard` with the mixed-precision policy, rank 0's weights broadcast), and then serves commands from the server
over its pipe: ("train", plan, S, config, start_version), ("export", dir), ("save", dir, ...), ("load", dir). Each
answer is ("ok", result) or ("error", traceback); rank 0 also sends ("progress", done, total) after every micro-batch. A
group of LoRA policies (`RankSpec.lora`) runs the class its spec names instead (`RankSpec.shard_class`:
`servers.trainers.fsdp_lora_rank.ShardedLoraPolicies`, which builds on this module): the same passes (`train_passes`)
over one policy's adapter at a time, its own commands.

The GRPO math is the one-process trainer's (`servers.trainers.grpo.micro_batch_loss`); what is sharded-specific:

- **The sum, not the mean, over ranks.** Every rank divides its micro-batches' losses by S, the number of samples
  of the *whole* step, and the gradient reduction sums the ranks' gradients (divide factor 1) instead of averaging
  them: the result is dL/dtheta of the one-process trainer, whatever the split.
- **As many micro-batches on every rank.** Each forward and backward is a collective (parameter all-gather,
  gradient reduce-scatter), so a rank with fewer micro-batches than its peers runs padding passes whose loss is
  multiplied by 0 (their gradient is 0 and their metrics are dropped).
- **A reduction per micro-batch.** Every backward reduce-scatters its gradients (in fp32) into this rank's shard
  of `.grad`, where the pass's micro-batches add up. Turning the sync off until the last micro-batch would save
  collectives but keep a full unsharded gradient on every rank (+30 GB per rank for a 7B in fp32).
"""

from __future__ import annotations

import logging
import math
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from marl.protocol import FSDPConfig, GRPOConfig, LoraSpec
from servers.engines.weight_transfer import TransferTarget, WeightPusher
from servers.episodes.samples import Sample
from servers.trainers.device_memory import free_cached_memory
from servers.trainers.fsdp_model import build_sharded_model, compute_dtype
from servers.trainers.fsdp_push import push_sharded
from servers.trainers.fsdp_state import load_checkpoint, save_checkpoint, write_hf_weights
from servers.trainers.grpo import StartLogprobs, apply_optimizer_hparams, micro_batch_loss, recomputes
from servers.trainers.micro_batches import MicroBatch, collate
from servers.trainers.policy_model import resolve_dtype, set_gradient_checkpointing
from servers.trainers.step_metrics import add_pass_stats

__all__ = ["PassResult", "RankPlace", "RankPlan", "RankSpec", "ShardedPolicy", "accumulate", "new_optimizer",
           "rank_device", "run_rank", "train_passes"]

log = logging.getLogger(__name__)

#: One rank's micro-batches of a step, each a list of (sample, advantage); None is a padding pass.
RankPlan = list[list[tuple[Sample, float]] | None]
#: Rank 0's progress report: (done, total) micro-batch passes of the step.
Progress = Callable[[int, int], None]
#: What one pass on one rank returns: its metric sums, the global gradient norm, whether the optimizer stepped.
PassResult = tuple[dict[str, float], float, bool]

#: A padding pass trains on this (two tokens, the second "trained", advantage 0), with its loss multiplied by 0.
_PADDING = [(Sample(episode_id="padding", agent="padding", token_ids=[0, 0], loss_mask=[0, 1], logprobs=[0.0, 0.0],
                    reward=0.0, policy_version=0, num_calls=1), 0.0)]  # fmt: skip


class RankPipe(Protocol):
    """A rank's end of its pipe to the server: a multiprocessing Pipe's end (a local rank), or the queues of its Ray
    actor (servers.trainers.ray_ranks)."""

    def send(self, message: Any) -> None: ...

    def recv(self) -> Any: ...


@dataclass(frozen=True)
class RankSpec:
    """What every rank of a group is started with (plain data: it crosses the process boundary)."""

    model_dir: str
    config: FSDPConfig  # the trainer's section, as at start (the KL reference exists iff kl_coef > 0 then)
    world_size: int
    device_type: str  # "cpu" (gloo) or "cuda" (nccl, GPU `LOCAL_RANK` of the node's trainer GPUs)
    dtype: str | None = None  # the sharded parameters' (master weights'), fp32 by default
    threads: int | None = None  # torch intra-op threads per rank (CPU)
    timeout_s: float = 600.0  # a collective that waits longer fails (a peer that hangs)
    #: LoRA policies {name: (LoraSpec, GRPOConfig)} on a frozen base instead of one full-weight policy
    #: (servers.trainers.fsdp_lora_rank), their adapters and RNG streams seeded by (`seed`, name).
    lora: dict[str, tuple[LoraSpec, GRPOConfig]] | None = None
    seed: int = 0
    #: The class each rank runs (None: `ShardedPolicy`); a group of LoRA policies names its own
    #: (`FSDPLoraTrainer`: servers.trainers.fsdp_lora_rank.ShardedLoraPolicies). A class crosses by its import path.
    shard_class: type | None = None

    def __post_init__(self) -> None:
        if self.lora is not None and self.shard_class is None:
            raise ValueError("a RankSpec with LoRA policies needs their shard_class (ShardedLoraPolicies)")


#: torchrun's names for where a rank runs; each rank exports them (with CUDA_VISIBLE_DEVICES and its allocator's
#: settings) and reports them.
PLACE_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF")
#: A rank's CUDA allocator unless the user set one. Measured on an H200 (bench/gpu_check.py --shape 3b): without
#: it the FSDP rank's cached blocks that no later tensor fits took 4.6 GB (7%) over the memory plan; with it the
#: rank's peak is within 2% of the plan. Ranks only: vLLM's sleep mode refuses expandable segments.
RANK_ALLOCATOR = "expandable_segments:True"


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs, in torchrun's terms. MASTER_ADDR:MASTER_PORT is the group's rendezvous (a TCPStore that
    the server hosts); `cuda_visible_devices`: the node's trainer GPUs (None: the parent's, as without placement)."""

    rank: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    cuda_visible_devices: str | None = None

    def environment(self, world_size: int) -> dict[str, str]:
        env = {"RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank), "WORLD_SIZE": str(world_size),
               "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
               "MASTER_PORT": str(self.master_port)}
        if self.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.cuda_visible_devices
        env["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", RANK_ALLOCATOR)
        return env


def enter_place(place: RankPlace, world_size: int) -> None:
    """Export the rank's place. CUDA reads CUDA_VISIBLE_DEVICES once, when it initialises: this must come first."""
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised before this rank's CUDA_VISIBLE_DEVICES was set")
    os.environ.update(place.environment(world_size))


def run_rank(place: RankPlace, spec: RankSpec, conn: RankPipe) -> None:
    """The process of one rank: join the group, shard the policy, answer commands until told to close."""
    try:
        enter_place(place, spec.world_size)
        if spec.threads:
            torch.set_num_threads(spec.threads)
        store = dist.TCPStore(place.master_addr, place.master_port, is_master=False,
                              timeout=timedelta(seconds=spec.timeout_s))  # fmt: skip
        # NCCL bound to this rank's GPU from the start (else its barrier guesses the GPU from the global rank)
        device_id = torch.device("cuda", place.local_rank) if spec.device_type == "cuda" else None
        if device_id is not None:
            torch.cuda.set_device(device_id)
        dist.init_process_group("nccl" if spec.device_type == "cuda" else "gloo", store=store, rank=place.rank,
                                world_size=spec.world_size, timeout=timedelta(seconds=spec.timeout_s),
                                device_id=device_id)  # fmt: skip
        report = (lambda done, total: conn.send(("progress", done, total))) if place.rank == 0 else None
        shard_class = spec.shard_class or ShardedPolicy
        policy = shard_class(place.rank, spec, report, local_rank=place.local_rank)
        conn.send(("ok", {"vocab_size": policy.vocab_size, "device": str(policy.device),
                          "env": {key: os.environ.get(key) for key in PLACE_ENV}}))
        if _serve(policy, conn):
            dist.barrier()  # all ranks closed: none tears its connections down under a peer's last collective
    except Exception:  # the server reads the traceback; the group is torn down by then
        _send_quietly(conn, ("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(policy: ShardedPolicy, conn: RankPipe) -> bool:
    """Answer commands until "close" (True) or the server is gone (False). After each one the rank empties its
    allocator's cache before it answers, so the memory a step or a gather peaked at is free before the server wakes an
    engine on this GPU (servers.trainers.device_memory); "memory" answers the last command's reading (before and after
    the release)."""
    commands = policy.commands()
    released = free_cached_memory(policy.device)
    while True:
        try:
            command, args = conn.recv()
        except EOFError:  # the server is gone
            return False
        if command == "close":
            return True
        if command == "memory":
            conn.send(("ok", released))
            continue
        result = commands[command](*args)
        released = free_cached_memory(policy.device)
        conn.send(("ok", result))


def _send_quietly(conn: RankPipe, message: tuple) -> None:
    try:
        conn.send(message)
    except OSError:
        pass  # the server is gone already


def rank_device(device_type: str, local_rank: int) -> torch.device:
    """The rank's device: GPU `local_rank` of its node's trainer GPUs (made current), or the CPU."""
    if device_type != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def new_optimizer(params: list[torch.nn.Parameter], config: GRPOConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=config.learning_rate, betas=tuple(config.adam_betas),
                             weight_decay=config.weight_decay)  # fmt: skip


def train_passes(model: torch.nn.Module, ref: Any, optimizer: torch.optim.Optimizer, plan: RankPlan,
                 num_samples: int, config: GRPOConfig, *, report: Progress | None,
                 start_version: int | None = None) -> list[PassResult]:  # fmt: skip
    """`ppo_epochs` passes over this rank's micro-batches; each pass ends in one (sharded) AdamW step of the
    parameters `optimizer` holds (all of `model`'s, or one LoRA policy's)."""
    apply_optimizer_hparams(optimizer, config)
    set_gradient_checkpointing(model, config.gradient_checkpointing)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    passes: list[PassResult] = []
    # pi_start's logprobs, from the first pass or recomputed before it (grpo.py, step 2)
    starts = StartLogprobs(config.ppo_epochs, recompute=recomputes(config))
    for epoch in range(config.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        stats = accumulate(model, ref, plan, num_samples, config, report=report, done=epoch * len(plan),
                           total=config.ppo_epochs * len(plan), starts=starts,
                           start_version=start_version)  # fmt: skip
        norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)  # over all ranks' shards
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        finite = math.isfinite(grad_norm)  # the same on every rank: all step, or none
        if finite:
            optimizer.step()
        elif dist.get_rank() == 0:
            log.warning("non-finite gradient norm in epoch %d: update skipped", epoch)
        optimizer.zero_grad(set_to_none=True)
        passes.append((stats, grad_norm, finite))
    return passes


def accumulate(model: torch.nn.Module, ref: Any, plan: RankPlan, num_samples: int, config: GRPOConfig, *,
               report: Progress | None, done: int, total: int, starts: StartLogprobs | None = None,
               start_version: int | None = None) -> dict[str, float]:  # fmt: skip
    """Forward + backward of this rank's share of L; every backward adds its gradients, summed over ranks, to this
    rank's shard of `.grad`. Recomputing pi_start's logprobs, the first pass runs a no-grad forward over the plan
    first: as many on every rank (padding passes included), as each forward is a collective."""
    embeddings = model.get_input_embeddings()
    starts = starts or StartLogprobs(1)

    def collated(items: list[tuple[Sample, float]] | None) -> MicroBatch:
        return collate(items or _PADDING, embeddings.weight.device, embeddings.num_embeddings, start_version)

    stats = starts.recompute(model, map(collated, plan))  # its metrics kept even on a rank of padding passes only
    for index, items in enumerate(plan):
        mb = collated(items)
        loss, mb_stats, start = micro_batch_loss(model, ref, mb, config, num_samples, start_logp=starts.get(index))
        starts.keep(index, start)
        if items is None:
            loss = loss * 0.0  # a padding pass: the collectives run, the gradient is 0
        else:
            add_pass_stats(stats, mb_stats)
        loss.backward()
        if report is not None:
            report(done + index + 1, total)
    return stats


class ShardedPolicy:
    """This rank's shard of the policy (and of the frozen KL reference), its optimizer, and the passes of a step."""

    def __init__(self, rank: int, spec: RankSpec, report: Callable[[int, int], None] | None, *,
                 local_rank: int | None = None) -> None:  # fmt: skip
        self.rank = rank
        self.spec = spec
        self._report = report
        self.device = rank_device(spec.device_type, rank if local_rank is None else local_rank)
        mesh = init_device_mesh(spec.device_type, (spec.world_size,))
        dtype, model_dir = resolve_dtype(spec.dtype), Path(spec.model_dir)
        #: What the forward runs in, and what exports hold: the engine serves the weights the trainer computes with.
        self.compute_dtype = compute_dtype(spec.config.mixed_precision, spec.device_type, dtype)
        self.policy, self.aliases = build_sharded_model(model_dir, mesh, self.device, dtype=dtype,
                                                        compute=self.compute_dtype)  # fmt: skip
        self.ref: torch.nn.Module | None = None
        if spec.config.kl_coef > 0:  # frozen: stored in the compute dtype, which is all it is ever used in
            self.ref = build_sharded_model(model_dir, mesh, self.device, dtype=self.compute_dtype,
                                           compute=self.compute_dtype)[0].requires_grad_(False)  # fmt: skip
        self.vocab_size = self.policy.get_input_embeddings().num_embeddings
        self.optimizer = self._new_optimizer(spec.config)
        # Checkpoint shards are written on a thread: its collectives need a group of their own (gloo: CPU state).
        self.checkpoint_group = dist.new_group(backend="gloo")
        self._pusher = WeightPusher(self.device)  # every rank: for ipc, each on a vLLM worker's GPU shares its copy

    def commands(self) -> dict[str, Callable[..., Any]]:
        """What the server may send this rank, by name."""
        return {"train": self.train, "export": self.export, "save": self.save, "load": self.load, "push": self.push}

    def _new_optimizer(self, config: GRPOConfig) -> torch.optim.Optimizer:
        return new_optimizer([p for p in self.policy.parameters() if p.requires_grad], config)

    def train(self, plan: RankPlan, num_samples: int, config: GRPOConfig,
              start_version: int | None = None) -> list[PassResult]:  # fmt: skip
        return train_passes(self.policy, self.ref, self.optimizer, plan, num_samples, config, report=self._report,
                            start_version=start_version)  # fmt: skip

    def _accumulate(self, plan: RankPlan, num_samples: int, config: GRPOConfig, *, done: int,
                    total: int) -> dict[str, float]:  # fmt: skip
        return accumulate(self.policy, self.ref, plan, num_samples, config, report=self._report, done=done, total=total)

    def push(self, target: TransferTarget) -> str | None:
        """The policy into vLLM's weight-transfer engine, every replica of it (servers.trainers.fsdp_push); why it
        failed (the same on every rank), or None."""
        return push_sharded(self.policy, self.aliases, self.compute_dtype, target, self._pusher)

    def export(self, directory: str) -> None:
        write_hf_weights(self.policy, self.aliases, Path(directory), self.compute_dtype)

    def save(self, directory: str, step_count: int, config: GRPOConfig, server_rng: dict[str, Any]) -> None:
        save_checkpoint(self.policy, self.optimizer, self.aliases, Path(directory), export_dtype=self.compute_dtype,
                        group=self.checkpoint_group, step_count=step_count, config=config,
                        model_dir=Path(self.spec.model_dir), server_rng=server_rng)  # fmt: skip

    def load(self, directory: str, config: GRPOConfig) -> dict[str, Any] | None:
        self.optimizer = self._new_optimizer(config)  # the checkpoint's state, or none if it never stepped
        return load_checkpoint(self.policy, self.optimizer, Path(directory))

