"""One rank of the FSDP LoRA trainer (servers.trainers.fsdp_lora): the frozen base sharded with every policy's adapter.

Built like the full trainer's shard (servers.trainers.fsdp_model: meta device, `fully_shard` per decoder layer, rank
0's weights broadcast), with peft's LoRA layers injected before sharding, so each adapter is sharded with its layer.
Rank 0 injects them into its full copy too, each policy's from its own RNG stream (`add_adapters`, as the one-process
`LoraGRPOTrainer`): the broadcast gives every rank the adapters that trainer starts from.

The base is frozen (requires_grad False, no optimizer state); each policy has an AdamW over its adapter's shards.
A step of policy P activates P's adapter alone (peft's `set_adapter` flags its parameters trainable; FSDP2 copies
the flag onto the gathered parameters at every all-gather), and runs the full trainer's passes
(`fsdp_worker.train_passes`) with the KL reference the same model with the adapters off (`AdapterOff`).

Adapters leave gathered: every rank calls `full_tensor` on the policy's shards (in one order), rank 0 keeps them in
PEFT's names. A checkpoint is `adapter/` (PEFT's format, fp32 master weights), and `trainer_state.pt` with the
policy's optimizer state gathered by rank 0 and keyed by position, like the one-process trainer's, plus every rank's
RNG stream of the policy.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from marl.protocol import GRPOConfig
from servers.trainers.fsdp_model import build_sharded_model, compute_dtype
from servers.trainers.fsdp_state import by_name, by_position
from servers.trainers.fsdp_worker import (
    PassResult,
    Progress,
    RankPlan,
    RankSpec,
    new_optimizer,
    rank_device,
    train_passes,
)
from servers.trainers.lora_grpo import (
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    AdapterOff,
    adapter_parameters,
    add_adapters,
    peft_key,
    rng_stream,
    training_adapter,
)
from servers.trainers.policy_model import resolve_dtype
from servers.trainers.trainer_state import read_trainer_state, write_trainer_state

__all__ = ["ShardedLoraPolicies"]

#: Rank 0 gathers a full optimizer state (to the CPU), and gives every rank its shards back from one.
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


class ShardedLoraPolicies:
    """This rank's shard of the frozen base and of every policy's adapter, each policy's optimizer and RNG stream."""

    def __init__(self, rank: int, spec: RankSpec, report: Progress | None, *, local_rank: int | None = None) -> None:
        self.rank, self.spec, self._report = rank, spec, report
        self.device = rank_device(spec.device_type, rank if local_rank is None else local_rank)
        self.specs = {name: lora for name, (lora, _) in spec.lora.items()}
        self.peft_model: Any = None

        def adapt(model: torch.nn.Module) -> None:  # the sharded model first (kept), then rank 0's full copy
            peft_model, rngs = add_adapters(model, self.specs, spec.seed)
            if self.peft_model is None:
                self.peft_model, self.rngs = peft_model, rngs

        dtype = resolve_dtype(spec.dtype)
        self.compute_dtype = compute_dtype(spec.config.mixed_precision, spec.device_type, dtype)
        mesh = init_device_mesh(spec.device_type, (spec.world_size,))
        self.model, _ = build_sharded_model(Path(spec.model_dir), mesh, self.device, dtype=dtype,
                                            compute=self.compute_dtype, adapt=adapt)  # fmt: skip
        self.model.requires_grad_(False)  # base and adapters; a step's set_adapter flags its own adapter trainable
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.reference = AdapterOff(self.peft_model)
        self.optimizers = {name: self._new_optimizer(name, config) for name, (_, config) in spec.lora.items()}

    def commands(self) -> dict[str, Callable[..., Any]]:
        return {"train": self.train, "adapter": self.adapter, "export": self.export, "save": self.save,
                "load": self.load}  # fmt: skip

    def _new_optimizer(self, policy: str, config: GRPOConfig) -> torch.optim.Optimizer:
        return new_optimizer(adapter_parameters(self.model, policy), config)

    def _names(self, policy: str) -> list[str]:
        """The model's names of `policy`'s adapter parameters, in its optimizer's order."""
        return [name for name, _ in self.model.named_parameters() if peft_key(name, policy) is not None]

    def train(self, policy: str, plan: RankPlan, num_samples: int, config: GRPOConfig,
              start_version: int | None = None) -> list[PassResult]:  # fmt: skip
        """`policy`'s passes of a step, on its RNG stream, its adapter alone active."""
        ref = self.reference if config.kl_coef > 0 else None
        with rng_stream(self.rngs[policy]), training_adapter(self.peft_model, policy):
            return train_passes(self.model, ref, self.optimizers[policy], plan, num_samples, config,
                                report=self._report, start_version=start_version)  # fmt: skip

    def adapter(self, policy: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        """`policy`'s adapter gathered, in PEFT's names, on the CPU in `dtype` (None: the master weights'): rank 0's
        answer; None on the other ranks. A collective: every rank gathers every shard."""
        tensors = {}
        for name, param in self.model.named_parameters():
            key = peft_key(name, policy)
            if key is not None:
                full = param.full_tensor() if isinstance(param, DTensor) else param
                tensors[key] = full.detach().to("cpu", dtype or full.dtype, copy=True)
        return tensors if self.rank == 0 else None

    def export(self, policy: str, directory: str) -> None:
        """`policy`'s adapter (master weights) as PEFT writes it: adapter_config.json + adapter_model.safetensors."""
        tensors = self.adapter(policy)
        if self.rank != 0:
            return
        config = copy.deepcopy(self.peft_model.peft_config[policy])
        config.inference_mode = True  # as peft's save_pretrained writes it
        config.save_pretrained(directory)
        save_file(tensors, Path(directory) / ADAPTER_WEIGHTS, metadata={"format": "pt"})

    def save(self, policy: str, directory: str, step_count: int, config: GRPOConfig) -> None:
        """`directory/adapter/` and `directory/trainer_state.pt` (optimizer by position, step, every rank's RNG)."""
        self.export(policy, str(Path(directory) / ADAPTER_DIR))
        optimizer = self.optimizers[policy]
        # An optimizer that never stepped is not saved: reading its state would initialise it (a zero-lr step).
        full = get_optimizer_state_dict(self.model, optimizer, options=_GATHER) if optimizer.state else None
        rank_rngs = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(self.rngs[policy], rank_rngs, dst=0)
        if self.rank == 0:
            write_trainer_state(Path(directory), step_count=step_count, config=config, model_dir=self.spec.model_dir,
                                optimizer=full and by_position(full, self._names(policy)), rng=rank_rngs[0],
                                rank_rngs=rank_rngs, policy=policy,
                                lora=self.specs[policy].model_dump(mode="json"))  # fmt: skip

    def load(self, policy: str, directory: str, config: GRPOConfig) -> int | None:
        """Restore what `save` (or `LoraGRPOTrainer.save`, of this policy or another of its shape) wrote; the step
        count on rank 0, None elsewhere."""
        directory_path = Path(directory)
        self._load_adapter(policy, directory_path / ADAPTER_DIR / ADAPTER_WEIGHTS)
        state = read_trainer_state(directory_path) if self.rank == 0 else None
        shared = [state and state["step_count"], bool(state and state["optimizer"] and state["optimizer"]["state"]),
                  state and (state.get("rank_rngs") or [state["rng"]])]  # fmt: skip
        dist.broadcast_object_list(shared, src=0)
        step_count, has_optimizer, rank_rngs = shared
        self.optimizers[policy] = self._new_optimizer(policy, config)
        if has_optimizer:  # with its adapter trainable: torch creates the state to fill for trainable parameters only
            full = by_name(state["optimizer"], self._names(policy)) if self.rank == 0 else {}
            with training_adapter(self.peft_model, policy):
                set_optimizer_state_dict(self.model, self.optimizers[policy], full, options=_BROADCAST)
        # as many ranks wrote it: each takes its own stream back; else (another world size) one of them
        self.rngs[policy] = dict(rank_rngs[self.rank % len(rank_rngs)])
        return int(step_count) if self.rank == 0 else None

    @torch.no_grad()
    def _load_adapter(self, policy: str, weights: Path) -> None:
        """Every rank reads the (small) adapter file and copies its own shards out of it: no collective."""
        tensors = load_file(weights)
        for name, param in self.model.named_parameters():
            key = peft_key(name, policy)
            if key is None:
                continue
            full = tensors[key].to(self.device, param.dtype)
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.copy_(full)
