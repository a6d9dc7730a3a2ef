"""Keys and values of finished generations, kept so that a prompt which extends one is not prefilled again.

An agent's conversation grows call by call, and the server builds each prompt from the exact token ids of the
previous call's prompt and completion (servers.chat_format), so call k+1 starts with everything call k saw and
generated.
Without this cache every call re-runs the whole conversation through the model: on a CPU a Werewolves player at
2-3k tokens of history pays seconds of prefill for a 30-token reply. With it, only the new turn is prefilled.

Entries are per-layer [heads, tokens, dim] tensors of one sequence, looked up by the longest common token prefix
(GRPO repeats of a task share their system prompt and first observation too). The cache holds at most
`budget_tokens` tokens, least recently used entries go first, and an entry that a newer one extends is dropped at
once (the conversation moved on). Entries are only valid for the weights that computed them: the engine clears
the cache when it loads new weights.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["CachedPrefix", "PrefixCache"]


@dataclass
class CachedPrefix:
    tokens: torch.Tensor  # [length] token ids (int64, CPU)
    keys: list[torch.Tensor]  # per layer [heads, length, dim]
    values: list[torch.Tensor]

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class PrefixCache:
    """LRU of cached prefixes under a token budget (used by the engine's worker thread only)."""

    def __init__(self, budget_tokens: int, min_reuse: int = 32) -> None:
        self.budget_tokens = budget_tokens
        self.min_reuse = min_reuse  # shorter shared prefixes cost more in a forward of their own than they save
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()
        self._next_id = 0
        self.tokens = 0  # held now

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> tuple[CachedPrefix, int] | None:
        """The entry sharing the longest prefix with `prompt`, and how many tokens of it to reuse.

        At least the prompt's last token is left to compute (its logits give the first generated token).
        """
        if not self._entries or len(prompt) <= self.min_reuse:
            return None
        query = torch.tensor(prompt, dtype=torch.long)
        best_id, best = None, 0
        for entry_id, entry in self._entries.items():
            shared = _common_prefix(entry.tokens, query)
            if shared > best:
                best_id, best = entry_id, shared
        best = min(best, len(prompt) - 1)
        if best_id is None or best < self.min_reuse:
            return None
        self._entries.move_to_end(best_id)
        return self._entries[best_id], best

    def accepts(self, length: int) -> bool:
        """Whether a sequence of `length` tokens would be kept (ask before copying its keys/values)."""
        return self.min_reuse <= length <= self.budget_tokens

    def insert(self, tokens: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Keep a finished sequence's keys/values (already copied out of the running batch)."""
        if not self.accepts(len(tokens)):
            return
        entry = CachedPrefix(torch.tensor(tokens, dtype=torch.long), keys, values)
        for entry_id, old in list(self._entries.items()):  # entries this one extends are no use any more
            if len(old) <= len(entry) and _common_prefix(old.tokens, entry.tokens) == len(old):
                self._drop(entry_id)
        while self.tokens + len(entry) > self.budget_tokens:
            self._drop(next(iter(self._entries)))
        self._entries[self._next_id] = entry
        self._next_id += 1
        self.tokens += len(entry)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    def _drop(self, entry_id: int) -> None:
        self.tokens -= len(self._entries.pop(entry_id))


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.shape[0], b.shape[0])
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n
