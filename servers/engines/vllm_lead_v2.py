"""Loaded INSIDE the vLLM subprocess (its own virtualenv), through `vllm_lead`: the forced-call constraint for vLLM's
Model Runner V2 (vLLM 0.33's default on CUDA), whose loader accepts only subclasses of
`vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor`. Imported only where vLLM has that interface; it
imports nothing else of vLLM, so it loads in vLLM's frontend too (which validates each request's arguments).

V2 differs from V1 in what it hands a processor: a request is a persistent slot (`add_request(slot, params)`, no
removal: a recycled slot is added again), `apply(logits, ctx)` sees the batch's rows with `ctx.expanded_idx_mapping`
(row -> slot), and the committed output is read from the runner's `req_states` (`all_token_ids[slot, prompt_len:
total_len]`, on the device), plus, under speculative decoding, the row's draft tokens before it in `ctx.input_ids`
(as vLLM's own bad-words processor reads them). The sampler copies the logits before any processor runs and takes
raw logprobs from the original (`Sampler.apply_sampling_params`, 0.33), so the logprobs recorded stay the model's.

Reading the output costs one device sync per step in which some row still has a lead (its first few tokens only);
steps without one read nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from lead_tokens import hold_to_lead, lead_from_strings
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcessor, LogitsProcRequestState

LEAD_ARG = "marl_lead"  # vllm_http.LEAD_ARG

Lead = tuple[tuple[int, ...], ...]


class LeadConstraintV2(LogitsProcessor):
    """The leads of the request slots whose output may still be held."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        lead_of(sampling_params)  # ValueError: vLLM answers 400

    def __init__(self, vllm_config: Any, req_states: LogitsProcRequestState) -> None:
        self.req_states = req_states
        self.leads: dict[int, Lead] = {}

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        lead = lead_of(sampling_params)
        if lead:
            self.leads[req_idx] = lead
        else:
            self.leads.pop(req_idx, None)  # the slot's previous request may have had one
        return bool(lead)

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if not self.leads or not any(int(slot) in self.leads for slot in ctx.idx_mapping_np):
            return logits  # no row held: no device read
        slots = ctx.expanded_idx_mapping.tolist()
        local = ctx.expanded_local_pos.tolist()
        total = self.req_states.total_len.gpu.tolist()
        for row, slot in enumerate(slots):
            if (lead := self.leads.get(slot)) is None:
                continue
            committed = self._committed(slot, total[slot], max(len(seq) for seq in lead) + 1)
            drafts = ctx.input_ids[row - local[row] + 1:row + 1].tolist() if local[row] else []
            if not hold_to_lead(logits, row, lead, committed + drafts) and not drafts:
                del self.leads[slot]  # spelled one long ago: free from now on
        return logits

    def _committed(self, slot: int, total_len: int, at_most: int) -> list[int]:
        """The slot's committed output tokens, the first `at_most` (more cannot change a lead's outcome)."""
        start = int(self.req_states.prompt_len.np[slot])
        end = min(total_len, start + at_most)
        return self.req_states.all_token_ids.gpu[slot, start:end].tolist() if end > start else []


def lead_of(params: Any) -> Lead:
    """A request's lead from its `vllm_xargs` (none: empty); ValueError when malformed."""
    extra = getattr(params, "extra_args", None) or {}
    return lead_from_strings(extra[LEAD_ARG]) if LEAD_ARG in extra else ()
