"""A sharded policy's state in and out of files: checkpoints as every rank's shards, and Hugging Face exports.

Every function here is a collective: all ranks of the group call it together. A checkpoint directory holds:

    sharded/                  `torch.distributed.checkpoint`: each rank writes its own shards of the parameters
                              (fp32, the master weights) and of AdamW's state (by parameter name); read back at
                              any number of ranks, or by the one-process trainer (`load_sharded_state`)
    model.safetensors, config.json, ...
                              the policy gathered by rank 0 in its compute dtype (bf16 under bf16 mixed precision):
                              a Hugging Face model, the kind of directory the engine loads
    trainer_state.pt          step, the server's and every rank's RNG, the config (no optimizer: it is sharded)
    tokenizer files           (copied by servers.trainers.fsdp)

Why an export in every checkpoint: a checkpoint is what `marl eval` and `past_of` pools serve, on a static
`marl serve --model <checkpoint dir>` (marl/league/snapshots.py), long after the ranks that wrote it are gone, so it
must be a Hugging Face directory by itself. It costs one gather of the weights in the compute dtype (half of fp32's),
written by rank 0 while the other ranks' shard writes run.

The shards are written with `dcp.async_save` on a thread of each rank, over a gloo group of their own (two threads
must never share a group's collectives), while rank 0 gathers and writes the export; `save_checkpoint` returns when
both are on disk, because the server renames the directory into place as soon as `save` returns
(servers.training.checkpoint_dirs: a checkpoint appears complete or not at all).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from marl.protocol import GRPOConfig
from servers.trainers.fsdp_model import broadcast_weights
from servers.trainers.trainer_state import (
    SHARDED_DIR,
    load_sharded_state,
    read_trainer_state,
    restore_rng_states,
    rng_states,
    write_trainer_state,
)

__all__ = ["by_name", "by_position", "full_weights", "iter_full_weights", "load_checkpoint", "save_checkpoint",
           "write_hf_weights"]

#: Rank 0 reads a full optimizer state (a one-process trainer's checkpoint) and the group takes its shards from it.
_BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def iter_full_weights(model: torch.nn.Module, aliases: dict[str, str],
                      dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor on this rank's device) for each tensor of the state dict in turn, tied aliases left out,
    on every rank: each step is a collective (the gather), so every rank runs the whole iteration. Cast to `dtype`
    while still sharded, so the gather moves `dtype`'s bytes."""
    for name, tensor in model.state_dict().items():
        if name in aliases:
            continue
        tensor = tensor.detach()
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield name, tensor


def full_weights(model: torch.nn.Module, aliases: dict[str, str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The full state dict on rank 0's CPU (empty elsewhere), gathered one tensor at a time and in `dtype`; tied
    aliases point at their tensor's one copy."""
    rank0 = dist.get_rank() == 0
    state: dict[str, torch.Tensor] = {}
    for name, tensor in iter_full_weights(model, aliases, dtype):
        if rank0:
            state[name] = tensor.cpu()
    if rank0:
        state.update({alias: state[name] for alias, name in aliases.items()})
    return state


def write_hf_weights(model: torch.nn.Module, aliases: dict[str, str], directory: Path, dtype: torch.dtype) -> None:
    """The full model in `dtype` as a Hugging Face directory (config + safetensors), written by rank 0."""
    state = full_weights(model, aliases, dtype)
    if dist.get_rank() == 0:
        Path(directory).mkdir(parents=True, exist_ok=True)
        model.config.dtype = dtype  # what the files hold: an engine loading with dtype "auto" reads it here
        model.save_pretrained(directory, state_dict=state)


def save_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, aliases: dict[str, str],
                    directory: Path, *, export_dtype: torch.dtype, group: dist.ProcessGroup, step_count: int,
                    config: GRPOConfig, model_dir: Path, server_rng: dict[str, Any]) -> None:  # fmt: skip
    """This rank's shards (on a thread, over `group`), the export (rank 0, meanwhile), step and RNGs; returns once
    all of it is written."""
    # An optimizer that never stepped is not saved: reading its state would initialise it (a zero-lr step).
    stepped = bool(optimizer.state)
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if stepped:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    writing = dcp.async_save(state, checkpoint_id=Path(directory) / SHARDED_DIR, process_group=group)
    write_hf_weights(model, aliases, directory, export_dtype)
    rank_rngs = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rng_states(), rank_rngs, dst=0)
    if dist.get_rank() == 0:
        write_trainer_state(directory, step_count=step_count, optimizer=None, config=config, model_dir=model_dir,
                            rng=server_rng, rank_rngs=rank_rngs, sharded_optimizer=stepped)  # fmt: skip
    writing.result()  # the next command (a step, a load) starts only once this rank's shards are on disk


def load_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> dict[str, Any] | None:
    """Restore what `save_checkpoint` (or the one-process trainer's `save`) wrote into `optimizer`, which must be
    fresh. Returns, on rank 0, the step count and the server's RNG; None elsewhere."""
    rank = dist.get_rank()
    state = read_trainer_state(Path(directory)) if rank == 0 else None
    flags = [_has_optimizer(state), state.get("rank_rngs") if state else None]
    dist.broadcast_object_list(flags, src=0)
    has_optimizer, rank_rngs = flags
    if (Path(directory) / SHARDED_DIR).is_dir():
        load_sharded_state(model, optimizer, Path(directory), with_optimizer=has_optimizer)
    else:  # a one-process trainer's checkpoint: rank 0 reads the model and the full optimizer state
        broadcast_weights(model, Path(directory))
        if has_optimizer:
            names = [name for name, p in model.named_parameters() if p.requires_grad]
            full = by_name(state["optimizer"], names) if rank == 0 else {}
            set_optimizer_state_dict(model, optimizer, full, options=_BROADCAST)
    if rank_rngs is not None and len(rank_rngs) == dist.get_world_size():
        restore_rng_states(rank_rngs[rank])  # written by as many ranks: each takes its own back
    if rank != 0:
        return None
    return {"step_count": int(state["step_count"]), "rng": state["rng"]}


def _has_optimizer(state: dict[str, Any] | None) -> bool:
    """Whether a checkpoint holds optimizer state (one that never stepped is saved as None, or empty)."""
    if not state:
        return False
    if "sharded_optimizer" in state:
        return bool(state["sharded_optimizer"])
    return bool(state["optimizer"] and state["optimizer"]["state"])


def by_name(optimizer_state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name: the one-process trainer's (keyed by position in its
    parameter list, which is `named_parameters` order) is renamed; one keyed by name already is returned as it is."""
    groups = optimizer_state["param_groups"]
    positions = [p for group in groups for p in group["params"]]
    if all(isinstance(p, str) for p in positions):
        return optimizer_state
    if len(positions) != len(names):
        raise ValueError(f"the checkpoint's optimizer holds {len(positions)} parameters, the model {len(names)}")
    rename = dict(zip(positions, names, strict=True))
    return {
        "state": {rename[p]: value for p, value in optimizer_state["state"].items()},
        "param_groups": [{**group, "params": [rename[p] for p in group["params"]]} for group in groups],
    }


def by_position(optimizer_state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """`by_name`'s inverse: a state dict keyed by parameter name (a gathered full one) keyed by position in `names`,
    as `torch.optim.Optimizer.state_dict` writes it (a one-process trainer loads it)."""
    position = {name: i for i, name in enumerate(names)}
    return {
        "state": {position[name]: value for name, value in optimizer_state["state"].items()},
        "param_groups": [{**group, "params": [position[n] for n in group["params"]]}
                         for group in optimizer_state["param_groups"]],
    }  # fmt: skip
