"""Recorded calls and timeline merging: how an episode's calls become training samples.

A multi-turn agent re-sends its whole conversation on every call, so call k's prompt usually starts with the exact
tokens of call k-1's prompt + completion. Training on each call separately would train the shared prefix many times
and the earlier completions again as context; merging such calls into one sequence trains every generated token
exactly once, with a loss mask that is 1 on generated tokens and 0 on everything the model did not sample
(system/user/tool text and chat-template glue).

Calls are merged only within one agent tag, and only when the new prompt extends a sample token for token; anything
else (another agent, a retry that diverges, an unrelated conversation) starts a sample of its own.

An agent named in the episode's `agent_rewards` that made no call (a villager killed before it spoke) gets an empty
sample: no token, so nothing to train on, but its episode counts in the agent's GRPO group and its reward joins the
group's baseline. Without it a game where some role may stay silent would leave that role's groups short of
`num_repeat` episodes for ever, and the policy would never train.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel


class Sample(BaseModel):
    """One training sequence: merged calls of one agent, with an interleaved loss mask.

    `token_ids`, `loss_mask` and `logprobs` have equal length; `logprobs[i]` is the behaviour policy's logprob of
    `token_ids[i]` where `loss_mask[i] == 1`, and 0.0 elsewhere.
    """

    episode_id: str
    agent: str
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    reward: float
    policy_version: int  # oldest policy version among the merged calls
    num_calls: int
    #: The policy version behind each token, run-length encoded as [version, count] pairs covering `token_ids` (a
    #: call's context tokens carry the version of the call that read them). Empty: every token at `policy_version`
    #: (samples recorded before versions were kept). Calls of one episode may run on different versions (`overlap`).
    versions: list[tuple[int, int]] = []


def token_versions(sample: Sample) -> list[int]:
    """The policy version behind each of `sample`'s tokens (`Sample.versions` expanded)."""
    if not sample.versions:
        return [sample.policy_version] * len(sample.token_ids)
    return [version for version, count in sample.versions for _ in range(count)]


def _add_run(runs: list[tuple[int, int]], version: int, count: int) -> None:
    if count and runs and runs[-1][0] == version:
        runs[-1] = (version, runs[-1][1] + count)
    elif count:
        runs.append((version, count))


@dataclass
class CallRecord:
    """One data-plane call exactly as the engine saw and produced it."""

    agent: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # aligned with completion_ids
    policy_version: int
    #: Decoded prompt + completion with special tokens, cached for prompt splicing (see servers.calls.chat_format).
    text: str = ""


@dataclass
class _Building:
    agent: str
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_version: int = 0
    num_calls: int = 0
    versions: list[tuple[int, int]] = field(default_factory=list)

    def extends(self, prompt_ids: list[int]) -> bool:
        n = len(self.token_ids)
        return n <= len(prompt_ids) and prompt_ids[:n] == self.token_ids

    def append(self, call: CallRecord) -> None:
        context = call.prompt_ids[len(self.token_ids) :]
        self.token_ids += context + call.completion_ids
        self.loss_mask += [0] * len(context) + [1] * len(call.completion_ids)
        self.logprobs += [0.0] * len(context) + list(call.logprobs)
        self.policy_version = min(self.policy_version, call.policy_version) if self.num_calls else call.policy_version
        _add_run(self.versions, call.policy_version, len(context) + len(call.completion_ids))
        self.num_calls += 1


def merge_calls(
    episode_id: str, calls: list[CallRecord], reward: float, agent_rewards: dict[str, float] | None = None,
    policy_version: int = 0,
) -> list[Sample]:
    """Merge an episode's calls (in the order they were made) into samples; each gets its agent's reward. Every
    agent of `agent_rewards` without a call gets an empty sample at `policy_version` (the episode's)."""
    building: list[_Building] = []
    for call in calls:
        candidates = [b for b in building if b.agent == call.agent and b.extends(call.prompt_ids)]
        if candidates:
            target = max(candidates, key=lambda b: len(b.token_ids))  # the most recent turn of the conversation
        else:
            target = _Building(agent=call.agent)
            building.append(target)
        target.append(call)
    rewards = agent_rewards or {}
    called = {b.agent for b in building}
    building += [_Building(agent=agent, policy_version=policy_version) for agent in rewards if agent not in called]
    return [
        Sample(
            episode_id=episode_id,
            agent=b.agent,
            token_ids=b.token_ids,
            loss_mask=b.loss_mask,
            logprobs=b.logprobs,
            reward=rewards.get(b.agent, reward),
            policy_version=b.policy_version,
            num_calls=b.num_calls,
            versions=b.versions,
        )
        for b in building
    ]


def unmerged_tokens(sample: Sample) -> int:
    """Tokens the trainer would process for `sample`'s calls had each call been its own sample (no merging).

    Call k of a merged sample saw as its prompt every token before its completion, so on its own it would be
    (end of the k-th generated span) tokens long; the sum over the spans is the unmerged cost. Exact when every call
    generated at least one token (a call with an empty completion leaves no span and is not counted).
    """
    total, inside = 0, False
    for i, m in enumerate(sample.loss_mask):
        if inside and not m:
            total += i
        inside = bool(m)
    return total + (len(sample.loss_mask) if inside else 0)
