"""The embedded inference backend: a transformers causal LM served with continuous batching, on CPU or GPU.

Many agents call one model at once, and one decode step over 16 sequences costs far less than 16 steps over one
(the weights are read once per step), so concurrent `generate` calls share forward passes:

- One worker thread owns the model. `generate` queues a request and awaits its tokens, which the worker streams to
  the caller's event loop (servers.engines.request).
- At every step boundary the worker admits waiting requests: their prompts are prefilled together (left padded),
  their first token is sampled, and their rows join the running batch. Finished or cancelled requests leave the
  batch at once. One decode step then advances every running request by one token (servers.engines.batch_runner;
  sampling with per-request seeds and raw-logit logprobs in servers.engines.sampling, which also holds a request to
  its `SamplingParams.lead`: a forced tool call's declared names).
- The running batch shares one KV cache per layer (servers.engines.running_batch): row i holds request i's tokens
  right-aligned, the padding on their left is masked out, and each row carries its own position ids, so RoPE and
  attention see exactly what an unpadded forward pass of that request sees (in fp32, logprobs match one to ~2e-5
  on SmolLM2).
- The cache buffers have spare rows and columns: a decode step writes one column instead of re-copying the cache
  as `torch.cat` (transformers' DynamicCache) does, which on a CPU costs about as much as the step at a few
  hundred tokens; joining rows are written in place and a leaving row is overwritten by the last one.
- On CPUs where it is faster (timed at start-up), decode-time Linear layers compute W @ x.T instead of x @ W.T
  (servers.engines.cpu_matmul).
- A finished request's keys/values go to a prefix cache (servers.engines.prefix_cache). A prompt that extends one
  (an agent's next turn) is prefilled in a forward of its own on top of a copy of them, and joins the batch.
- LoRA adapters (servers.engines.multi_lora): each request names its adapter (None: the base model) and every
  forward applies each row's own, so requests of many policies share one batch. Loading or replacing an adapter
  waits only for that adapter's running requests (its waiting ones are held back meanwhile) and happens between
  two forwards; the other adapters' and the base's requests keep running. Unloading one waits the same way and
  frees its slot for the next adapter loaded.

This module owns the scheduling: the queue of waiting requests, the worker thread, admission within the batch
size and a prefill token budget, failures that take down only the requests they touch, and weight swaps that wait
for the running batch to drain.

Why not transformers' own continuous batching (`generate_batch` / paged attention)? In 5.23 it samples with one
global RNG and one do_sample flag for the whole batch, and its logprobs are taken after temperature and top-p:
per-request seeds, greedy next to sampled requests, and raw-logit logprobs (what the trainer needs) would mean
patching its internals. The design here needs only the public model forward and Cache API.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Self

import torch
from transformers import AutoModelForCausalLM

from servers.backends import GenerationChunk, InferenceEngine, SamplingParams
from servers.engines.adapter_loads import AdapterLoads, AdapterServing, install
from servers.engines.batch_runner import BatchRunner, EngineStats
from servers.engines.cpu_matmul import use_weight_major_matmul_if_faster
from servers.engines.model_limits import context_length, eos_token_ids
from servers.engines.multi_lora import MultiLora
from servers.engines.prefix_cache import PrefixCache
from servers.engines.request import Request, new_request
from servers.engines.running_batch import RunningBatch
from servers.model_files import load_tokenizer

__all__ = ["DEFAULT_PREFIX_CACHE_BYTES", "EngineStats", "TorchEngine"]

log = logging.getLogger(__name__)

# Padded tokens of one prefill forward (rows x longest prompt): bounds the activation memory of admitting many long
# prompts at once, and how long running requests stall while newcomers are prefilled.
_PREFILL_TOKEN_BUDGET = 16384

# Memory for the keys/values of finished conversations (see prefix_cache): about 45k tokens of SmolLM2-135M in fp32.
DEFAULT_PREFIX_CACHE_BYTES = 2 * 2**30


class TorchEngine(AdapterServing, InferenceEngine):
    """A transformers causal LM behind a continuous-batching worker thread (see the module docstring)."""

    serves_adapters = True

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
        self.weight_major_matmul = self.device.type == "cpu" and use_weight_major_matmul_if_faster(self.model)
        config = self.model.config.get_text_config()
        self.context_length = context_length(config, self.tokenizer)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        #: Read when a request is made: it stops at the ids that were current then.
        self.eos_token_ids = eos_token_ids(getattr(self.model, "generation_config", None), self.model.config,
                                           self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else min(self.eos_token_ids, default=0)

        per_token = _kv_bytes_per_token(config, self.dtype)
        #: Keys/values of finished generations, reused by prompts that extend them (None: disabled, 0 bytes).
        self.prefix_cache = PrefixCache(prefix_cache_bytes // per_token) if prefix_cache_bytes > 0 else None
        self.stats = EngineStats()
        #: The LoRA adapters served next to the base model (hooks on its Linear layers, once one is loaded).
        self.lora = MultiLora(self.model)
        self._runner = BatchRunner(self.model, self.tokenizer, device=self.device, pad_token_id=self.pad_token_id,
                                   stats=self.stats, prefix_cache=self.prefix_cache, lora=self.lora)  # fmt: skip
        self._cv = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._batch: RunningBatch | None = None  # owned by the worker thread
        self._swap_requests = 0  # load_weights callers waiting for the worker to drain
        self._swap_lock = threading.Lock()
        self._adapter_loads = AdapterLoads()  # waiting for the worker to install them
        self._worker_idle = False  # the worker is parked with no running batch
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="marl-torch-engine", daemon=True)
        self._worker.start()

    # ---------------------------------------------------------------- public API

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        """Stream the generation of one request (see `InferenceEngine.generate`).

        Raises ValueError for a bad prompt, bad sampling parameters or an adapter that is not loaded, before
        anything is queued. Generation stops with "length" at `max_tokens` or at the context length, whichever
        comes first; with "stop" at an eos token (included in `token_ids`) or when the decoded completion contains
        one of `params.stop` (the token that completed it is included; cutting the text is the caller's business).
        """
        request = new_request(prompt_ids, params, vocab_size=self.vocab_size, context_length=self.context_length,
                              eos_token_ids=self.eos_token_ids)  # fmt: skip
        with self._cv:  # an unload purges the queue under the lock once the adapter is gone: checked here, with it
            if params.adapter not in self.lora:
                raise ValueError(f"no LoRA adapter named {params.adapter!r} is loaded (loaded:"
                                 f" {sorted(self.lora.names)})")
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._waiting.append(request)
            self._cv.notify_all()
        try:
            while True:
                chunk = await request.next_chunk()
                yield chunk
                if chunk.finish_reason is not None:
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
        updates = _checked_updates(self.model, named_tensors)
        with self._drained():
            if self.prefix_cache is not None:
                self.prefix_cache.clear()  # computed by the old weights
            with torch.no_grad():
                for target, tensor in updates:
                    target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            self.stats.weight_loads += 1

    def close(self) -> None:
        """Stop the worker; requests still queued or running fail with RuntimeError."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._worker.is_alive() and threading.current_thread() is not self._worker:
            self._worker.join()

    @property
    def numerics(self) -> str:
        """What its logprobs are computed in: transformers' forward in `dtype` ("torch.float32"), said as a trainer's
        `numerics` says it; the server compares the two to resolve `recompute_logprobs: auto`
        (servers.training.lifecycle)."""
        return str(self.dtype)

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

    @contextlib.contextmanager
    def _drained(self) -> Iterator[None]:
        """Hold the worker parked, with nothing running, for the duration (one swap at a time).

        The worker stays parked while _swap_requests > 0 (it admits nothing and has nothing running), so the body
        runs without the lock: generate() callers can keep queueing meanwhile.
        """
        with self._swap_lock:
            with self._cv:
                self._swap_requests += 1
                self._cv.notify_all()
            try:
                with self._cv:
                    while not (self._worker_idle or self._closed):
                        self._cv.wait()
                    if self._closed:
                        raise RuntimeError("the engine is closed")
                yield
            finally:
                with self._cv:
                    self._swap_requests -= 1
                    self._cv.notify_all()

    # ---------------------------------------------------------------- worker thread

    @torch.inference_mode()  # the whole worker thread: no autograd bookkeeping, and cache tensors stay writable
    def _run(self) -> None:
        try:
            while (admitted := self._wait_for_work()) is not None:
                self._install_adapters()
                if admitted:
                    self._admit(admitted)
                if self._batch is not None:
                    try:
                        self._batch = self._runner.decode(self._batch)
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
                self._adapter_loads.fail_all(RuntimeError("the engine is closed"))
                self._cv.notify_all()
            _fail(leftovers, RuntimeError("the engine is closed"), self.stats)

    def _wait_for_work(self) -> list[Request] | None:
        """Block until there is something to do; return the requests to admit now (None: shut down)."""
        with self._cv:
            while True:
                if self._closed:
                    return None
                # Cancelled requests that were never admitted leave without costing a forward pass.
                if any(r.cancelled for r in self._waiting):
                    self._waiting = deque(r for r in self._waiting if not r.cancelled)
                running = len(self._batch.requests) if self._batch is not None else 0
                held = self._adapter_loads.held()
                # While a weight swap waits, nothing new starts: the running batch drains, then the worker parks.
                admissible = (self._swap_requests == 0 and running < self.max_batch_size
                              and any(r.adapter not in held for r in self._waiting))  # fmt: skip
                if running or admissible or self._adapter_loads.installable(self._batch, self._swap_requests > 0):
                    self._worker_idle = False
                    if not admissible:
                        return []
                    return _pop_prefill_group(self._waiting, self.max_batch_size - running, held)
                self._worker_idle = True
                self._cv.notify_all()
                self._cv.wait()

    def _install_adapters(self) -> None:
        """Install the adapters that may be now, between two forwards (their tensors are copied outside the lock)."""
        with self._cv:
            loads = self._adapter_loads.installable(self._batch, self._swap_requests > 0)
            self._adapter_loads.take(loads)
        install(loads, self.lora, self.prefix_cache, self.stats)
        if any(load.adapter is None for load in loads):
            with self._cv:  # requests queued for an adapter now gone would fail a whole prefill group later
                gone = [r for r in self._waiting if r.adapter not in self.lora]
                self._waiting = deque(r for r in self._waiting if r.adapter in self.lora)
            _fail(gone, ValueError("its LoRA adapter was unloaded"), self.stats)

    def _admit(self, group: list[Request]) -> None:
        """Prefill `group` and add it to the running batch: prompts extending a cached prefix one by one on top
        of it, the others together in one forward."""
        misses = []
        for request in group:
            hit = self._runner.cached_prefix(request)
            if hit is None:
                misses.append(request)
            else:
                self._join([request], functools.partial(self._runner.prefill_on_prefix, request, *hit))
        if misses:
            self._join(misses, functools.partial(self._prefill, misses))

    def _prefill(self, group: list[Request]) -> RunningBatch | None:
        """The shared prefill of prompts without a cached prefix (the step whose failure `_join` contains)."""
        return self._runner.prefill(group)

    def _join(self, requests: list[Request], prefill: Callable[[], RunningBatch | None]) -> None:
        """Run `prefill` and merge its batch into the running one; a failure fails only what it touched."""
        self._batch = _joined(self._batch, requests, prefill, self._step_failed)

    def _step_failed(self, error: Exception, victims: list[Request]) -> None:
        log.exception("torch engine step failed; failing %d request(s)", len(victims), exc_info=error)
        _fail(victims, RuntimeError(f"generation failed: {type(error).__name__}: {error}"), self.stats)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _joined(batch: RunningBatch | None, requests: list[Request], prefill: Callable[[], RunningBatch | None],
            failed: Callable[[Exception, list[Request]], None]) -> RunningBatch | None:  # fmt: skip
    """`batch` with what `prefill` returns merged in; a failure fails only what it touched (`failed`)."""
    try:
        fresh = prefill()
    except Exception as error:  # noqa: BLE001 - e.g. out of memory on a long prompt
        failed(error, requests)  # the running batch is untouched and goes on
        return batch
    if fresh is None or batch is None:
        return fresh if batch is None else batch
    try:
        batch.absorb(fresh)
    except Exception as error:  # noqa: BLE001 - the batch may be half-merged: drop it all
        failed(error, fresh.requests + batch.requests)
        return None
    return batch


def _fail(requests: Iterable[Request], error: BaseException, stats: EngineStats) -> None:
    for request in requests:
        if not request.done:
            stats.failed_requests += 1
            request.post(error)


def _pop_prefill_group(waiting: deque[Request], slots: int, held: set[str | None]) -> list[Request]:
    """Pop waiting requests (FIFO) for one prefill forward, within `slots` and the padded-token budget; those of
    `held` adapters stay, in their order, at the front of the queue."""
    group: list[Request] = []
    skipped: list[Request] = []
    longest = 0
    while waiting and len(group) < slots:
        if waiting[0].adapter in held:
            skipped.append(waiting.popleft())
            continue
        candidate = max(longest, len(waiting[0].prompt_ids))
        if group and candidate * (len(group) + 1) > _PREFILL_TOKEN_BUDGET:
            break
        longest = candidate
        group.append(waiting.popleft())
    waiting.extendleft(reversed(skipped))
    return group


# ----------------------------------------------------------------------------------------------------------------
# What the engine reads off the model
# ----------------------------------------------------------------------------------------------------------------


def _checked_updates(model: torch.nn.Module, named_tensors: Iterable[tuple[str, Any]]) -> list[tuple[Any, Any]]:
    """(model tensor, new value) pairs, once every name and shape is known good (ValueError otherwise)."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
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
    return updates


def _kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token takes in the cache, over all layers."""
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
