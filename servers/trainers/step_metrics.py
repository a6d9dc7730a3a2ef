"""The metrics dict a GRPO step returns: rewards and groups of the batch, and what its passes did.

Kept apart from the loss so that servers.trainers.grpo reads as the algorithm; the definitions here only divide the
sums that `servers.trainers.grpo.micro_batch_loss` returns, added up per pass (every ratio is a token mean over
trained tokens).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from servers.samples import Sample
from servers.trainers.micro_batches import trained_tokens

if TYPE_CHECKING:
    from servers.trainers.grpo import Advantages

__all__ = ["IDLE_PASS_METRICS", "PassTotals", "add_pass_stats", "batch_metrics", "idle_pass_metrics"]

#: The pass metrics of a step with nothing to train on (no optimizer step).
IDLE_PASS_METRICS = dict.fromkeys(
    ("trained", "optimizer_steps", "micro_batches", "loss", "pg_loss", "pg_clipfrac", "kl", "entropy",
     "logprob_diff_mean", "logprob_diff_max", "grad_norm", "skipped_nonfinite"),
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


def batch_metrics(adv: Advantages, items: Sequence[tuple[Sample, float]], dropped_stale: int) -> dict[str, float]:
    """Rewards per agent and overall, group counts, and what is trained on."""
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
        out = {
            "trained": 1.0,
            "optimizer_steps": float(self.optimizer_steps),
            "micro_batches": float(micro_batches),
            "loss": sums["loss"] / passes,  # L, averaged over passes
            "pg_loss": sums["pg_loss"] / passes,
            "pg_clipfrac": sums["clipped"] / tokens,  # tokens whose gradient the clip removed
            "kl": sums["kl_old"] / tokens,  # approx KL(old || new), k3, token mean
            "entropy": sums["entropy"] / tokens,
            # Engine-vs-trainer gap: |logp_new - logp_old| on the first pass, before any update.
            "logprob_diff_mean": sums["logprob_diff_sum"] / tokens_trained,
            "logprob_diff_max": sums["logprob_diff_max"],
            "grad_norm": sum(self.grad_norms) / passes,  # before clipping, mean over passes
            "skipped_nonfinite": float(passes - self.optimizer_steps),
        }
        assert out.keys() == IDLE_PASS_METRICS.keys()
        if with_ref:
            out["kl_ref"] = sums["kl_ref"] / tokens  # k3 KL(new || ref), token mean
        return out
