"""What a generation that must begin with one of a few token sequences (`SamplingParams.lead`) may sample next.

Shared by the torch engine's sampler and the vLLM subprocess's logits processor (`vllm_lead`), so this module
imports nothing of marl (torch alone, which both environments have): vLLM's process finds it on its PYTHONPATH (this
directory) and has none of marl.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["allowed_next", "hold_to_lead", "keep_only", "lead_from_strings", "lead_to_strings"]


def keep_only(logits: torch.Tensor, row: int, allowed: Sequence[int]) -> None:
    """Mask row `row` of `logits` in place to the `allowed` token ids (those past the logits' width, a padded
    vocabulary's, are left out): every other token's logit becomes -inf."""
    keep = torch.tensor([t for t in allowed if t < logits.shape[-1]], device=logits.device, dtype=torch.long)
    kept = logits[row, keep]
    logits[row] = float("-inf")
    logits[row, keep] = kept


def allowed_next(lead: Sequence[Sequence[int]], generated: Sequence[int]) -> list[int] | None:
    """The tokens that may come after `generated` while it has not yet spelled one of `lead`'s sequences; None once
    it has (or when it strays from them, which the constraint never lets happen), i.e. sampling is free."""
    k = len(generated)
    if not lead or k > max(len(seq) for seq in lead):
        return None
    so_far = tuple(generated)
    if any(tuple(seq) == so_far for seq in lead):
        return None
    allowed = sorted({seq[k] for seq in lead if len(seq) > k and tuple(seq[:k]) == so_far})
    return allowed or None


def hold_to_lead(logits: torch.Tensor, row: int, lead: Sequence[Sequence[int]], output: Sequence[int]) -> bool:
    """Mask row `row` of `logits` to what may continue `output` into one of `lead`'s sequences (nothing while it is
    free); False once the row is free for good (its output is longer than every sequence: it spelled one), so the
    caller may stop tracking it. The masking both vLLM logits processors share (`vllm_lead_v1`, `vllm_lead_v2`)."""
    allowed = allowed_next(lead, output)
    if allowed is not None:
        keep_only(logits, row, allowed)
        return True
    return len(output) <= max(len(seq) for seq in lead)


def lead_to_strings(lead: Sequence[Sequence[int]]) -> list[str]:
    """The sequences as vLLM's `vllm_xargs` carries them (a flat list of strings or numbers): "12 7 9" each."""
    return [" ".join(str(t) for t in seq) for seq in lead]


def lead_from_strings(strings: object) -> tuple[tuple[int, ...], ...]:
    """`lead_to_strings` read back; ValueError for anything else."""
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise ValueError("marl_lead must be a list of strings of token ids")
    lead = tuple(tuple(int(t) for t in s.split()) for s in strings)
    if not all(lead) or any(t < 0 for seq in lead for t in seq):
        raise ValueError("marl_lead holds an empty sequence or a negative token id")
    return lead
