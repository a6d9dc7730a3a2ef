"""Step 4 of GRPO's plumbing: samples packed into padded micro-batches under a token budget.

How samples are grouped never changes the gradient (each micro-batch adds its share of L; see
servers.trainers.grpo), only the memory a forward pass needs and how much of it is padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from servers.episodes.samples import Sample, token_versions

__all__ = ["MicroBatch", "check_token_ids", "collate", "pack_micro_batches", "trained_tokens"]


def pack_micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices into `lengths`, grouped so that len(mb) * max(length in mb) <= budget.

    Longest first (less padding; ties keep their order); a sequence longer than the budget goes alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        longest_if_added = max(longest, lengths[i])
        if current and longest_if_added * (len(current) + 1) > budget:
            batches.append(current)
            current, longest_if_added = [], lengths[i]
        current.append(i)
        longest = longest_if_added
    if current:
        batches.append(current)
    return batches


def trained_tokens(sample: Sample) -> int:
    return sum(sample.loss_mask[1:])  # token 0 has no prefix: it cannot be trained on


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T] long, right-padded
    attention_mask: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] float, 0 at t = 0 and on padding
    old_logp: torch.Tensor  # [B, T] float32, behaviour logprobs
    advantages: torch.Tensor  # [B] float32
    stale: torch.Tensor  # [B, T] float32, 1 where an older policy than the step's start generated the token


def check_token_ids(sample: Sample, vocab_size: int) -> None:
    """ValueError when `sample` holds ids outside the model's vocabulary."""
    if sample.token_ids and (max(sample.token_ids) >= vocab_size or min(sample.token_ids) < 0):
        raise ValueError(
            f"sample of episode {sample.episode_id!r} has token ids outside the model's vocabulary "
            f"[0, {vocab_size}): was it recorded by another model?"
        )


def collate(items: Sequence[tuple[Sample, float]], device: torch.device, vocab_size: int,
            start_version: int | None = None) -> MicroBatch:  # fmt: skip
    """(sample, advantage) pairs as right-padded tensors on `device`; ValueError for ids outside the vocabulary.
    `start_version`: the policy version the step starts from (tokens of older versions are `stale`; None: none)."""
    width = max(len(s.token_ids) for s, _ in items)
    shape = (len(items), width)
    input_ids = torch.zeros(shape, dtype=torch.long)  # pad id is irrelevant: attention_mask hides it
    attention_mask = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.float32)
    old_logp = torch.zeros(shape, dtype=torch.float32)
    stale = torch.zeros(shape, dtype=torch.float32)
    for row, (sample, _) in enumerate(items):
        n = len(sample.token_ids)
        check_token_ids(sample, vocab_size)
        input_ids[row, :n] = torch.tensor(sample.token_ids, dtype=torch.long)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(sample.loss_mask, dtype=torch.float32)
        old_logp[row, :n] = torch.tensor(sample.logprobs, dtype=torch.float32)
        if start_version is not None and sample.policy_version < start_version:
            stale[row, :n] = torch.tensor(token_versions(sample)) < start_version
    loss_mask[:, 0] = 0.0
    advantages = torch.tensor([a for _, a in items], dtype=torch.float32)
    return MicroBatch(
        input_ids.to(device),
        attention_mask.to(device),
        loss_mask.to(device),
        old_logp.to(device),
        advantages.to(device),
        stale.to(device),
    )
