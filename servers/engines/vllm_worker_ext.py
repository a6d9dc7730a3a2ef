"""Loaded INSIDE the vLLM subprocess (its own virtualenv): a worker extension for in-place weight reloads, and for
the memory reading before the KV cache wakes (`marl_wake_memory`).

vLLM imports this class by name (`--worker-extension-cls servers.engines.vllm_worker_ext.WeightReload`) into each
of its workers, so this module may import nothing of marl or servers beyond itself: only what the vLLM venv has.

Why it exists: vLLM's own `reload_weights` reloads a safetensors directory in place, but on the CPU build a tied
`lm_head` keeps the pre-packed copy of the old embedding that was made at start-up (logprobs then differ by ~0.2
from the new weights; docs/backends.md, "vLLM: reloading weights in place"). Re-running the head's
`process_weights_after_loading` rebuilds that copy from the reloaded weight (idempotent, a few ms; a no-op on GPU
builds).
"""

from __future__ import annotations


class WeightReload:
    """Mixed into vLLM's worker class; called through `/collective_rpc` with plain strings only (never tensors:
    they would arrive as lists, and a half-done reload kills the engine)."""

    def marl_reload_weights(self, weights_path: str) -> None:
        """Serve the HF safetensors in `weights_path` from now on (the caller paused generation first)."""
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]  # the vLLM worker's method
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        lm_head = getattr(model, "lm_head", None)
        quant_method = getattr(lm_head, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(lm_head)

    def marl_wake_memory(self) -> dict:
        """Before `/wake_up?tags=kv_cache` (servers.engines.wake_memory): this worker's GPU, its free bytes, the
        bytes of KV cache asleep (sleep mode's allocator maps exactly those again) and the processes holding memory
        there. Plain numbers and strings only (collective_rpc answers JSON); `free_bytes` None off CUDA."""
        import torch

        if not torch.cuda.is_available():
            return {"gpu": None, "free_bytes": None, "kv_cache_bytes": 0, "holders": []}
        from vllm.device_allocator.cumem import CuMemAllocator

        allocations = CuMemAllocator.get_instance().pointer_to_data.values()
        asleep = sum(int(data.handle[1]) for data in allocations if data.tag == "kv_cache" and data.is_asleep)
        device = torch.cuda.current_device()
        return {"gpu": device, "free_bytes": int(torch.cuda.mem_get_info(device)[0]), "kv_cache_bytes": asleep,
                "holders": _holders(device)}


def _holders(device: int) -> list[dict]:
    """The processes holding memory on `device`, from NVML (vLLM's CUDA build installs it); [] when it cannot say."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        return [{"pid": int(p.pid), "bytes": int(p.usedGpuMemory or 0)}
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
    except Exception:  # noqa: BLE001 - only a better message is lost
        return []
