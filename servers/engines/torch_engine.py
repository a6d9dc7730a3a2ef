"""The embedded inference backend: a transformers causal LM served with continuous batching, on CPU or GPU.

Many agents call one model at once, and one decode step over 16 sequences costs far less than 16 steps over one
(the weights are read once per step), so concurrent `generate` calls share forward passes:

- One worker thread owns the model. `generate` queues a request and awaits its tokens on an asyncio.Queue that the
  worker feeds through `loop.call_soon_threadsafe`.
- At every step boundary the worker admits waiting requests: their prompts are prefilled together (left padded),
  their first token is sampled, and their rows join the running batch. Finished or cancelled requests leave the
  batch at once. One decode step then advances every running request by one token.
- The running batch shares one KV cache per layer (`_SlabLayer`): row i holds request i's tokens right-aligned,
  the padding on their left is masked out, and each row carries its own position ids, so RoPE and attention see
  exactly what an unpadded forward pass of that request sees (in fp32, logprobs match one to ~2e-5 on SmolLM2).
- The cache buffers have spare rows and columns: a decode step writes one column instead of re-copying the cache
  as `torch.cat` (transformers' DynamicCache) does, which on a CPU costs about as much as the step at a few
  hundred tokens; joining rows are written in place and a leaving row is overwritten by the last one.
- On CPUs where it is faster (timed at start-up), decode-time Linear layers compute W @ x.T instead of x @ W.T.
- A finished request's keys/values go to a prefix cache (servers.engines.prefix_cache). A prompt that extends one
  (an agent's next turn) is prefilled in a forward of its own on top of a copy of them, and joins the batch.

Why not transformers' own continuous batching (`generate_batch` / paged attention)? In 5.23 it samples with one
global RNG and one do_sample flag for the whole batch, and its logprobs are taken after temperature and top-p:
per-request seeds, greedy next to sampled requests, and raw-logit logprobs (what the trainer needs) would mean
patching its internals. The design here needs only the public model forward and Cache API.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import threading
import time
import types
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import Cache, DynamicLayer

from servers.engines.prefix_cache import CachedPrefix, PrefixCache
from servers.interfaces import GenerationChunk, InferenceEngine, SamplingParams
from servers.models import load_tokenizer

__all__ = ["EngineStats", "TorchEngine"]

log = logging.getLogger(__name__)

# Padded tokens of one prefill forward (rows x longest prompt): bounds the activation memory of admitting many long
# prompts at once, and how long running requests stall while newcomers are prefilled.
_PREFILL_TOKEN_BUDGET = 16384

# Memory for the keys/values of finished conversations (see prefix_cache): about 45k tokens of SmolLM2-135M in fp32.
DEFAULT_PREFIX_CACHE_BYTES = 2 * 2**30


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
    prefilled_tokens: int = 0  # prompt tokens run through the model
    cached_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache instead

    @property
    def forwards(self) -> int:
        return self.prefill_forwards + self.decode_forwards


# ----------------------------------------------------------------------------------------------------------------
# KV cache of the running batch
# ----------------------------------------------------------------------------------------------------------------


class _SlabLayer(DynamicLayer):
    """Keys and values of one attention layer for a batch, in buffers with spare rows and columns.

    Row r holds request r's tokens right-aligned in columns [0, length), left padding masked (and zero, never
    uninitialised: a masked column gets zero attention weight, but 0 * NaN is NaN). `keys`/`values` are the views
    [:rows, :, :length] that attention reads. The spare capacity makes the frequent operations cheap: a decode step
    writes one column, joining requests write their own rows, a leaving request is overwritten by the last row.
    Only growth past the capacity (doubling) and a newcomer longer than the batch copy the whole cache.
    """

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, spare_columns: int) -> _SlabLayer:
        """A one-row layer holding a copy of [heads, columns, dim] `keys`/`values`, with room to grow."""
        layer = cls()
        layer.lazy_initialization(keys[None], values[None])
        layer._reserve(1, keys.shape[-2] + spare_columns)
        layer.update(keys[None], values[None])
        return layer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        rows, heads, _, dim = key_states.shape
        self._k = key_states.new_empty((rows, heads, 0, dim))
        self._v = value_states.new_empty((rows, value_states.shape[1], 0, value_states.shape[-1]))
        self.rows = rows
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert key_states.shape[0] == self.rows, "batch rows and cache rows disagree"
        end = self.length + key_states.shape[-2]
        self._reserve(self.rows, end)
        assert self._k is not None and self._v is not None
        self._k[: self.rows, :, self.length : end] = key_states
        self._v[: self.rows, :, self.length : end] = value_states
        self.length = end
        self._publish()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add rows whose [rows, heads, columns, dim] keys/values are right-aligned (another batch's cache)."""
        assert self._k is not None and self._v is not None
        added, columns = keys.shape[0], keys.shape[-2]
        if columns > self.length:  # the newcomers are longer: move the running rows right
            shift = columns - self.length
            self._reserve(self.rows, columns)
            for buf in (self._k, self._v):
                buf[: self.rows, :, shift:columns] = buf[: self.rows, :, : self.length].clone()
                buf[: self.rows, :, :shift] = 0
            self.length = columns
        self._reserve(self.rows + added, self.length)
        pad, end = self.length - columns, self.rows + added
        for buf, new in ((self._k, keys), (self._v, values)):
            buf[self.rows : end, :, :pad] = 0
            buf[self.rows : end, :, pad : self.length] = new
        self.rows = end
        self._publish()

    def move_rows(self, destinations: torch.Tensor, sources: torch.Tensor, rows: int) -> None:
        """Copy rows `sources` over rows `destinations`, then keep the first `rows` rows."""
        assert self._k is not None and self._v is not None
        if destinations.numel():
            self._k[destinations, :, : self.length] = self._k[sources, :, : self.length]
            self._v[destinations, :, : self.length] = self._v[sources, :, : self.length]
        self.rows = rows
        self._publish()

    def trim_left(self, columns: int) -> None:
        """Forget the first `columns` columns (padding for every row): a view, no copy."""
        assert self._k is not None and self._v is not None
        self._k, self._v = self._k[:, :, columns:], self._v[:, :, columns:]
        self.length -= columns
        self._publish()

    def _reserve(self, rows: int, columns: int) -> None:
        assert self._k is not None and self._v is not None
        row_capacity, column_capacity = self._k.shape[0], self._k.shape[2]
        if rows <= row_capacity and columns <= column_capacity:
            return
        if rows > row_capacity:
            row_capacity = max(rows, 2 * row_capacity)
        if columns > column_capacity:
            column_capacity = max(columns, 2 * column_capacity, 64)
        k = self._k.new_empty((row_capacity, self._k.shape[1], column_capacity, self._k.shape[-1]))
        v = self._v.new_empty((row_capacity, self._v.shape[1], column_capacity, self._v.shape[-1]))
        k[: self.rows, :, : self.length] = self._k[: self.rows, :, : self.length]
        v[: self.rows, :, : self.length] = self._v[: self.rows, :, : self.length]
        self._k, self._v = k, v

    def _publish(self) -> None:
        assert self._k is not None and self._v is not None
        self.keys = self._k[: self.rows, :, : self.length]
        self.values = self._v[: self.rows, :, : self.length]


@dataclass
class _Batch:
    """Requests being decoded together, and their shared KV cache (row i of every tensor is requests[i])."""

    requests: list[_Request]
    layers: list[_SlabLayer]
    mask: torch.Tensor  # [rows, length] 1 where the cache column is a real token of that row
    positions: torch.Tensor  # [rows] position id of each row's next input token
    next_tokens: torch.Tensor  # [rows] each row's last sampled token: the next decode input

    def cache(self) -> Cache:
        return Cache(layers=list(self.layers))

    def absorb(self, other: _Batch) -> None:
        """Append the rows of `other` (just prefilled) to this batch."""
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.append(theirs.keys, theirs.values)
        length = max(self.mask.shape[1], other.mask.shape[1])
        pad = torch.nn.functional.pad
        self.mask = torch.cat([pad(m, (length - m.shape[1], 0)) for m in (self.mask, other.mask)])
        self.positions = torch.cat([self.positions, other.positions])
        self.next_tokens = torch.cat([self.next_tokens, other.next_tokens])
        self.requests = self.requests + other.requests

    def keep(self, rows: list[int]) -> _Batch | None:
        """Keep only `rows` (in any order): the rows past the end move into the holes left by the others."""
        if not rows:
            return None
        if len(rows) == len(self.requests):
            return self
        kept, remaining = set(rows), len(rows)
        holes = [i for i in range(remaining) if i not in kept]
        movers = [i for i in range(remaining, len(self.requests)) if i in kept]
        order = list(range(remaining))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        device = self.mask.device
        destinations = torch.tensor(holes, dtype=torch.long, device=device)
        sources = torch.tensor(movers, dtype=torch.long, device=device)
        for layer in self.layers:
            layer.move_rows(destinations, sources, remaining)
        index = torch.tensor(order, dtype=torch.long, device=device)
        self.requests = [self.requests[i] for i in order]
        self.mask = self.mask.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.next_tokens = self.next_tokens.index_select(0, index)
        # When the longest request leaves, columns that are padding for every remaining row stop costing attention.
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else 0
        if start:
            self.mask = self.mask[:, start:]
            for layer in self.layers:
                layer.trim_left(start)
        return self


# ----------------------------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    max_new_tokens: int  # params.max_tokens, capped by the context length
    token_ids: list[int] = field(default_factory=list)
    cancelled: bool = False  # set by the consumer's side; the worker drops the request at the next step
    done: bool = False  # set by the worker once the last chunk (or an error) was posted

    def post(self, item: GenerationChunk | BaseException) -> None:
        """Hand a chunk or an error to the consumer's event loop (thread-safe)."""
        if isinstance(item, BaseException) or item.finish_reason is not None:
            self.done = True
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
            self.cancelled = True


# ----------------------------------------------------------------------------------------------------------------
# Engine
# ----------------------------------------------------------------------------------------------------------------


class TorchEngine(InferenceEngine):
    """A transformers causal LM behind a continuous-batching worker thread (see the module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        max_batch_size: int = 64,
        tokenizer: Any | None = None,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    ) -> None:
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        # fp32 on CPU: bf16 matmuls are slow on most CPUs and logprobs must match a training forward closely.
        self.dtype = dtype if dtype is not None else (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.model_dir = Path(model_dir)

        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype).to(self.device).eval()
        #: Whether decode steps use the CPU matmul variant that is faster for few rows (timed at start-up).
        self.weight_major_matmul = self.device.type == "cpu" and _use_weight_major_matmul_if_faster(self.model)
        config = self.model.config.get_text_config()
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 0) or 2048
        tokenizer_limit = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(tokenizer_limit, int) and 0 < tokenizer_limit < self.context_length:
            self.context_length = tokenizer_limit  # "sensible": GGUF/legacy tokenizers report 1e30 for "no limit"
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else min(self.eos_token_ids, default=0)

        per_token = _kv_bytes_per_token(config, self.dtype)
        #: Keys/values of finished generations, reused by prompts that extend them (None: disabled, 0 bytes).
        self.prefix_cache = PrefixCache(prefix_cache_bytes // per_token) if prefix_cache_bytes > 0 else None
        self.stats = EngineStats()
        self._cv = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._batch: _Batch | None = None  # owned by the worker thread
        self._swap_requests = 0  # load_weights callers waiting for the worker to drain
        self._swap_lock = threading.Lock()
        self._worker_idle = False  # the worker is parked with no running batch
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="marl-torch-engine", daemon=True)
        self._worker.start()

    # ---------------------------------------------------------------- public API

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        """Stream the generation of one request (see `InferenceEngine.generate`).

        Raises ValueError for a bad prompt or bad sampling parameters before anything is queued. Generation stops
        with "length" at `max_tokens` or at the context length, whichever comes first; with "stop" at an eos token
        (included in `token_ids`) or when the decoded completion contains one of `params.stop` (the token that
        completed it is included; cutting the text is the caller's business).
        """
        request = self._make_request(prompt_ids, params)
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._waiting.append(request)
            self._cv.notify_all()
        try:
            while True:
                item = await request.queue.get()
                # A consumer slower than the worker gets the backlog as one chunk rather than many small ones.
                while not isinstance(item, BaseException) and item.finish_reason is None and not request.queue.empty():
                    nxt = request.queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        item = nxt
                        break
                    item = GenerationChunk(item.token_ids + nxt.token_ids, item.logprobs + nxt.logprobs,
                                           nxt.finish_reason)  # fmt: skip
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            # Reached on normal completion, on an error, and when the consumer stops iterating or its task is
            # cancelled (client disconnected): a request nobody reads must stop using the batch.
            if not request.done:
                request.cancelled = True

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Copy `named_tensors` (names as in `model.state_dict()`) into the served model.

        Blocks until the requests already running have finished on the old weights (a generation never mixes two
        policies), then copies. Requests that arrive meanwhile wait in the queue and run on the new weights.
        Names and shapes are all checked before anything is copied: a bad update changes nothing. Call it from a
        thread other than the event loop's if requests may still be running.
        """
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        updates: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, tensor in named_tensors:
            target = targets.get(name)
            if target is None:
                raise ValueError(f"load_weights: the served model has no tensor named {name!r}")
            tensor = torch.as_tensor(tensor)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                )
            updates.append((target, tensor))

        with self._swap_lock:  # one swap at a time
            with self._cv:
                self._swap_requests += 1
                self._cv.notify_all()
            try:
                with self._cv:
                    while not (self._worker_idle or self._closed):
                        self._cv.wait()
                    if self._closed:
                        raise RuntimeError("the engine is closed")
                # The worker stays parked while _swap_requests > 0 (it admits nothing and has nothing running), so
                # the copy runs without the lock: generate() callers can keep queueing meanwhile.
                if self.prefix_cache is not None:
                    self.prefix_cache.clear()  # computed by the old weights
                with torch.no_grad():
                    for target, tensor in updates:
                        target.copy_(tensor.to(device=target.device, dtype=target.dtype))
                self.stats.weight_loads += 1
            finally:
                with self._cv:
                    self._swap_requests -= 1
                    self._cv.notify_all()

    def close(self) -> None:
        """Stop the worker; requests still queued or running fail with RuntimeError."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._worker.is_alive() and threading.current_thread() is not self._worker:
            self._worker.join()

    @property
    def running_requests(self) -> int:
        """Requests in the running batch (being decoded)."""
        batch = self._batch
        return len(batch.requests) if batch is not None else 0

    @property
    def waiting_requests(self) -> int:
        """Requests queued for admission (the batch is full, or a weight swap is pending)."""
        return len(self._waiting)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- request intake

    def _make_request(self, prompt_ids: list[int], params: SamplingParams) -> _Request:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt is empty: at least one token id is needed")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if len(prompt) >= self.context_length:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; this model's context length is {self.context_length}"
            )
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        if not (params.temperature >= 0 and math.isfinite(params.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {params.temperature}")
        if not 0 < params.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
        # A CPU generator on every device: a seed means the same random numbers on a laptop and on a GPU server.
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
        return _Request(
            prompt_ids=prompt,
            params=params,
            generator=generator,
            loop=asyncio.get_running_loop(),
            queue=asyncio.Queue(),
            max_new_tokens=min(params.max_tokens, self.context_length - len(prompt)),
        )

    # ---------------------------------------------------------------- worker thread

    @torch.inference_mode()  # the whole worker thread: no autograd bookkeeping, and cache tensors stay writable
    def _run(self) -> None:
        try:
            while (admitted := self._wait_for_work()) is not None:
                if admitted:
                    self._admit(admitted)
                if self._batch is not None:
                    try:
                        self._decode()
                    except Exception as error:  # noqa: BLE001 - a failed step fails its requests, never the worker
                        victims, self._batch = self._batch.requests, None
                        self._step_failed(error, victims)
        finally:
            with self._cv:
                self._closed = True
                leftovers = list(self._waiting) + (self._batch.requests if self._batch is not None else [])
                self._waiting.clear()
                self._batch = None
                self._worker_idle = True
                self._cv.notify_all()
            self._fail(leftovers, RuntimeError("the engine is closed"))

    def _admit(self, group: list[_Request]) -> None:
        """Prefill `group` and add it to the running batch: prompts extending a cached prefix one by one on top
        of it, the others together in one forward."""
        misses = []
        for request in group:
            hit = self.prefix_cache.lookup(request.prompt_ids) if self.prefix_cache is not None else None
            if hit is None:
                misses.append(request)
            else:
                self._join([request], functools.partial(self._prefill_on_prefix, request, *hit))
        if misses:
            self._join(misses, functools.partial(self._prefill, misses))

    def _join(self, requests: list[_Request], prefill: Callable[[], _Batch | None]) -> None:
        try:
            fresh = prefill()
        except Exception as error:  # noqa: BLE001 - e.g. out of memory on a long prompt
            self._step_failed(error, requests)  # the running batch is untouched and goes on
            return
        if fresh is None:
            return
        if self._batch is None:
            self._batch = fresh
            return
        try:
            self._batch.absorb(fresh)
        except Exception as error:  # noqa: BLE001 - the batch may be half-merged: drop it all
            victims = fresh.requests + self._batch.requests
            self._batch = None
            self._step_failed(error, victims)

    def _step_failed(self, error: Exception, victims: list[_Request]) -> None:
        log.exception("torch engine step failed; failing %d request(s)", len(victims), exc_info=error)
        self._fail(victims, RuntimeError(f"generation failed: {type(error).__name__}: {error}"))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _wait_for_work(self) -> list[_Request] | None:
        """Block until there is something to do; return the requests to admit now (None: shut down)."""
        with self._cv:
            while True:
                if self._closed:
                    return None
                # Cancelled requests that were never admitted leave without costing a forward pass.
                if any(r.cancelled for r in self._waiting):
                    self._waiting = deque(r for r in self._waiting if not r.cancelled)
                running = len(self._batch.requests) if self._batch is not None else 0
                # While a weight swap waits, nothing new starts: the running batch drains, then the worker parks.
                admissible = self._swap_requests == 0 and bool(self._waiting) and running < self.max_batch_size
                if running or admissible:
                    self._worker_idle = False
                    return self._take_prefill_group(self.max_batch_size - running) if admissible else []
                self._worker_idle = True
                self._cv.notify_all()
                self._cv.wait()

    def _take_prefill_group(self, slots: int) -> list[_Request]:
        """Pop waiting requests (FIFO) for one prefill forward, within `slots` and the padded-token budget."""
        group: list[_Request] = []
        longest = 0
        while self._waiting and len(group) < slots:
            candidate = max(longest, len(self._waiting[0].prompt_ids))
            if group and candidate * (len(group) + 1) > _PREFILL_TOKEN_BUDGET:
                break
            longest = candidate
            group.append(self._waiting.popleft())
        return group

    def _prefill(self, group: list[_Request]) -> _Batch | None:
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
        cache = Cache(layer_class_to_replicate=_SlabLayer)
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.stats.prefill_forwards += 1
        fresh = _Batch(
            requests=group,
            layers=list(cache.layers),  # type: ignore[arg-type]
            mask=mask,
            positions=mask.sum(dim=1),
            next_tokens=torch.zeros(len(group), dtype=torch.long, device=self.device),
        )
        return self._sample_and_emit(fresh, out.logits[:, -1, :])

    def _prefill_on_prefix(self, request: _Request, prefix: CachedPrefix, reused: int) -> _Batch | None:
        """Prefill only what `request`'s prompt adds to the first `reused` tokens of a cached prefix."""
        total, suffix = len(request.prompt_ids), request.prompt_ids[reused:]
        spare = len(suffix) + request.max_new_tokens
        layers = [_SlabLayer.holding(k[:, :reused], v[:, :reused], spare) for k, v in zip(prefix.keys, prefix.values)]
        mask = torch.ones((1, total), dtype=torch.long, device=self.device)
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
        fresh = _Batch(
            requests=[request],
            layers=layers,
            mask=mask,
            positions=torch.tensor([total], device=self.device),
            next_tokens=torch.zeros(1, dtype=torch.long, device=self.device),
        )
        return self._sample_and_emit(fresh, out.logits[:, -1, :])

    def _decode(self) -> None:
        """One forward of every running request on its last token."""
        batch = self._batch
        assert batch is not None
        batch = batch.keep([i for i, r in enumerate(batch.requests) if not r.cancelled])
        self._batch = batch
        if batch is None:
            return
        ones = torch.ones((len(batch.requests), 1), dtype=batch.mask.dtype, device=batch.mask.device)
        batch.mask = torch.cat([batch.mask, ones], dim=1)
        out = self.model(
            input_ids=batch.next_tokens[:, None],
            attention_mask=batch.mask,
            position_ids=batch.positions[:, None],
            past_key_values=batch.cache(),
            use_cache=True,
            logits_to_keep=1,
        )
        batch.positions = batch.positions + 1
        self.stats.decode_forwards += 1
        self.stats.max_batch = max(self.stats.max_batch, len(batch.requests))
        self._batch = self._sample_and_emit(batch, out.logits[:, -1, :])

    def _sample_and_emit(self, batch: _Batch, logits: torch.Tensor) -> _Batch | None:
        """Pick each row's next token, stream it to its request, and return the batch without finished rows."""
        logits = logits.float()
        tokens = _sample(logits, batch.requests)
        # The logprob the trainer recomputes: raw logits, temperature 1, no top-p.
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        batch.next_tokens = tokens
        keep: list[int] = []
        rows = zip(batch.requests, tokens.tolist(), logprobs.tolist(), strict=True)
        for row, (request, token, logprob) in enumerate(rows):
            if request.cancelled:
                continue
            request.token_ids.append(token)
            finish = self._finish_reason(request, token)
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

    def _remember(self, batch: _Batch, row: int, request: _Request) -> None:
        """Copy a finished row's keys/values into the prefix cache: its prompt and all but its last token (the
        last one was sampled, never fed back)."""
        cache = self.prefix_cache
        tokens = request.prompt_ids + request.token_ids[:-1]
        if cache is None or not cache.accepts(len(tokens)):
            return
        start = batch.mask.shape[1] - len(tokens)  # rows are right-aligned: the row's tokens end the cache
        keys = [layer.keys[row, :, start:].clone() for layer in batch.layers]
        values = [layer.values[row, :, start:].clone() for layer in batch.layers]
        cache.insert(tokens, keys, values)

    def _finish_reason(self, request: _Request, token: int) -> str | None:
        if token in self.eos_token_ids:
            return "stop"
        if request.params.stop and _hits_stop(self.tokenizer, request.token_ids, request.params.stop):
            return "stop"
        if len(request.token_ids) >= request.max_new_tokens:
            return "length"
        return None

    def _fail(self, requests: Iterable[_Request], error: BaseException) -> None:
        for request in requests:
            if not request.done:
                self.stats.failed_requests += 1
                request.post(error)


# ----------------------------------------------------------------------------------------------------------------
# CPU matmul for few rows
# ----------------------------------------------------------------------------------------------------------------

# Above this many rows (prefill of long prompts) the usual x @ W.T is as fast or faster.
_WEIGHT_MAJOR_MAX_ROWS = 128


def _weight_major_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if not 2 <= rows <= _WEIGHT_MAJOR_MAX_ROWS or not torch.is_inference_mode_enabled():
        return torch.nn.functional.linear(x, self.weight, self.bias)
    y = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).t()).t()
    if self.bias is not None:
        y = y + self.bias
    return y.contiguous().view(*x.shape[:-1], self.weight.shape[0])


def _use_weight_major_matmul_if_faster(model: torch.nn.Module) -> bool:
    """On CPUs where W @ x.T beats x @ W.T for a few rows, make the model's Linear layers use it at decode time.

    Measured on a 2-core AMD EPYC with MKL: with 2-64 rows each matmul is 1.3-2.5x faster this way (the
    49k-vocabulary lm_head of SmolLM2 at 16 rows: 54 ms -> 34 ms), and matmuls are ~80% of a decode step. Other
    CPUs and BLAS libraries differ, so it is timed once at start-up on the largest layer and kept only where it
    wins.
    Only inference-mode calls (the engine's worker) take the other path; gradients and other callers see the
    usual nn.Linear.
    """
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if not linears:
        return False
    largest = max(linears, key=lambda m: m.weight.numel())
    x = torch.randn(16, largest.in_features, dtype=largest.weight.dtype)

    def best_of(fn: Any) -> float:
        timings = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            timings.append(time.perf_counter() - start)
        return min(timings)

    with torch.inference_mode():
        usual = best_of(lambda: torch.nn.functional.linear(x, largest.weight))
        weight_major = best_of(lambda: torch.mm(largest.weight, x.t()).t().contiguous())
    if weight_major > 0.8 * usual:
        return False
    for module in linears:
        module.forward = types.MethodType(_weight_major_linear, module)  # type: ignore[method-assign]
    log.info("CPU decode uses W @ x.T (%.1f ms vs %.1f ms on the largest layer)", weight_major * 1e3, usual * 1e3)
    return True


# ----------------------------------------------------------------------------------------------------------------
# Sampling helpers
# ----------------------------------------------------------------------------------------------------------------


def _sample(logits: torch.Tensor, requests: list[_Request]) -> torch.Tensor:
    """Next token per row: argmax at temperature 0, else a draw from the row's own generator after top-p.

    Each sampled row takes exactly one uniform number per token from its request's generator (inverse-CDF
    sampling), so a seeded request gets the same tokens whatever else shares its batch, up to the float noise of
    batched matmuls. (torch.multinomial costs ~2 ms per row over a 49k vocabulary on a CPU; this costs ~0.1 ms.)
    """
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


def _hits_stop(tokenizer: Any, token_ids: list[int], stops: tuple[str, ...]) -> bool:
    """Whether the decoded completion now contains a stop string (decoding only its tail: O(1) per token).

    Every token decodes to at least one character, so the last len(stop) + a few tokens cover any stop string
    that the newest token can have completed.
    """
    window = max(len(s) for s in stops) + 4
    text = tokenizer.decode(token_ids[-window:], skip_special_tokens=True)
    return any(s and s in text for s in stops)


def _kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token takes in the cache, over all layers."""
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Token ids that end a generation: the generation config's (else the model config's), plus the tokenizer's.

    Chat checkpoints name the end-of-turn token in one place or the other; stopping at either is what a chat
    server wants.
    """
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    for source in (generation_config, model.config if not _ids_of(generation_config) else None, tokenizer):
        ids.update(_ids_of(source))
    return frozenset(ids)


def _ids_of(source: Any) -> set[int]:
    value = getattr(source, "eos_token_id", None) if source is not None else None
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {int(v) for v in value}
    return set()
