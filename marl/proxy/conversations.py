"""Conversations the proxy keeps going: the episode whose answer the app got, found again by the app's next turn.

A *branch* is one episode of a conversation: its lease, the conversation's task id, and the reward of every turn it
answered. The branch whose candidate won a turn is *held* under the digest of the messages the app will send back
(its history plus the reply it got); the app's next request, which starts with exactly those messages, takes it and
continues on its lease, so the swarm server splices the exact tokens it generated. Each turn's calls carry the
agent tag `turn-<k>`: with one task id per conversation, GRPO groups are (task, turn), and a branch that answered
several turns is ended once with one reward per turn (`agent_rewards`). See docs/proxy.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from marl.client import EpisodeOutput
from marl.protocol import EpisodeLease


def turn_tag(turn: int) -> str:
    """The agent tag of a conversation's k-th turn: its GRPO group within the conversation's task id."""
    return f"turn-{turn}"


@dataclass
class Branch:
    """One episode of a conversation."""

    lease: EpisodeLease
    task_id: str
    turn: int  # the latest turn it answered
    rewards: dict[str, float]  # turn tag -> this episode's reward on that turn
    release_at: float = math.inf  # time.monotonic() at which a held branch is ended if the app has not continued

    def output(self) -> EpisodeOutput:
        """What the episode is ended with: the reward of its latest turn, and every turn's own (per agent tag)."""
        latest = self.rewards[turn_tag(self.turn)]
        per_turn = dict(self.rewards) if len(self.rewards) > 1 else None
        return EpisodeOutput(reward=latest, agent_rewards=per_turn, metadata={"proxy_turns": sorted(self.rewards)})


class ConversationStore:
    """Held branches, by the digest of the messages the app sends back when it continues the conversation."""

    def __init__(self) -> None:
        self._held: dict[str, Branch] = {}

    def __len__(self) -> int:
        return len(self._held)

    def take(self, messages: Sequence[Any]) -> Branch | None:
        """The held branch that `messages` continue (the longest matching history), no longer held; else None."""
        digests = message_digests(messages)
        for digest in reversed(digests[:-1]):  # a continuation adds at least one message
            branch = self._held.pop(digest, None)
            if branch is not None:
                return branch
        return None

    def hold(self, messages: Sequence[Any], branch: Branch, idle_s: float) -> Branch | None:
        """Hold `branch` under `messages` for at most `idle_s` (and half its lease's patience, so it never expires
        on the server first). Returns the branch it displaces (the same conversation answered twice), to be ended."""
        branch.release_at = time.monotonic() + min(idle_s, branch.lease.patience_s / 2)
        digest = message_digests(messages)[-1]
        displaced = self._held.get(digest)
        self._held[digest] = branch
        return displaced

    def take_expired(self, now: float | None = None) -> list[Branch]:
        now = time.monotonic() if now is None else now
        return [self._held.pop(d) for d, b in list(self._held.items()) if b.release_at <= now]

    def take_all(self) -> list[Branch]:
        branches, self._held = list(self._held.values()), {}
        return branches


def message_digests(messages: Sequence[Any]) -> list[str]:
    """digests[j] identifies messages[: j + 1]: role, text, tool calls (name and arguments) and tool call id."""
    running = hashlib.sha256()
    digests = []
    for message in messages:
        running.update(_canonical(message))
        digests.append(running.copy().hexdigest())
    return digests


def _canonical(message: Any) -> bytes:
    data = message.model_dump(mode="json") if isinstance(message, BaseModel) else dict(message)
    content = data.get("content")
    if isinstance(content, list):  # content parts: the text is what the chat template renders
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    calls = [((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
             for c in data.get("tool_calls") or []]
    fields = [data.get("role"), content or "", calls, data.get("tool_call_id")]
    return json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
