"""Loaded INSIDE the vLLM subprocess (its own virtualenv): the logits processor that holds a generation to its
`SamplingParams.lead` (a forced tool call's declared function names). A request names its sequences in `vllm_xargs`
(`vllm_http.LEAD_ARG`); until its output has spelled one, every token but those that continue one is masked.

vLLM imports it by name (`--logits-processors vllm_lead:LeadConstraint`, found on PYTHONPATH = this directory) and
loads it through the loader of the model runner it picked at start: Model Runner V2's (0.33's default on CUDA) takes
only subclasses of its own `LogitsProcessor` and builds them as `(vllm_config, req_states)`; V1's (the CPU build, or
CUDA with a feature V2 lacks) takes its `LogitsProcessor` and builds them as `(vllm_config, device,
is_pin_memory)`. Which one runs is vLLM's decision (`VllmConfig.use_v2_model_runner`: Triton, the features asked,
VLLM_USE_V2_MODEL_RUNNER) and is known only inside vLLM, so `LeadConstraint` subclasses every interface this vLLM has
and, when vLLM builds it, becomes the implementation of the interface whose constructor was called
(`vllm_lead_v2.LeadConstraintV2` or `vllm_lead_v1.LeadConstraintV1`); each is imported only where its base exists.
Both mask with `lead_tokens.hold_to_lead`, after vLLM took the raw logprobs.

Why a logits processor: a `choice` constraint (vLLM's structured outputs) masks before the logprobs are taken, which
would renormalise them over the names.
"""

from __future__ import annotations

from typing import Any

IMPLEMENTATIONS: dict[str, type] = {}  # "v1" / "v2" -> the class, where vLLM has that interface
try:
    from vllm_lead_v2 import LeadConstraintV2, LogitsProcRequestState

    IMPLEMENTATIONS["v2"] = LeadConstraintV2
except ImportError:  # a vLLM before Model Runner V2
    LogitsProcRequestState = None
try:
    from vllm_lead_v1 import LeadConstraintV1

    IMPLEMENTATIONS["v1"] = LeadConstraintV1
except ImportError:  # a vLLM without the V1 interface
    pass

if not IMPLEMENTATIONS:
    raise ImportError("this vLLM has neither logits-processor interface marl knows (V1 nor Model Runner V2)")


def _implementation(args: tuple[Any, ...]) -> type:
    """The class of the interface whose constructor vLLM called: V2 passes `req_states`, V1 a device and a flag."""
    v2 = LogitsProcRequestState is not None and len(args) == 1 and isinstance(args[0], LogitsProcRequestState)
    return IMPLEMENTATIONS["v2" if v2 else "v1"]


class LeadConstraint(*[base for cls in IMPLEMENTATIONS.values() for base in cls.__bases__]):
    """What vLLM loads: a subclass of each interface's base (so either loader accepts it) that builds the
    implementation of the interface that constructs it. Never an instance itself."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        next(iter(IMPLEMENTATIONS.values())).validate_params(sampling_params)  # the same rule in both

    def __new__(cls, vllm_config: Any, *args: Any) -> Any:
        return _implementation(args)(vllm_config, *args)  # not a LeadConstraint: Python skips __init__
