"""Keys and values of finished generations, kept so that a prompt which extends one is not prefilled again.

An agent's conversation grows call by call, and the server builds each prompt from the exact token ids of the
previous call's prompt and completion (servers.calls.chat_format), so call k+1 starts with everything call k saw and
generated.
Without this cache every call re-runs the whole conversation through the model: on a CPU a Werewolves player at
2-3k tokens of history pays seconds of prefill for a 30-token reply. With it, only the new turn is prefilled.

Entries are per-layer [heads, tokens, dim] tensors of one sequence, looked up by the longest common token prefix
(GRPO repeats of a task share their system prompt and first observation too). The cache holds at most
`budget_tokens` tokens, least recently used entries go first, and an entry that a newer one extends is dropped at
once (the conversation moved on). Entries are only valid for the weights that computed them: the engine clears
the cache when it loads new weights. With LoRA adapters the same tokens give other keys/values under each adapter,
so every adapter (None: the base model) has a tree of its own, and replacing an adapter forgets its entries.
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
    adapter: str | None = None  # the LoRA adapter that computed them (None: the base model)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class PrefixCache:
    """LRU of cached prefixes under a token budget (used by the engine's worker thread only).

    Entries are indexed by a radix tree of their token ids (as SGLang's RadixCache indexes its blocks), so a lookup
    or an insert walks the prompt's tokens once and costs the same whether the cache holds ten entries or ten
    thousand. Every node knows the most recently used entry below it: the entries sharing the longest prefix with a
    prompt are exactly those below the node where the prompt leaves the tree, and of those the most recently used
    is taken.
    """

    def __init__(self, budget_tokens: int, min_reuse: int = 32) -> None:
        self.budget_tokens = budget_tokens
        self.min_reuse = min_reuse  # shorter shared prefixes cost more in a forward of their own than they save
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()  # least recently used first
        self._nodes: dict[int, _Node] = {}  # entry id -> the node where its tokens end
        self._roots: dict[str | None, _Node] = {}  # one radix tree per adapter
        self._next_id = 0
        self.tokens = 0  # held now

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int], adapter: str | None = None) -> tuple[CachedPrefix, int] | None:
        """The entry of `adapter` sharing the longest prefix with `prompt`, and how many tokens of it to reuse.

        At least the prompt's last token is left to compute (its logits give the first generated token).
        """
        root = self._roots.get(adapter)
        if root is None or len(prompt) <= self.min_reuse:
            return None
        node, shared = root.descend(tuple(prompt))
        reuse = min(shared, len(prompt) - 1)
        if node is root or reuse < self.min_reuse:
            return None
        self._touch(node.latest)
        return self._entries[node.latest], reuse

    def accepts(self, length: int) -> bool:
        """Whether a sequence of `length` tokens would be kept (ask before copying its keys/values)."""
        return self.min_reuse <= length <= self.budget_tokens

    def insert(
        self, tokens: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], adapter: str | None = None
    ) -> None:
        """Keep a finished sequence's keys/values (already copied out of the running batch), computed by
        `adapter` (None: the base model)."""
        if not self.accepts(len(tokens)):
            return
        entry_id, self._next_id = self._next_id, self._next_id + 1
        node = self._roots.setdefault(adapter, _Node((), None)).place(tuple(tokens))
        extended = [n.entry for n in node.path() if n.entry is not None]  # prefixes of this one: no use any more
        node.entry = entry_id
        self._entries[entry_id] = CachedPrefix(torch.tensor(tokens, dtype=torch.long), keys, values, adapter)
        self._nodes[entry_id] = node
        self.tokens += len(tokens)
        self._touch(entry_id)
        for old in extended:
            self._drop(old)
        while self.tokens > self.budget_tokens:  # the new entry is the most recent and fits: it is never the one
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self._nodes.clear()
        self._roots.clear()
        self.tokens = 0

    def forget(self, adapter: str | None) -> None:
        """Drop the entries of `adapter` (replaced: its keys/values are stale); the others stay."""
        for entry_id in [i for i, entry in self._entries.items() if entry.adapter == adapter]:
            self._drop(entry_id)
        self._roots.pop(adapter, None)

    def _touch(self, entry_id: int) -> None:
        self._entries.move_to_end(entry_id)
        for node in self._nodes[entry_id].path():
            node.latest = entry_id

    def _drop(self, entry_id: int) -> None:
        # No node keeps this entry as its `latest` while another entry lies below it: an entry dropped because a
        # newer one extends it has that newer one below each of its nodes, and an evicted entry is the least
        # recently used of all. So the pointers stay right without looking at any sibling.
        self.tokens -= len(self._entries.pop(entry_id))
        node = self._nodes.pop(entry_id)
        if node.entry == entry_id:
            node.entry = None
            node.prune()


class _Node:
    """A radix tree node: the token ids from its parent (`edge`), and the entry ending here if any."""

    __slots__ = ("children", "edge", "entry", "latest", "parent")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None) -> None:
        self.edge = edge
        self.parent = parent
        self.children: dict[int, _Node] = {}  # by the first token of their edge
        self.entry: int | None = None
        self.latest: int | None = None  # the most recently used entry at or below this node

    def descend(self, tokens: tuple[int, ...]) -> tuple[_Node, int]:
        """The deepest node whose subtree holds the entries sharing the most tokens with `tokens`, and how many."""
        node, i = self, 0
        while i < len(tokens) and (child := node.children.get(tokens[i])) is not None:
            shared = _common_prefix(child.edge, tokens, i)
            node, i = child, i + shared
            if shared < len(child.edge):
                break
        return node, i

    def place(self, tokens: tuple[int, ...]) -> _Node:
        """The node where `tokens` end, made (splitting an edge if need be) when there is none."""
        node, i = self, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = node.children[tokens[i]] = _Node(tokens[i:], node)
                return leaf
            shared = _common_prefix(child.edge, tokens, i)
            if shared < len(child.edge):
                child = child.split(shared)
            node, i = child, i + shared
        return node

    def split(self, at: int) -> _Node:
        """Cut this node's edge after `at` tokens; return the new node in between, above this one."""
        parent = self.parent
        middle = _Node(self.edge[:at], parent)
        middle.latest = self.latest
        parent.children[self.edge[0]] = middle
        self.edge, self.parent = self.edge[at:], middle
        middle.children[self.edge[0]] = self
        return middle

    def path(self) -> list[_Node]:
        """This node and those above it, the root excluded."""
        nodes, node = [], self
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes

    def prune(self) -> None:
        """Remove nodes that no entry needs any more, and merge a lone child into a node without entry."""
        node = self
        while node.parent is not None and node.entry is None and not node.children:
            del node.parent.children[node.edge[0]]
            node = node.parent
        if node.parent is not None and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()
            child.edge, child.parent = node.edge + child.edge, node.parent
            node.parent.children[child.edge[0]] = child


def _common_prefix(edge: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """How many tokens of `edge` match `tokens` from `start` (slices compare in C; only the last block in Python)."""
    n = min(len(edge), len(tokens) - start)
    if edge[:n] == tokens[start : start + n]:
        return n
    done, block = 0, 64
    while edge[done : done + block] == tokens[start + done : start + done + block]:
        done += block
    while edge[done] == tokens[start + done]:
        done += 1
    return done
