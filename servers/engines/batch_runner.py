"""The model side of the torch engine's steps: the forward passes, and what each sampled token does.

The engine's worker thread decides *when* (which requests join, when the batch steps, what a failure takes down);
`BatchRunner` does the step itself: prefill newcomers into a batch of their own (together, or one prompt on top of
its cached prefix), advance the running batch by one token, then sample, stream each token to its request, retire
finished requests and keep their keys/values in the prefix cache. It owns no thread, no queue and no lock.
Every forward tells the LoRA adapters (servers.engines.multi_lora) which adapter each of its rows uses, read off
the rows' requests at that moment, so rows and adapters stay aligned however the batch was reordered.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

from servers.backends import GenerationChunk
from servers.engines.multi_lora import MultiLora
from servers.engines.prefix_cache import CachedPrefix, PrefixCache
from servers.engines.request import Request
from servers.engines.running_batch import RunningBatch, SlabLayer
from servers.engines.sampling import raw_logprobs, sample_tokens

__all__ = ["BatchRunner", "EngineStats"]

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters of the worker (read them from any thread; they only grow)."""

    prefill_forwards: int = 0  # forward passes over newly admitted prompts
    decode_forwards: int = 0  # one-token steps of the running batch
    generated_tokens: int = 0
    finished_requests: int = 0
    failed_requests: int = 0
    max_batch: int = 0  # largest number of requests one decode step advanced
    weight_loads: int = 0
    adapter_loads: int = 0  # LoRA adapters loaded or replaced
    prefilled_tokens: int = 0  # prompt tokens run through the model
    cached_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache instead

    @property
    def forwards(self) -> int:
        return self.prefill_forwards + self.decode_forwards


class BatchRunner:
    """Prefill and decode forwards of a causal LM over `RunningBatch`es (called by the engine's worker only).

    Every step returns the batch without the requests it finished (None when none is left).
    """

    def __init__(
        self, model: Any, tokenizer: Any, *, device: torch.device, pad_token_id: int, stats: EngineStats,
        prefix_cache: PrefixCache | None, lora: MultiLora | None = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.tokenizer = tokenizer  # decodes completions for stop strings
        self.device = device
        self.pad_token_id = pad_token_id
        self.stats = stats
        self.prefix_cache = prefix_cache
        self.lora = lora

    def cached_prefix(self, request: Request) -> tuple[CachedPrefix, int] | None:
        """The cached prefix (of the request's adapter) its prompt extends and how many of its tokens to reuse
        (None: prefill it all)."""
        if self.prefix_cache is None:
            return None
        return self.prefix_cache.lookup(request.prompt_ids, request.adapter)

    def _rows(self, requests: list[Request]) -> contextlib.AbstractContextManager[None]:
        """The next forward's rows use their requests' adapters."""
        if self.lora is None:
            return contextlib.nullcontext()
        return self.lora.rows([r.adapter for r in requests])

    def prefill(self, group: list[Request]) -> RunningBatch | None:
        """Prefill the prompts of `group` in one left-padded forward and sample their first token.

        Returns them as a batch of their own (without those already finished), ready to join the running one.
        """
        longest = max(len(r.prompt_ids) for r in group)
        input_ids = torch.full((len(group), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(group), longest), dtype=torch.long)
        for row, request in enumerate(group):
            n = len(request.prompt_ids)
            input_ids[row, longest - n :] = torch.tensor(request.prompt_ids)
            mask[row, longest - n :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        self.stats.prefilled_tokens += sum(len(r.prompt_ids) for r in group)
        # Positions count real tokens only, so a padded row sees exactly the positions of an unpadded forward.
        position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = Cache(layer_class_to_replicate=SlabLayer)
        with self._rows(group):
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        self.stats.prefill_forwards += 1
        fresh = RunningBatch(
            requests=group,
            layers=list(cache.layers),  # type: ignore[arg-type]
            mask=mask,
            positions=mask.sum(dim=1),
            next_tokens=torch.zeros(len(group), dtype=torch.long, device=self.device),
        )
        return self._sample_and_emit(fresh, out.logits[:, -1, :])

    def prefill_on_prefix(self, request: Request, prefix: CachedPrefix, reused: int) -> RunningBatch | None:
        """Prefill only what `request`'s prompt adds to the first `reused` tokens of a cached prefix."""
        total, suffix = len(request.prompt_ids), request.prompt_ids[reused:]
        spare = len(suffix) + request.max_new_tokens
        layers = [SlabLayer.holding(k[:, :reused], v[:, :reused], spare) for k, v in zip(prefix.keys, prefix.values)]
        mask = torch.ones((1, total), dtype=torch.long, device=self.device)
        with self._rows([request]):
            out = self.model(
                input_ids=torch.tensor([suffix], dtype=torch.long, device=self.device),
                attention_mask=mask,
                position_ids=torch.arange(reused, total, device=self.device)[None],
                past_key_values=Cache(layers=list(layers)),
                use_cache=True,
                logits_to_keep=1,
            )
        self.stats.prefill_forwards += 1
        self.stats.prefilled_tokens += len(suffix)
        self.stats.cached_tokens += reused
        fresh = RunningBatch(
            requests=[request],
            layers=layers,
            mask=mask,
            positions=torch.tensor([total], device=self.device),
            next_tokens=torch.zeros(1, dtype=torch.long, device=self.device),
        )
        return self._sample_and_emit(fresh, out.logits[:, -1, :])

    def decode(self, batch: RunningBatch) -> RunningBatch | None:
        """One forward of every running request on its last token (cancelled requests leave first)."""
        kept = batch.keep([i for i, r in enumerate(batch.requests) if not r.cancelled])
        if kept is None:
            return None
        ones = torch.ones((len(kept.requests), 1), dtype=kept.mask.dtype, device=kept.mask.device)
        kept.mask = torch.cat([kept.mask, ones], dim=1)
        with self._rows(kept.requests):
            out = self.model(
                input_ids=kept.next_tokens[:, None],
                attention_mask=kept.mask,
                position_ids=kept.positions[:, None],
                past_key_values=kept.cache(),
                use_cache=True,
                logits_to_keep=1,
            )
        kept.positions = kept.positions + 1
        self.stats.decode_forwards += 1
        self.stats.max_batch = max(self.stats.max_batch, len(kept.requests))
        return self._sample_and_emit(kept, out.logits[:, -1, :])

    def _sample_and_emit(self, batch: RunningBatch, logits: torch.Tensor) -> RunningBatch | None:
        """Pick each row's next token, stream it to its request, and return the batch without finished rows."""
        logits = logits.float()
        tokens = sample_tokens(logits, batch.requests)
        logprobs = raw_logprobs(logits, tokens)
        batch.next_tokens = tokens
        keep: list[int] = []
        rows = zip(batch.requests, tokens.tolist(), logprobs.tolist(), strict=True)
        for row, (request, token, logprob) in enumerate(rows):
            if request.cancelled:
                continue
            request.token_ids.append(token)
            finish = request.finish_reason(self.tokenizer)
            # Counters first: a consumer that sees its last chunk may read them at once.
            self.stats.generated_tokens += 1
            if finish is None:
                keep.append(row)
            else:
                self.stats.finished_requests += 1
            if finish is not None and self.prefix_cache is not None:
                try:
                    self._remember(batch, row, request)  # before the last chunk: the next call may follow at once
                except Exception:  # noqa: BLE001 - e.g. out of memory: the cache is an optimisation, never a failure
                    log.warning("prefix cache: could not keep a finished request's keys/values", exc_info=True)
            request.post(GenerationChunk([token], [logprob], finish))
        return batch.keep(keep)

    def _remember(self, batch: RunningBatch, row: int, request: Request) -> None:
        """Copy a finished row's keys/values into the prefix cache: its prompt and all but its last token (the
        last one was sampled, never fed back)."""
        cache = self.prefix_cache
        tokens = request.prompt_ids + request.token_ids[:-1]
        if cache is None or not cache.accepts(len(tokens)):
            return
        cache.insert(tokens, *batch.copy_row(row, len(tokens)), adapter=request.adapter)
