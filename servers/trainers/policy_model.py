"""Loading the model GRPO trains, keeping its training forward identical to the engine's inference forward, and
the per-token logprobs both trainers compute from it (`GRPOTrainer` and every rank of the FSDP2 trainer).

The PPO ratio compares the trainer's logprobs with the ones the engine recorded, so the policy runs in eval mode
(dropout off) even while it trains; gradient checkpointing has to be switched on without leaving eval mode.

Logprobs are computed **in chunks of tokens** (`token_logprobs_and_entropy`): the decoder's last hidden states of
the positions that predict a wanted token are projected onto the vocabulary `chunk_tokens` at a time (log-softmax
in fp32, gather the target, entropy, discard), and the backward recomputes each chunk's logits. So the fp32
[tokens, vocab] logits never exist at once: at a 152k vocabulary one 32k-token micro-batch's logits are ~20 GB per
copy, a 1024-token chunk's 0.6 GB.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM

__all__ = [
    "LOGITS_CHUNK_TOKENS",
    "load_policy_model",
    "resolve_dtype",
    "set_gradient_checkpointing",
    "token_logprobs_and_entropy",
]

#: Tokens projected onto the vocabulary at once (their [chunk, vocab] fp32 logits are the largest tensor of a step).
LOGITS_CHUNK_TOKENS = 1024


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


def token_logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    keep: torch.Tensor | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_tokens: int = LOGITS_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logp[b, t] = log_softmax(logits[b, t-1])[input_ids[b, t]], fp32, temperature 1; and optionally the entropy
    H[b, t] = -sum_v p_v log p_v of that same distribution (a metric, without gradient, unless `entropy_grad`: the
    loss's entropy bonus).

    Both are [B, T], aligned with the tokens, 0 at t = 0, on padding, and where `keep` ([B, T], e.g. the loss mask)
    is 0: only the positions that predict a kept token are projected onto the vocabulary (agents' prompts are long
    and their replies short). Right padding (attention_mask 0 after the tokens) is expected.
    """
    wanted = attention_mask[:, 1:].bool() if keep is None else keep[:, 1:].bool() & attention_mask[:, 1:].bool()
    rows, cols = wanted.nonzero(as_tuple=True)  # position (row, col) predicts token (row, col + 1)
    hidden = final_hidden_states(model, input_ids, attention_mask)[rows, cols]  # [N, H]
    targets = input_ids[rows, cols + 1]
    head = model.get_output_embeddings()
    pieces = []
    for start in range(0, len(targets), chunk_tokens):
        args = (head, hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens], with_entropy,
                entropy_grad)
        # Recomputed in the backward: a chunk's [chunk, V] logits are freed as soon as its logprobs are taken.
        pieces.append(checkpoint(_chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk(*args))
    dense = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)

    def scatter(values: list[torch.Tensor]) -> torch.Tensor:  # [N] back to [B, T], aligned with the tokens
        return dense.index_put((rows, cols + 1), torch.cat(values)) if values else dense

    logp = scatter([lp for lp, _ in pieces])
    if isinstance(model, FSDPModule) and not torch.is_grad_enabled():
        model.reshard()  # the root keeps its parameters gathered after its forward; no backward will free them here
    return logp, scatter([h for _, h in pieces]) if with_entropy else None


def _chunk(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, with_entropy: bool,
           entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One chunk: logits = head(h) in fp32 (whatever the model dtype), log-softmax, the targets' logprobs, entropy."""
    logp_all = torch.log_softmax(head(hidden).float(), dim=-1)  # [chunk, V]
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):  # H = -sum_v p_v log p_v
        entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else logp.new_zeros(())
    return logp, entropy


def final_hidden_states(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states [B, T, H] (after the final norm), from the causal LM's own forward.

    The whole model is called, not just its decoder, because FSDP2's hooks (gather the root's parameters, reduce
    their gradients) live on the root module's forward; no position is projected onto the vocabulary there
    (`logits_to_keep` is empty). The root keeps its parameters unsharded after its forward, so the head can be
    applied after it returns.
    """
    captured: list[torch.Tensor] = []
    hook = model.get_decoder().register_forward_hook(lambda _m, _a, out: captured.append(out.last_hidden_state))
    try:
        none = torch.zeros(0, dtype=torch.long, device=input_ids.device)
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=none)
    finally:
        hook.remove()
    return captured[0]
