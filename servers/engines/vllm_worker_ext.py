"""Loaded INSIDE the vLLM subprocess (its own virtualenv): a worker extension for in-place weight reloads.

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
