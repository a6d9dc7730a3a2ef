"""A policy that stopped exploring: the rule the live tables colour by and `marl run` warns with.

A server reports, per training step and per agent (role), how varied its sampled replies were
(`servers.trainers.step_metrics.reply_diversity`): `reply_nll/<role>`, the mean -logprob of generated tokens (the
sampling entropy per token, estimated), and `groups_same_reply/<role>`, the share of groups whose replies were all
the same tokens. A role has *collapsed* when nearly every group has one reply, or its sampling entropy is next to
nothing. A collapsed role whose reward no longer moves is stuck: GRPO learns only from differences inside a group,
and a group of identical replies has none (its advantages are all zero), so nothing pushes it out again. A policy
that converged on the right answer looks the same, which is why `marl run` warns rather than stops.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping

COLLAPSE_SAME_REPLY = 0.9  # share of groups with a single reply at or above which a role has collapsed
COLLAPSE_REPLY_NLL = 0.05  # nats per generated token at or below which it has too
FLAT_STEPS = 3  # collapsed on this many steps in a row ...
FLAT_REWARD = 0.05  # ... while its mean reward moved less than this: stuck


def collapsed(reply_nll: float, groups_same_reply: float) -> bool:
    """Whether a role's replies stopped varying (one step's metrics)."""
    return groups_same_reply >= COLLAPSE_SAME_REPLY or reply_nll <= COLLAPSE_REPLY_NLL


def roles_in(metrics: Mapping[str, float]) -> list[str]:
    """The roles a step reported diversity for."""
    return sorted(key.split("/", 1)[1] for key in metrics if key.startswith("reply_nll/"))


class CollapseWatch:
    """Follows each learner's steps and says, once per learner and role, when a role is collapsed and flat."""

    def __init__(self, steps: int = FLAT_STEPS, flat_reward: float = FLAT_REWARD):
        self.steps, self.flat_reward = steps, flat_reward
        self._history: dict[tuple[str, str], deque[tuple[bool, float]]] = defaultdict(lambda: deque(maxlen=steps))
        self._warned: set[tuple[str, str]] = set()

    def observe(self, learner: str, metrics: Mapping[str, float]) -> list[str]:
        """The warnings one step of `learner` raises (each learner and role warns at most once per run)."""
        warnings = []
        for role in roles_in(metrics):
            nll, same = metrics[f"reply_nll/{role}"], metrics.get(f"groups_same_reply/{role}", 0.0)
            reward = metrics.get(f"reward_mean/{role}", metrics.get("reward_mean", 0.0))
            history = self._history[learner, role]
            history.append((collapsed(nll, same), reward))
            rewards = [r for _, r in history]
            stuck = (len(history) == self.steps and all(c for c, _ in history)
                     and max(rewards) - min(rewards) < self.flat_reward)
            if stuck and (learner, role) not in self._warned:
                self._warned.add((learner, role))
                warnings.append(
                    f"{learner}: role {role} may have collapsed: {same:.0%} of its groups had one reply (reply nll"
                    f" {nll:.3f}) for {self.steps} steps while its mean reward stayed at {reward:.3f}. Groups of"
                    " identical replies teach GRPO nothing: see docs/training.md, \"A policy that stops exploring\".")
        return warnings
