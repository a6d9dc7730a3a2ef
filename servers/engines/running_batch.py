"""The running batch of the torch engine: the requests decoded together and their shared KV cache.

Every tensor's row i belongs to request i. Each row holds its tokens right-aligned in the cache with the padding on
its left masked out, and carries its own position ids, so RoPE and attention see exactly what an unpadded forward
pass of that request sees. The layout (`SlabLayer`) keeps spare rows and columns, because transformers'
DynamicCache re-copies the whole cache with `torch.cat` at every decode step, which on a CPU costs about as much as
the step itself at a few hundred tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

if TYPE_CHECKING:
    from servers.engines.request import Request

__all__ = ["RunningBatch", "SlabLayer"]


class SlabLayer(DynamicLayer):
    """Keys and values of one attention layer for a batch, in buffers with spare rows and columns.

    Row r holds request r's tokens right-aligned in columns [0, length), left padding masked (and zero, never
    uninitialised: a masked column gets zero attention weight, but 0 * NaN is NaN). `keys`/`values` are the views
    [:rows, :, :length] that attention reads. The spare capacity makes the frequent operations cheap: a decode step
    writes one column, joining requests write their own rows, a leaving request is overwritten by the last row.
    Only growth past the capacity (doubling) and a newcomer longer than the batch copy the whole cache.
    """

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, spare_columns: int) -> SlabLayer:
        """A one-row layer holding a copy of [heads, columns, dim] `keys`/`values`, with room to grow."""
        layer = cls()
        layer.lazy_initialization(keys[None], values[None])
        layer._reserve(1, keys.shape[-2] + spare_columns)
        layer.update(keys[None], values[None])
        return layer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        rows, heads, _, dim = key_states.shape
        self._k = key_states.new_empty((rows, heads, 0, dim))
        self._v = value_states.new_empty((rows, value_states.shape[1], 0, value_states.shape[-1]))
        self.rows = rows
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert key_states.shape[0] == self.rows, "batch rows and cache rows disagree"
        end = self.length + key_states.shape[-2]
        self._reserve(self.rows, end)
        assert self._k is not None and self._v is not None
        self._k[: self.rows, :, self.length : end] = key_states
        self._v[: self.rows, :, self.length : end] = value_states
        self.length = end
        self._publish()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add rows whose [rows, heads, columns, dim] keys/values are right-aligned (another batch's cache)."""
        assert self._k is not None and self._v is not None
        added, columns = keys.shape[0], keys.shape[-2]
        if columns > self.length:  # the newcomers are longer: move the running rows right
            shift = columns - self.length
            self._reserve(self.rows, columns)
            for buf in (self._k, self._v):
                buf[: self.rows, :, shift:columns] = buf[: self.rows, :, : self.length].clone()
                buf[: self.rows, :, :shift] = 0
            self.length = columns
        self._reserve(self.rows + added, self.length)
        pad, end = self.length - columns, self.rows + added
        for buf, new in ((self._k, keys), (self._v, values)):
            buf[self.rows : end, :, :pad] = 0
            buf[self.rows : end, :, pad : self.length] = new
        self.rows = end
        self._publish()

    def move_rows(self, destinations: torch.Tensor, sources: torch.Tensor, rows: int) -> None:
        """Copy rows `sources` over rows `destinations`, then keep the first `rows` rows."""
        assert self._k is not None and self._v is not None
        if destinations.numel():
            self._k[destinations, :, : self.length] = self._k[sources, :, : self.length]
            self._v[destinations, :, : self.length] = self._v[sources, :, : self.length]
        self.rows = rows
        self._publish()

    def trim_left(self, columns: int) -> None:
        """Forget the first `columns` columns (padding for every row): a view, no copy."""
        assert self._k is not None and self._v is not None
        self._k, self._v = self._k[:, :, columns:], self._v[:, :, columns:]
        self.length -= columns
        self._publish()

    def _reserve(self, rows: int, columns: int) -> None:
        assert self._k is not None and self._v is not None
        row_capacity, column_capacity = self._k.shape[0], self._k.shape[2]
        if rows <= row_capacity and columns <= column_capacity:
            return
        if rows > row_capacity:
            row_capacity = max(rows, 2 * row_capacity)
        if columns > column_capacity:
            column_capacity = max(columns, 2 * column_capacity, 64)
        k = self._k.new_empty((row_capacity, self._k.shape[1], column_capacity, self._k.shape[-1]))
        v = self._v.new_empty((row_capacity, self._v.shape[1], column_capacity, self._v.shape[-1]))
        k[: self.rows, :, : self.length] = self._k[: self.rows, :, : self.length]
        v[: self.rows, :, : self.length] = self._v[: self.rows, :, : self.length]
        self._k, self._v = k, v

    def _publish(self) -> None:
        assert self._k is not None and self._v is not None
        self.keys = self._k[: self.rows, :, : self.length]
        self.values = self._v[: self.rows, :, : self.length]


@dataclass
class RunningBatch:
    """Requests being decoded together, and their shared KV cache (row i of every tensor is requests[i])."""

    requests: list[Request]
    layers: list[SlabLayer]
    mask: torch.Tensor  # [rows, length] 1 where the cache column is a real token of that row
    positions: torch.Tensor  # [rows] position id of each row's next input token
    next_tokens: torch.Tensor  # [rows] each row's last sampled token: the next decode input

    def cache(self) -> Cache:
        return Cache(layers=list(self.layers))

    def absorb(self, other: RunningBatch) -> None:
        """Append the rows of `other` (just prefilled) to this batch."""
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.append(theirs.keys, theirs.values)
        length = max(self.mask.shape[1], other.mask.shape[1])
        pad = torch.nn.functional.pad
        self.mask = torch.cat([pad(m, (length - m.shape[1], 0)) for m in (self.mask, other.mask)])
        self.positions = torch.cat([self.positions, other.positions])
        self.next_tokens = torch.cat([self.next_tokens, other.next_tokens])
        self.requests = self.requests + other.requests

    def keep(self, rows: list[int]) -> RunningBatch | None:
        """Keep only `rows` (in any order): the rows past the end move into the holes left by the others."""
        if not rows:
            return None
        if len(rows) == len(self.requests):
            return self
        kept, remaining = set(rows), len(rows)
        holes = [i for i in range(remaining) if i not in kept]
        movers = [i for i in range(remaining, len(self.requests)) if i in kept]
        order = list(range(remaining))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        device = self.mask.device
        destinations = torch.tensor(holes, dtype=torch.long, device=device)
        sources = torch.tensor(movers, dtype=torch.long, device=device)
        for layer in self.layers:
            layer.move_rows(destinations, sources, remaining)
        index = torch.tensor(order, dtype=torch.long, device=device)
        self.requests = [self.requests[i] for i in order]
        self.mask = self.mask.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.next_tokens = self.next_tokens.index_select(0, index)
        # When the longest request leaves, columns that are padding for every remaining row stop costing attention.
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else 0
        if start:
            self.mask = self.mask[:, start:]
            for layer in self.layers:
                layer.trim_left(start)
        return self

    def copy_row(self, row: int, columns: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer copies of the last `columns` [heads, columns, dim] keys/values of `row` (its newest tokens:
        rows are right-aligned)."""
        start = self.mask.shape[1] - columns
        keys = [layer.keys[row, :, start:].clone() for layer in self.layers]
        values = [layer.values[row, :, start:].clone() for layer in self.layers]
        return keys, values
