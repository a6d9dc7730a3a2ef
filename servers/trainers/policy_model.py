"""Loading the model GRPO trains, and keeping its training forward identical to the engine's inference forward.

The PPO ratio compares the trainer's logprobs with the ones the engine recorded, so the policy runs in eval mode
(dropout off) even while it trains; gradient checkpointing has to be switched on without leaving eval mode.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

__all__ = ["load_policy_model", "resolve_dtype", "set_gradient_checkpointing"]


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32  # fp32 weights and optimizer state: exact on CPU, simple everywhere
    if isinstance(dtype, str):
        return getattr(torch, dtype.removeprefix("torch."))
    return dtype


def load_policy_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.to(device)
    model.eval()  # dropout off: the training forward must reproduce the engine's logprobs
    return model


def set_gradient_checkpointing(model: torch.nn.Module, enabled: bool) -> None:
    """Turn activation recomputation of the decoder layers on or off (a Werewolves player's merged conversation of
    5k tokens needs about 12 GB of saved activations for SmolLM2-135M in fp32 without it).

    transformers only checkpoints a layer in training mode, and the policy stays in eval mode (dropout off, so the
    training forward reproduces the engine's logprobs). So only the layer modules themselves are flagged as
    training: their submodules, dropout included, stay in eval mode.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if enabled and not layers:
        raise ValueError(f"gradient_checkpointing: {type(model).__name__} has no checkpointable decoder layers")
    if enabled and not model.is_activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif not enabled and model.is_activation_checkpointing:
        model.activation_checkpointing_disable()
    for layer in layers:
        layer.training = enabled
