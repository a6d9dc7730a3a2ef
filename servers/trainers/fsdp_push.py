"""A sharded policy pushed into vLLM's weight-transfer engine (servers.engines.weight_transfer), from every rank.

Each tensor is gathered by all ranks together (`iter_full_weights`: one collective per tensor, in the compute
dtype), and rank 0, which shares the server's machine with vLLM, sends it; no rank ever holds more than the bucket
being sent. A failed transfer must not break the group (a rank that stops iterating leaves the others in a gather
forever), so:

1. rank 0 runs the init and `/start_weight_update` first, alone, and tells every rank whether they worked
   (a broadcast): on a refusal (the CPU build, a missing flag, an NCCL group that cannot form) nothing is gathered;
2. if a bucket fails later, rank 0 keeps iterating without sending, so every gather still has all its ranks;
3. the failure comes back as a string (never an exception, which would take the group down), and the server falls
   back to the disk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from servers.engines.weight_transfer import TransferTarget, WeightPusher
from servers.trainers.fsdp_state import iter_full_weights

__all__ = ["push_sharded"]


def push_sharded(model: torch.nn.Module, aliases: dict[str, str], dtype: torch.dtype, target: TransferTarget,
                 pusher: WeightPusher | None) -> str | None:
    """Push `model`'s full weights (gathered in `dtype`, tied aliases left out) to `target`; a collective: every rank
    calls it, rank 0 with its `pusher` (None elsewhere). Returns why the transfer failed (the same on every rank),
    or None."""
    verdict: list[str | None] = [_attempt(pusher.begin, target) if pusher is not None else None]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        return verdict[0]
    named = iter_full_weights(model, aliases, dtype)
    failure = _attempt(pusher.send, target, named) if pusher is not None else None
    for _ in named:  # the other ranks' share of every gather, and rank 0's after a failed bucket
        pass
    verdict = [failure]
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def _attempt(call, *args) -> str | None:
    try:
        call(*args)
    except Exception as exc:  # noqa: BLE001 - reported to the server, which falls back to the disk
        return f"{type(exc).__name__}: {exc}"
    return None
