"""Loaded INSIDE the vLLM subprocess (its own virtualenv): the logits processor that holds a generation to its
`SamplingParams.lead` (a forced tool call's declared function names).

vLLM imports it by name (`--logits-processors vllm_lead:LeadConstraint`, found on PYTHONPATH = this directory), so it
imports nothing of marl but `lead_tokens`, which imports torch alone. A request names its sequences in `vllm_xargs`
(`vllm_http.LEAD_ARG`); until its output has spelled one, every token but those that continue one is masked.

Why a logits processor: vLLM takes the raw logprobs before it applies them and after it applies the structured-output
bitmask (`Sampler.forward`, 0.32), so the logprobs recorded stay the raw model's, as the torch engine's do; a
`choice` constraint would have renormalised them over the names.
"""

from __future__ import annotations

import torch
from lead_tokens import allowed_next, keep_only, lead_from_strings
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

LEAD_ARG = "marl_lead"  # vllm_http.LEAD_ARG

Lead = tuple[tuple[int, ...], ...]


class LeadConstraint(LogitsProcessor):
    """Per batch row (a request with a lead): its sequences and its live list of output tokens."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        _lead(sampling_params)  # ValueError: vLLM answers 400

    def __init__(self, vllm_config: object, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[Lead, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes greedy picks too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, _row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (lead, output) in list(self.rows.items()):
            allowed = allowed_next(lead, output)
            if allowed is None:
                if len(output) > max(len(seq) for seq in lead):
                    del self.rows[row]  # spelled one long ago: free from now on
                continue
            keep_only(logits, row, allowed)
        return logits


def _row(params: SamplingParams, _prompt: list[int] | None, output: list[int]) -> tuple[Lead, list[int]] | None:
    """A new request's row: its lead and its live output list (vLLM appends each token to it), or None."""
    lead = _lead(params)
    return (lead, output) if lead else None


def _lead(params: SamplingParams) -> Lead:
    extra = params.extra_args or {}
    return lead_from_strings(extra[LEAD_ARG]) if LEAD_ARG in extra else ()
