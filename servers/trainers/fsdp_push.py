"""A sharded policy pushed into vLLM's weight-transfer engine (servers.engines.weight_transfer), from every rank.

Each tensor is gathered by all ranks together (`iter_full_weights`: one collective per tensor, in the compute
dtype), so every rank holds its own full copy of the bucket being sent, and no rank ever holds more. Who sends what
is `replica_posts`: for nccl rank 0 broadcasts to every replica; for ipc each rank on a vLLM worker's GPU shares its
own copy, the handles are exchanged (`all_gather_object`: small metadata), and the rank on each replica's first
worker GPU posts that replica's bodies. A failed transfer must not break the group (a rank that stops iterating
leaves the others in a gather forever), so:

1. the posting ranks run the init and `/start_weight_update` first, and every rank learns whether they all worked
   (an exchange): on a refusal (the CPU build, a missing flag, an NCCL group that cannot form) nothing is gathered;
2. if a bucket fails later, the ranks learn it at that bucket's exchange and keep iterating without sharing or
   sending, so every gather still has all its ranks;
3. the failure comes back as a string (never an exception, which would take the group down), the same on every
   rank, and the server falls back to the disk.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from servers.engines.weight_transfer import (
    TransferTarget,
    WeightPusher,
    WeightTransferError,
    attempt,
    first_failure,
    replica_posts,
)
from servers.trainers.fsdp_state import iter_full_weights

__all__ = ["push_sharded"]


def push_sharded(model: torch.nn.Module, aliases: dict[str, str], dtype: torch.dtype, target: TransferTarget,
                 pusher: WeightPusher) -> str | None:
    """Push `model`'s full weights (gathered in `dtype`, tied aliases left out) to `target`'s replicas; a
    collective: every rank calls it with its own `pusher`. Returns why the transfer failed (the same on every rank),
    or None."""
    rank = dist.get_rank()
    try:
        posts = replica_posts(target, dist.get_world_size())
    except WeightTransferError as exc:  # pure: every rank refuses alike, before any collective
        return f"{type(exc).__name__}: {exc}"
    mine = [post for post in posts if post.poster == rank]
    failure = first_failure(exchange(attempt(pusher.begin, target, mine)))
    if failure is not None:
        return failure
    named = iter_full_weights(model, aliases, dtype)
    if target.backend == "ipc":
        try:
            pusher.send_ipc(target, posts, named, exchange, rank)  # its exchanges: it fails alike on every rank
        except WeightTransferError as exc:
            failure = str(exc)
    else:
        failure = attempt(pusher.send_nccl, target, mine, named) if mine else None
    for _ in named:  # the other ranks' share of every gather, and the senders' after a failed bucket
        pass
    return first_failure(exchange(failure))


def exchange(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (a collective)."""
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
