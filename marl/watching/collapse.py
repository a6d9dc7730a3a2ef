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
COLLAPSE_ACTION_SHARE = 0.8  # share of its recent moves under one label at or above which it has too
#: The label an env gives a reply it refused (`action_labels`, docs/envs.md): not a move the policy chose, so never
#: the "one label" of a collapse (a model that cannot play yet is mostly refused, with replies that still vary: the
#: reply metrics see a collapse in those).
INVALID_LABEL = "invalid"
FLAT_STEPS = 3  # collapsed on this many steps in a row, while the mean reward of these steps ...
FLAT_REWARD = 0.05  # ... is not above the mean of the steps before them by more than this: stuck


def collapsed(reply_nll: float, groups_same_reply: float, top_action_share: float = 0.0) -> bool:
    """Whether a role's replies stopped varying: one step's metrics, and the share of its commonest move."""
    return (groups_same_reply >= COLLAPSE_SAME_REPLY or reply_nll <= COLLAPSE_REPLY_NLL
            or top_action_share >= COLLAPSE_ACTION_SHARE)


def roles_in(metrics: Mapping[str, float]) -> list[str]:
    """The roles a step reported diversity for."""
    return sorted(key.split("/", 1)[1] for key in metrics if key.startswith("reply_nll/"))


class CollapseWatch:
    """Follows each learner's steps and says, once per learner and role, when a role is collapsed and not gaining."""

    def __init__(self, steps: int = FLAT_STEPS, flat_reward: float = FLAT_REWARD):
        self.steps, self.flat_reward = steps, flat_reward
        self._history: dict[tuple[str, str], deque[tuple[bool, float]]] = defaultdict(lambda: deque(maxlen=2 * steps))
        self._warned: set[tuple[str, str]] = set()

    def observe(self, learner: str, metrics: Mapping[str, float],
                actions: Mapping[str, Mapping[str, int]] | None = None) -> list[str]:
        """The warnings one step of `learner` raises (each learner and role warns at most once per run). `actions`:
        per role, how often it made each labelled move lately (where the env labels them)."""
        warnings = []
        for role in roles_in(metrics):
            nll, same = metrics[f"reply_nll/{role}"], metrics.get(f"groups_same_reply/{role}", 0.0)
            moves = (actions or {}).get(role) or {}
            chosen = {label: n for label, n in moves.items() if label != INVALID_LABEL}
            top = max(chosen.values()) / sum(moves.values()) if chosen else 0.0  # a share of every labelled move
            reward = metrics.get(f"reward_mean/{role}", metrics.get("reward_mean", 0.0))
            history = self._history[learner, role]
            history.append((collapsed(nll, same, top), reward))
            if self._stuck(history) and (learner, role) not in self._warned:
                self._warned.add((learner, role))
                label = max(chosen, key=chosen.get) if chosen else None
                what = f"{top:.0%} of its recent moves were {label!r}" if top >= COLLAPSE_ACTION_SHARE else (
                    f"{same:.0%} of its groups had one reply (reply nll {nll:.3f})")
                warnings.append(
                    f"{learner}: role {role} may have collapsed: {what} for {self.steps} steps while its mean reward"
                    f" did not rise ({reward:.3f}). Groups of identical replies teach GRPO nothing: see"
                    " docs/training.md, \"A policy that stops exploring\".")
        return warnings

    def _stuck(self, history: deque[tuple[bool, float]]) -> bool:
        """Collapsed on the last `steps` steps, and their mean reward no higher than the steps' before (or, early in
        a run, than the first of them)."""
        recent = list(history)[-self.steps:]
        if len(recent) < self.steps or not all(c for c, _ in recent):
            return False
        before = list(history)[: -self.steps] or recent[:1]
        mean = lambda rows: sum(r for _, r in rows) / len(rows)  # noqa: E731
        return mean(recent) - mean(before) < self.flat_reward
