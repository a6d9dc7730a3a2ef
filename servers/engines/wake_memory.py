"""Whether vLLM's KV cache fits in what its GPUs have free before it wakes, and if not, why: plain arithmetic on the
readings vLLM's workers report (`vllm_worker_ext.WeightReload.marl_wake_memory`), so it runs and is tested without a
GPU.

vLLM sizes its KV cache once, at start (`gpu_memory_utilization` x total, or `kv_cache_gb`), and a wake
(`/wake_up?tags=kv_cache`) maps exactly the blocks it dropped at sleep. If the trainer's processes on that GPU still
hold more than the share left (fp32 shards, AdamW state, NCCL buffers, IPC blocks not reclaimed), the wake hits CUDA
out-of-memory inside vLLM's engine core, which dies, and its restart fails the same free-memory check. So the engine
asks first, and refuses the wake with one line naming each short GPU, what holds its memory, and the setting to lower.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["WAKE_MARGIN_BYTES", "wake_problem"]

#: Room kept beyond the KV cache's blocks: the CUDA context's growth and the allocator's rounding (an estimate).
WAKE_MARGIN_BYTES = 256 * 2**20


def wake_problem(readings: Sequence[dict[str, Any]], setting: str, margin: int = WAKE_MARGIN_BYTES) -> str | None:
    """One line saying why the KV cache cannot wake (None: it fits on every GPU, or a worker could not tell, e.g.
    the CPU build). Each reading: `gpu`, `free_bytes`, `kv_cache_bytes` (asleep, to be mapped again) and `holders`,
    the processes holding memory on that GPU as `{"pid", "bytes"}`."""
    short = [reading for reading in readings if _short(reading, margin)]
    if not short:
        return None
    parts = [f"GPU {r['gpu']}: {_gib(r['free_bytes'])} free, the KV cache needs {_gib(r['kv_cache_bytes'])}"
             f" (+{_gib(margin)}); held by {_holders(r.get('holders') or [])}" for r in short]
    return (f"vLLM's KV cache would not fit when it wakes ({'; '.join(parts)}): lower {setting} (vLLM's share of each"
            " GPU, sized at start), or what the trainer keeps on those GPUs between steps")


def _short(reading: dict[str, Any], margin: int) -> bool:
    free, needed = reading.get("free_bytes"), reading.get("kv_cache_bytes")
    return free is not None and bool(needed) and free < needed + margin


def _holders(holders: Sequence[dict[str, Any]]) -> str:
    if not holders:
        return "processes the driver did not name"
    ranked = sorted(holders, key=lambda h: -int(h.get("bytes") or 0))
    return ", ".join(f"pid {h['pid']}{' (' + h['name'] + ')' if h.get('name') else ''} {_gib(h.get('bytes') or 0)}"
                     for h in ranked)


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
