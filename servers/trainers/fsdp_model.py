"""One rank's shard of a policy too large for one device: built on the meta device, sharded, filled from rank 0.

No rank ever holds the whole model on its device (a 14B in fp32 is 59 GB):

1. every rank builds the model from its config on the `meta` device (shapes, no memory);
2. shards it with FSDP2: `fully_shard` on every decoder layer, then the root (embeddings, final norm, head), with
   the mixed-precision policy;
3. allocates only its own shards on its device (`to_empty`);
4. rank 0 alone reads the weights from disk, on the CPU and in the files' dtype, and broadcasts them one tensor at a
   time into every rank's shards (`set_model_state_dict(..., broadcast_from_rank0=True)`, which casts into the
   shards' dtype). Buffers that are no part of a state dict (rotary `inv_freq`, computed when the model is built,
   which the meta device leaves empty) are broadcast from rank 0's copy too.

Tied weights (SmolLM2's `lm_head` is its `embed_tokens`) stay one parameter: the model ties them on the meta device
and FSDP2 shards a shared parameter once.

**Mixed precision** (`fsdp.mixed_precision`): `bf16` gathers the parameters in bf16 for the forward and backward and
reduce-scatters the gradients in fp32, while the sharded parameters, their gradients and AdamW's state stay in the
parameters' own dtype (fp32: the master weights). `fp32` computes in the parameters' dtype. `auto` is bf16 on CUDA
and fp32 on the CPU, where bf16 matmuls are slow without bf16 units and the tests hold the sharded trainer to the
one-process fp32 trainer. On a CPU with bf16 units (AMX) `bf16` on one rank halved the Kuhn runs' step
(docs/results.md, measured with bench/run_report.py; bench/fsdp_step.py alone: 0.68x).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

__all__ = ["broadcast_weights", "build_sharded_model", "compute_dtype", "tied_aliases"]

#: Changes a model in place before it is sharded (and rank 0's full copy before the broadcast).
Adapt = Callable[[torch.nn.Module], object]
#: Rank 0 holds the full state (on its CPU); every rank takes its shards from the broadcast.
_BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def compute_dtype(mixed_precision: str, device_type: str, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype the forward and backward run in: bf16 under `bf16` (and `auto` on CUDA), else the parameters'."""
    if mixed_precision == "auto":
        mixed_precision = "bf16" if device_type == "cuda" else "fp32"
    return torch.bfloat16 if mixed_precision == "bf16" else param_dtype


def build_sharded_model(model_dir: Path, mesh: DeviceMesh, device: torch.device, *, dtype: torch.dtype,
                        compute: torch.dtype, adapt: Adapt | None = None,
                        ) -> tuple[torch.nn.Module, dict[str, str]]:  # fmt: skip
    """This rank's shard of the model in `model_dir`: parameters stored in `dtype`, computed in `compute`; and its
    tied aliases (`tied_aliases`). In eval mode (dropout off), like every policy (servers.trainers.policy_model).

    `adapt` changes the model in place before it is sharded (LoRA layers injected: servers.trainers.fsdp_lora_rank),
    and rank 0's full copy before the broadcast, so both have the same parameters."""
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if adapt is not None:
            adapt(model)
    model.eval()
    aliases = tied_aliases(model)
    mixed = compute != dtype
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    _shard(model, mesh, policy)
    model.to_empty(device=device)
    broadcast_weights(model, model_dir, adapt)
    return model, aliases


def _shard(model: torch.nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> None:
    """FSDP2 on every decoder layer, then the root; gradients summed over ranks, not averaged."""
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # each rank's loss is already its share of L (divided by S)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum


def broadcast_weights(model: torch.nn.Module, directory: Path, adapt: Adapt | None = None) -> None:
    """Every rank's shards of `model` from the Hugging Face model in `directory`, which rank 0 alone reads (and
    `adapt`s, as `model` was)."""
    source = AutoModelForCausalLM.from_pretrained(directory, dtype="auto") if dist.get_rank() == 0 else None
    if source is not None and adapt is not None:
        adapt(source)
    set_model_state_dict(model, source.state_dict() if source is not None else {}, options=_BROADCAST)
    in_state_dict = set(model.state_dict())
    for name, buffer in model.named_buffers():
        if name not in in_state_dict:  # computed at construction: rank 0's copy is the full load's
            if source is not None:
                buffer.copy_(source.get_buffer(name))
            dist.broadcast(buffer, src=0)


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: name} of parameters that are one tensor (e.g. lm_head.weight tied to the input embeddings); taken
    before sharding, because a state dict holds each alias as a key of its own."""
    first_name: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical = first_name.setdefault(id(param), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases
