"""What a GRPO checkpoint holds besides the model files: optimizer, step count, RNG states, and the tokenizer.

`GRPOTrainer.save` writes a Hugging Face model directory (loadable by `from_pretrained`, so a checkpoint can be
served or fine-tuned elsewhere) and adds these; `servers.training.checkpoint_dirs.CheckpointDir` makes the write
atomic, names it `step_{n:06d}` and prunes old ones. The FSDP2 trainer's checkpoints add `sharded/`
(servers.trainers.fsdp_state): the fp32 weights and the optimizer state as `torch.distributed.checkpoint` shards, which
`load_sharded_state` reads into any model, sharded or not, so either trainer resumes the other's checkpoint.
"""

from __future__ import annotations

import logging
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from marl.protocol import GRPOConfig

__all__ = [
    "SHARDED_DIR",
    "TRAINER_STATE_FILE",
    "copy_tokenizer",
    "load_sharded_state",
    "read_trainer_state",
    "restore_rng_states",
    "rng_states",
    "write_trainer_state",
]

log = logging.getLogger(__name__)

#: Optimizer, step count and RNG states, next to the model files of a checkpoint.
TRAINER_STATE_FILE = "trainer_state.pt"
#: The FSDP2 trainer's weights and optimizer state, each rank's shards (`torch.distributed.checkpoint`).
SHARDED_DIR = "sharded"
#: Tokenizer files copied verbatim from `model_dir` into every checkpoint (copied, not re-saved: a re-save can
#: change the tokenizer class or its pre-tokenizer).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)
TOKENIZER_DIRS = ("additional_chat_templates",)


def rng_states() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch, CUDA), as `restore_rng_states` takes them."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def write_trainer_state(
    directory: Path,
    *,
    step_count: int,
    optimizer: dict[str, Any] | None,
    config: GRPOConfig,
    model_dir: Path,
    rng: dict[str, Any],
    **extra: Any,
) -> None:
    """`optimizer` is the optimizer's state dict (None: kept elsewhere, e.g. sharded); `rng` what `rng_states`
    returned; `extra` entries of a backend."""
    state = {
        "step_count": step_count,
        "optimizer": optimizer,
        "rng": rng,
        "config": config.model_dump(mode="json"),
        "model_dir": str(model_dir),
        **extra,
    }
    torch.save(state, directory / TRAINER_STATE_FILE)


def read_trainer_state(directory: Path) -> dict[str, Any]:
    """What `write_trainer_state` wrote; FileNotFoundError when `directory` is not a complete checkpoint."""
    state_file = directory / TRAINER_STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(f"{directory} is not a complete checkpoint: {TRAINER_STATE_FILE} is missing")
    # Our own file: RNG states are python/numpy objects, so weights_only=False.
    return torch.load(state_file, map_location="cpu", weights_only=False)


def restore_rng_states(rng: dict[str, Any]) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def load_sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path, *,
                       with_optimizer: bool) -> None:  # fmt: skip
    """Read `directory`'s `sharded/` into `model` and (`with_optimizer`) `optimizer`, resharded to however `model`
    is split now: one process, or every rank of a group at once (then it is a collective)."""
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if with_optimizer:  # a fresh optimizer's state is created (by a zero-lr step) to be overwritten
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    with warnings.catch_warnings():  # one process loading every shard is what is meant here, not a mistake to warn of
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=Path(directory) / SHARDED_DIR, no_dist=not distributed)
    set_model_state_dict(model, state["model"])
    if with_optimizer:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def copy_tokenizer(model_dir: Path, target: Path) -> None:
    """Put the tokenizer of `model_dir` into the checkpoint `target`."""
    copied = 0
    for name in TOKENIZER_FILES:
        source = model_dir / name
        if source.is_file():
            shutil.copy2(source, target / name)
            copied += 1
    for name in TOKENIZER_DIRS:
        source = model_dir / name
        if source.is_dir():
            shutil.copytree(source, target / name)
    if not copied:
        # No tokenizer files to copy (e.g. a GGUF source): fall back to re-saving the loaded tokenizer.
        from transformers import AutoTokenizer

        try:
            AutoTokenizer.from_pretrained(model_dir).save_pretrained(target)
        except Exception as exc:  # noqa: BLE001 - the weights are still worth saving
            log.warning("checkpoint %s has no tokenizer: %s", target, exc)
