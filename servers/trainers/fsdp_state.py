"""A sharded policy's state in and out of files: full HF weights, the full optimizer state, every rank's RNG.

Every function here is a collective: all ranks of the group call it together (each holds only its shard of the
weights and of the optimizer state). Files are written and read by rank 0 alone, as full (unsharded) state dicts,
so a checkpoint does not depend on the number of ranks that wrote it and is the same kind of directory the
one-process trainer writes (`servers.trainers.trainer_state`): a Hugging Face model plus `trainer_state.pt`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import AutoModelForCausalLM

from marl.protocol import GRPOConfig
from servers.trainers.trainer_state import read_trainer_state, restore_rng_states, rng_states, write_trainer_state

__all__ = ["load_checkpoint", "save_checkpoint", "tied_aliases", "write_hf_weights"]

#: Gathered to rank 0, on the CPU: what one process needs to write the full model or optimizer.
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
#: Rank 0 reads the full state and the group takes its shards from it.
_BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: name} of parameters that are one tensor (e.g. lm_head.weight tied to the input embeddings); taken
    before sharding, because a gathered state dict holds each alias as a separate copy."""
    first_name: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical = first_name.setdefault(id(param), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def _full_weights(model: torch.nn.Module, aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """The full state dict on rank 0 (empty elsewhere), ties restored so `save_pretrained` writes a tensor once."""
    state = get_model_state_dict(model, options=_GATHER)
    for alias, name in aliases.items():
        if alias in state:
            state[alias] = state[name]
    return state


def write_hf_weights(model: torch.nn.Module, aliases: dict[str, str], directory: Path) -> None:
    """The full model as a Hugging Face directory (config + safetensors), written by rank 0."""
    state = _full_weights(model, aliases)
    if dist.get_rank() == 0:
        Path(directory).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(directory, state_dict=state)


def save_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, aliases: dict[str, str],
                    directory: Path, *, step_count: int, config: GRPOConfig, model_dir: Path,
                    server_rng: dict[str, Any]) -> None:  # fmt: skip
    """Model, full optimizer state, step, the server's RNG and every rank's RNG, as one checkpoint directory."""
    write_hf_weights(model, aliases, directory)
    # An optimizer that never stepped is saved as None: gathering it would initialise it (a zero-gradient step).
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=_GATHER) if optimizer.state else None
    rank_rngs = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rng_states(), rank_rngs, dst=0)
    if dist.get_rank() == 0:
        write_trainer_state(directory, step_count=step_count, optimizer=optimizer_state, config=config,
                            model_dir=model_dir, rng=server_rng, rank_rngs=rank_rngs)  # fmt: skip


def load_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> dict[str, Any] | None:
    """Restore what `save_checkpoint` (or the one-process trainer's `save`) wrote into `optimizer`, which must be
    fresh (a checkpoint taken before any optimizer step leaves it so). Returns, on rank 0, the step count and the
    server's RNG; None elsewhere."""
    rank = dist.get_rank()
    state = read_trainer_state(Path(directory)) if rank == 0 else None
    weights = {}
    if rank == 0:
        weights = AutoModelForCausalLM.from_pretrained(directory, dtype=_param_dtype(model)).state_dict()
    set_model_state_dict(model, weights, options=_BROADCAST)
    del weights
    # An optimizer that never stepped is saved as None here, as an empty state by the one-process trainer.
    stepped = bool(state and state["optimizer"] and state["optimizer"]["state"])
    flags = [stepped, state.get("rank_rngs") if state else None]
    dist.broadcast_object_list(flags, src=0)
    has_optimizer, rank_rngs = flags
    if has_optimizer:
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        full = _by_name(state["optimizer"], names) if rank == 0 else {}
        set_optimizer_state_dict(model, optimizer, full, options=_BROADCAST)
    if rank_rngs is not None and len(rank_rngs) == dist.get_world_size():
        restore_rng_states(rank_rngs[rank])  # written by as many ranks: each takes its own back
    if rank != 0:
        return None
    return {"step_count": int(state["step_count"]), "rng": state["rng"]}


def _by_name(optimizer_state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name: the one-process trainer's (keyed by position in its
    parameter list, which is `named_parameters` order) is renamed; a sharded trainer's is already by name."""
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


def _param_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype
