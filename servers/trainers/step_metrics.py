"""The metrics dict a GRPO step returns: rewards and groups of the batch, and what its passes did.

Kept apart from the loss so that servers.trainers.grpo reads as the algorithm; the definitions here only divide the
sums that `servers.trainers.grpo.micro_batch_loss` returns, added up per pass (every ratio is a token mean over
trained tokens). `Advantages`, what step 1 makes of the batch's groups, is defined here because its counts are
the batch's metrics; the algorithm (`compute_advantages`) stays in grpo.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from servers.episodes.samples import Sample
from servers.trainers.micro_batches import trained_tokens

if TYPE_CHECKING:
    from servers.backends import Group

__all__ = ["IDLE_PASS_METRICS", "Advantages", "PassTotals", "add_pass_stats", "batch_metrics", "idle_pass_metrics",
           "reply_diversity"]


@dataclass
class Advantages:
    """What `servers.trainers.grpo.compute_advantages` makes of a batch's groups (step 1), which the batch's metrics
    count."""

    #: (sample, advantage) of every sample in a group that is trained on, in batch order.
    items: list[tuple[Sample, float]] = field(default_factory=list)
    groups: int = 0
    groups_zero_variance: int = 0
    groups_trained: int = 0
    #: id() of the samples of zero-variance groups trained anyway (A = 0: for the KL term only; grpo.py, step 1).
    zero_variance_samples: set[int] = field(default_factory=set)
    #: Episode rewards per agent (one per episode of each group), for the reward metrics.
    rewards_by_agent: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))


#: The pass metrics of a step with nothing to train on (no optimizer step).
IDLE_PASS_METRICS = dict.fromkeys(
    ("trained", "optimizer_steps", "micro_batches", "loss", "pg_loss", "pg_clipfrac", "kl", "entropy",
     "logprob_diff_mean", "logprob_diff_max", "grad_norm", "skipped_nonfinite", "offpolicy_frac",
     "importance_weight_mean", "importance_weight_max", "importance_capfrac", "recomputed_logprobs",
     "recompute_seconds"),
    0.0,
)  # fmt: skip


def idle_pass_metrics(*, with_ref: bool) -> dict[str, float]:
    """The pass metrics of a step with nothing to train on."""
    return {**IDLE_PASS_METRICS, "kl_ref": 0.0} if with_ref else dict(IDLE_PASS_METRICS)


def add_pass_stats(into: dict[str, float], stats: dict[str, float]) -> None:
    """Add one micro-batch's (or one rank's) metric sums to a pass's: sums add up, `*_max` keys take the max."""
    for key, value in stats.items():
        before = into.get(key)
        into[key] = value if before is None else max(before, value) if key.endswith("_max") else before + value


def batch_metrics(adv: Advantages, items: Sequence[tuple[Sample, float]], dropped_stale: int,
                  start_version: int = 0) -> dict[str, float]:  # fmt: skip
    """Rewards per agent and overall, group counts, what is trained on, and how many versions behind the policy
    the step starts from (`start_version`) its samples are (a sample counts by its oldest call)."""
    out: dict[str, float] = {}
    every = [r for rs in adv.rewards_by_agent.values() for r in rs]
    out["reward_mean"] = float(np.mean(every)) if every else 0.0
    out["reward_std"] = float(np.std(every)) if every else 0.0
    for agent, rewards in sorted(adv.rewards_by_agent.items()):
        out[f"reward_mean/{agent}"] = float(np.mean(rewards)) if rewards else 0.0
        out[f"reward_std/{agent}"] = float(np.std(rewards)) if rewards else 0.0
    out.update(
        groups=float(adv.groups),
        groups_zero_variance=float(adv.groups_zero_variance),
        groups_trained=float(adv.groups_trained),
        samples=float(len(items)),
        tokens_trained=float(sum(trained_tokens(s) for s, _ in items)),
        dropped_stale=float(dropped_stale),
    )
    behind = [start_version - s.policy_version for s, _ in items] or [0]
    out.update(staleness_min=float(min(behind)), staleness_mean=float(np.mean(behind)),
               staleness_max=float(max(behind)))
    return out


def reply_diversity(groups: Sequence[Group]) -> dict[str, float]:
    """Whether a policy still explores, from every group of the batch, trained on or not (a collapsed policy's
    groups all have zero variance, so the pass metrics see none of them):

    - `reply_nll`: the mean of -logprob over generated tokens, as the engine sampled them: the sampling policy's
      entropy per token, estimated (it falls towards 0 as the replies stop varying);
    - `groups_same_reply`: the share of groups of 2 or more samples whose generated tokens are all identical.

    Each overall, and per agent (`reply_nll/<agent>`), so that one role's collapse shows beside another's learning.
    """
    nll: dict[str, list[float]] = defaultdict(list)
    same: dict[str, list[float]] = defaultdict(list)
    for group in groups:
        spoken = [s for s in group.samples if trained_tokens(s)]  # a silent agent's empty sample is no reply
        replies = [tuple(t for t, m in zip(s.token_ids, s.loss_mask) if m) for s in spoken]
        for sample in spoken:
            nll[group.agent].extend(-lp for lp, m in zip(sample.logprobs, sample.loss_mask) if m)
        if len(replies) > 1:
            same[group.agent].append(float(len(set(replies)) == 1))
    out: dict[str, float] = {}
    for key, values in (("reply_nll", nll), ("groups_same_reply", same)):
        every = [v for vs in values.values() for v in vs]
        out[key] = float(np.mean(every)) if every else 0.0
        out.update({f"{key}/{agent}": float(np.mean(vs)) for agent, vs in sorted(values.items()) if vs})
    return out


class PassTotals:
    """The per-pass sums of one step's `ppo_epochs` passes, and their gradient norms and optimizer steps."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.grad_norms: list[float] = []
        self.optimizer_steps = 0

    def add(self, stats: dict[str, float], grad_norm: float, stepped: bool) -> None:
        first = not self.grad_norms
        self.grad_norms.append(grad_norm)
        self.optimizer_steps += int(stepped)
        for key, value in stats.items():
            if first or not key.startswith("logprob_diff"):  # the engine-vs-trainer gap: before any update only
                self.sums[key] = max(self.sums[key], value) if key.endswith("_max") else self.sums[key] + value

    def metrics(self, *, micro_batches: int, tokens_trained: float, with_ref: bool) -> dict[str, float]:
        sums, passes = self.sums, len(self.grad_norms)
        tokens = sums["tokens"]  # trained tokens summed over passes
        stale = sums["stale_tokens"]  # of those, generated by an older policy than the step's start
        on_policy = tokens_trained - stale / passes
        out = {
            "trained": 1.0,
            "optimizer_steps": float(self.optimizer_steps),
            "micro_batches": float(micro_batches),
            "loss": sums["loss"] / passes,  # L, averaged over passes
            "pg_loss": sums["pg_loss"] / passes,
            "pg_clipfrac": sums["clipped"] / tokens,  # tokens whose gradient the clip removed
            "kl": sums["kl_old"] / tokens,  # approx KL(old || new), k3, token mean
            "entropy": sums["entropy"] / tokens,
            # Engine-vs-trainer gap: |logp_start - mu| (the first pass's logprobs, or the recompute pass's) before
            # any update, on-policy tokens.
            "logprob_diff_mean": sums["logprob_diff_sum"] / on_policy if on_policy else 0.0,
            "logprob_diff_max": sums["logprob_diff_max"],
            "grad_norm": sum(self.grad_norms) / passes,  # before clipping, mean over passes
            "skipped_nonfinite": float(passes - self.optimizer_steps),
            # Off-policy tokens (grpo.py, step 2): their share, and their importance weights min(pi_start / mu, cap)
            "offpolicy_frac": stale / tokens,
            "importance_weight_mean": sums["importance_weight_sum"] / stale if stale else 0.0,
            "importance_weight_max": sums["importance_weight_max"],
            "importance_capfrac": sums["importance_capped"] / stale if stale else 0.0,
            # pi_start's logprobs taken by the trainer before the first pass (grpo.py, step 2), and how long it took
            "recomputed_logprobs": float("recompute_seconds_max" in sums),
            "recompute_seconds": sums.get("recompute_seconds_max", 0.0),
        }
        assert out.keys() == IDLE_PASS_METRICS.keys()
        if with_ref:
            out["kl_ref"] = sums["kl_ref"] / tokens  # k3 KL(new || ref), token mean
        return out
