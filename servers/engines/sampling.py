"""Choosing each row's next token, and the logprob recorded for it.

Per-request sampling is why the engine batches by itself rather than through transformers' `generate_batch`: every
request has its own temperature, top-p and seeded generator (greedy rows run next to sampled ones), and the logprob
recorded for a token is always that of the raw logits (temperature 1, no top-p), the number the trainer
recomputes (docs/design.md, "Recording exact tokens"). A request whose generation must begin with one of a few
token sequences (`SamplingParams.lead`: a forced tool call's declared names) samples from a masked copy of its row
until it has spelled one; its logprobs are still the raw logits'.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from servers.engines.lead_tokens import allowed_next, keep_only
from servers.engines.request import Request, seeded_generator  # seeded_generator: made with the request

__all__ = ["raw_logprobs", "sample_tokens", "seeded_generator"]


def raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax of the raw fp32 logits at each row's token: what the trainer's forward pass computes."""
    return torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)


def sample_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Next token per row: argmax at temperature 0, else a draw from the row's own generator after top-p.

    Each sampled row takes exactly one uniform number per token from its request's generator (inverse-CDF
    sampling), so a seeded request gets the same tokens whatever else shares its batch, up to the float noise of
    batched matmuls. (torch.multinomial costs ~2 ms per row over a 49k vocabulary on a CPU; this costs ~0.1 ms.)
    """
    logits = _led(logits, requests)
    tokens = logits.argmax(dim=-1)
    rows = [i for i, r in enumerate(requests) if r.params.temperature > 0 and not r.cancelled]
    if not rows:
        return tokens
    index = torch.tensor(rows, device=logits.device)
    temperature = torch.tensor([requests[i].params.temperature for i in rows], device=logits.device)
    probs = torch.softmax(logits.index_select(0, index) / temperature[:, None], dim=-1)
    uniforms = torch.cat([torch.rand(1, generator=requests[i].generator, dtype=torch.float64) for i in rows])
    uniforms = uniforms.to(logits.device)
    picks = _inverse_cdf(probs, uniforms)
    for j, i in enumerate(rows):
        top_p = requests[i].params.top_p
        if top_p < 1:
            picks[j] = _top_p_pick(probs[j], top_p, uniforms[j])
    tokens[index] = picks
    return tokens


def _led(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """The logits to sample from: a row that must still spell one of its `lead` sequences keeps only the tokens
    that continue one (in a copy: the caller takes the recorded logprobs from the raw logits)."""
    masked = None
    for row, request in enumerate(requests):
        allowed = allowed_next(request.params.lead, request.token_ids) if request.params.lead else None
        if allowed is None:
            continue
        if masked is None:
            masked = logits.clone()
        keep_only(masked, row, allowed)
    return logits if masked is None else masked


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index i with cdf[i-1] <= u * total < cdf[i], per row: zero-probability tokens can never be picked."""
    cdf = probs.double().cumsum(dim=-1)
    target = (uniforms * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _top_p_pick(probs: torch.Tensor, top_p: float, uniform: torch.Tensor) -> torch.Tensor:
    """Sample from the smallest set of most likely tokens whose probability reaches top_p (nucleus sampling).

    A full sort of a large vocabulary is slow on a CPU; the nucleus almost always lies within the top 1024
    tokens, so those are tried first and the full sort is only the fallback.
    """
    k = min(probs.shape[-1], 1024)
    sorted_probs, order = probs.topk(k)
    if k < probs.shape[-1] and float(sorted_probs.sum()) < top_p:
        sorted_probs, order = probs.sort(descending=True)
    # A token is dropped when the tokens ranked above it already reach top_p; the top token always stays.
    dropped = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    kept = sorted_probs.masked_fill(dropped, 0.0)
    return order[_inverse_cdf(kept[None], uniform[None])[0]]
