"""One generation request of the torch engine, between the caller's event loop and the engine's worker thread.

`generate` runs on the server's event loop and must not block; the model runs on the worker thread. A request is
their meeting point: the worker posts chunks (or an error) through `loop.call_soon_threadsafe` onto the request's
asyncio.Queue, and the caller awaits them with `next_chunk`. A caller that stops listening sets `cancelled`, and the
worker drops the request at its next step. The request also knows when it is finished (`finish_reason`).
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from servers.backends import GenerationChunk, SamplingParams

__all__ = ["Request", "new_request", "seeded_generator"]


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    max_new_tokens: int  # params.max_tokens, capped by the context length
    eos_token_ids: frozenset[int]  # the engine's when the request was made
    token_ids: list[int] = field(default_factory=list)
    cancelled: bool = False  # set by the consumer's side; the worker drops the request at the next step
    done: bool = False  # set by the worker once the last chunk (or an error) was posted

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter this request generates with (None: the base model)."""
        return self.params.adapter

    def post(self, item: GenerationChunk | BaseException) -> None:
        """Hand a chunk or an error to the consumer's event loop (thread-safe)."""
        if isinstance(item, BaseException) or item.finish_reason is not None:
            self.done = True
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
            self.cancelled = True

    async def next_chunk(self) -> GenerationChunk:
        """The tokens posted since the last call (raises the worker's error, if it posted one).

        A consumer slower than the worker gets the backlog as one chunk rather than many small ones.
        """
        item = await self.queue.get()
        while not isinstance(item, BaseException) and item.finish_reason is None and not self.queue.empty():
            nxt = self.queue.get_nowait()
            if isinstance(nxt, BaseException):
                item = nxt
                break
            item = GenerationChunk(item.token_ids + nxt.token_ids, item.logprobs + nxt.logprobs, nxt.finish_reason)
        if isinstance(item, BaseException):
            raise item
        return item

    def finish_reason(self, tokenizer: Any) -> str | None:
        """Why the request is finished after its newest token ("stop", "length"), or None if it goes on."""
        if self.token_ids[-1] in self.eos_token_ids:
            return "stop"
        if self.params.stop and _hits_stop(tokenizer, self.token_ids, self.params.stop):
            return "stop"
        if len(self.token_ids) >= self.max_new_tokens:
            return "length"
        return None


def new_request(
    prompt_ids: list[int], params: SamplingParams, *, vocab_size: int, context_length: int,
    eos_token_ids: frozenset[int],
) -> Request:  # fmt: skip
    """A request for the running event loop; ValueError for a bad prompt or bad sampling parameters."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: at least one token id is needed")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    if len(prompt) >= context_length:
        raise ValueError(f"the prompt has {len(prompt)} tokens; this model's context length is {context_length}")
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
    if not (params.temperature >= 0 and math.isfinite(params.temperature)):
        raise ValueError(f"temperature must be a finite number >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if not all(seq and all(0 <= t < vocab_size for t in seq) for seq in params.lead):
        raise ValueError(f"lead sequences must be non-empty token ids in [0, {vocab_size})")
    return Request(
        prompt_ids=prompt,
        params=params,
        generator=seeded_generator(params.seed),
        loop=asyncio.get_running_loop(),
        queue=asyncio.Queue(),
        max_new_tokens=min(params.max_tokens, context_length - len(prompt)),
        eos_token_ids=eos_token_ids,
    )


def seeded_generator(seed: int | None) -> torch.Generator:
    """A request's own random stream: `seed`, or a random one when None.

    A CPU generator on every device: a seed means the same random numbers on a laptop and on a GPU server.
    """
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else random.getrandbits(63))
    return generator


def _hits_stop(tokenizer: Any, token_ids: list[int], stops: tuple[str, ...]) -> bool:
    """Whether the decoded completion now contains a stop string (decoding only its tail: O(1) per token).

    Every token decodes to at least one character, so the last len(stop) + a few tokens cover any stop string
    that the newest token can have completed.
    """
    window = max(len(s) for s in stops) + 4
    text = tokenizer.decode(token_ids[-window:], skip_special_tokens=True)
    return any(s and s in text for s in stops)
