"""Loaded INSIDE the vLLM subprocess (its own virtualenv), through `vllm_lead`: the forced-call constraint for vLLM's
V1 model runner (the CPU build 0.32 runs it; the CUDA build where Model Runner V2 does not apply). Imported only
where vLLM has the V1 logits-processor interface.

V1 hands each request its live output list (`process_dict_updates`: vLLM appends each token to it) and calls
`apply(logits)` on the batch. It takes the raw logprobs before the processors run (`Sampler.forward`, 0.32), so the
logprobs recorded stay the raw model's.
"""

from __future__ import annotations

import torch
from lead_tokens import hold_to_lead, lead_from_strings
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

LEAD_ARG = "marl_lead"  # vllm_http.LEAD_ARG

Lead = tuple[tuple[int, ...], ...]


class LeadConstraintV1(LogitsProcessor):
    """Per batch row (a request with a lead): its sequences and its live list of output tokens."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        lead_of(sampling_params)  # ValueError: vLLM answers 400

    def __init__(self, vllm_config: object, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[Lead, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes greedy picks too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, _row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (lead, output) in list(self.rows.items()):
            if not hold_to_lead(logits, row, lead, output):
                del self.rows[row]  # spelled one long ago: free from now on
        return logits


def _row(params: SamplingParams, _prompt: list[int] | None, output: list[int]) -> tuple[Lead, list[int]] | None:
    """A new request's row: its lead and its live output list (vLLM appends each token to it), or None."""
    lead = lead_of(params)
    return (lead, output) if lead else None


def lead_of(params: SamplingParams) -> Lead:
    """A request's lead from its `vllm_xargs` (none: empty); ValueError when malformed."""
    extra = params.extra_args or {}
    return lead_from_strings(extra[LEAD_ARG]) if LEAD_ARG in extra else ()
