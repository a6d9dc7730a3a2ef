"""A simulated inference engine: token ids after the delays a real GPU engine would take, with no model at all.

For benchmarks of marl's control plane (leases, ledger, train loop, HTTP) at GPU-cluster load on a CPU, and for
tests: `marl serve --engine simulated [--simulated-speed X]`. Never a user's run (the topology does not offer it).
The model directory is read only for its tokenizer, chat template, context length and eos ids.

The latency model (`LatencyModel`, defaults for vLLM serving a 7-8B model, e.g. Llama-3-8B or Qwen2.5-7B in bf16, on
one H100). These are APPROXIMATIONS: orders of magnitude from vLLM's published serving benchmarks (the vLLM
performance dashboard and its v0.6 release blog, Llama-3-8B on one H100), not measurements made here:

- inter-token time ITL(n) = itl_base_s + itl_per_seq_s * n for n running sequences: ~6.5 ms per decode step at
  batch 1, growing roughly linearly to ~28 ms at 256 running sequences (vLLM's default max_num_seqs);
- time to first token TTFT(p, n) = ttft_base_s + p / prefill_tokens_per_s + ITL(n): prefill at ~15k tokens/s
  (published figures run 10-20k for a 7B on one H100), plus a fixed scheduling overhead, and the decode step of the
  running batch that the prefill shares (chunked prefill);
- a weight load (a trainer's new weights) takes weight_load_s, ~2 s for 15 GB of bf16 weights.

Concurrent requests as one batch: each sequence sleeps ITL(n) per token, n read again at every token. n sequences
then advance n tokens per ITL(n), the throughput of one batched decode step, without a shared clock; the simpler of
the two, and exact whenever n is steady. A generation nobody streams (`SamplingParams.stream` False) sleeps
`UNSTREAMED_STEPS_PER_WAKE` steps at a time, n read again at each, and comes back as one chunk at its end, at the
same time as the streamed one's last token: 256 running sequences would otherwise wake the server's loop 9,000
times a second. At most `max_running` sequences run; more wait for a slot, as in vLLM.
`speed` divides every delay (1.0: real time; 100: a hundred times faster, for tests).

A reply copies the prompt's own tokens, in order from a random place among its last `ECHO_WINDOW` plain (not
special) tokens, with negative logprobs: so envs' parsers meet words they know (an item's name, a player's number)
and some moves are valid and some rewards differ, as with a real model, where random ids would make every move fall
back the same way (and every GRPO group score alike). A generation stops at max_tokens ("length"), or earlier at a
random length ending with an eos id ("stop"), seeded by `SamplingParams.seed` and the prompt when a seed is given.
Weight and adapter loads are counted, not applied; they still drain the running generations first, as the interface
demands. A request that waits for a slot sleeps until one is handed to it, oldest first. Everything runs on the
server's event loop (asyncio.sleep only); the blocking calls (loads, close) come from worker threads.
"""

from __future__ import annotations

import asyncio
import collections
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marl.protocol import LoraSpec
from servers.backends import GenerationChunk, InferenceEngine, SamplingParams
from servers.engines.model_limits import context_length, eos_token_ids

#: A reply copies the prompt from a random place among its last this many plain tokens (the latest observation).
ECHO_WINDOW = 64
#: Without a reader of every token (`SamplingParams.stream` False) a sequence sleeps this many decode steps at once:
#: one wake-up where there were this many (what the server's loop spent on the simulation, not on marl's own work).
UNSTREAMED_STEPS_PER_WAKE = 16

__all__ = ["LatencyModel", "SimulatedEngine", "SimulatedStats", "simulated_engine_factory"]

_Waiter = tuple[asyncio.AbstractEventLoop, asyncio.Future]


@dataclass(frozen=True)
class LatencyModel:
    """Delays of a GPU engine (see the module docstring for the defaults' sources); `speed` divides them all."""

    ttft_base_s: float = 0.015
    prefill_tokens_per_s: float = 15_000.0
    itl_base_s: float = 0.0065
    itl_per_seq_s: float = 0.000085
    weight_load_s: float = 2.0
    speed: float = 1.0

    def __post_init__(self) -> None:
        if not self.speed > 0 or not self.prefill_tokens_per_s > 0:
            raise ValueError(f"speed and prefill_tokens_per_s must be > 0, got {self.speed}, "
                             f"{self.prefill_tokens_per_s}")

    def itl(self, running: int) -> float:
        """Seconds per decode step (one token of every running sequence) with `running` sequences."""
        return (self.itl_base_s + self.itl_per_seq_s * max(running, 1)) / self.speed

    def ttft(self, prompt_tokens: int, running: int) -> float:
        """Seconds to the first token of a `prompt_tokens` prompt joining `running` sequences (itself included)."""
        prefill = self.ttft_base_s + prompt_tokens / self.prefill_tokens_per_s
        return prefill / self.speed + self.itl(running)

    def weight_load(self) -> float:
        return self.weight_load_s / self.speed


@dataclass
class SimulatedStats:
    """Counters of the engine (read from any thread). `prefilled_tokens` and `cached_tokens` are what /metrics reads."""

    prefilled_tokens: int = 0
    cached_tokens: int = 0  # no prefix cache is simulated: always 0
    generated_tokens: int = 0
    finished_requests: int = 0
    running: int = 0  # sequences generating now
    waiting: int = 0  # requests waiting for a slot or for a weight swap to end
    max_running: int = 0  # most sequences that ever ran at once
    weight_loads: int = 0
    adapter_loads: int = 0
    training_steps: int = 0  # before_training_step calls


class SimulatedEngine(InferenceEngine):
    """Serves generations of a latency model (module docstring); `tokenizer` as every engine's."""

    serves_adapters = True

    def __init__(self, model_dir: str | Path, *, latency: LatencyModel | None = None, max_running: int = 256,
                 mean_completion_tokens: float = 200.0, tokenizer: Any | None = None) -> None:  # fmt: skip
        from transformers import AutoConfig

        from servers.model_files import load_tokenizer

        self.model_dir = Path(model_dir)
        self.latency = latency or LatencyModel()
        self.max_running = max_running
        self.mean_completion_tokens = mean_completion_tokens
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.model_dir)
        config = AutoConfig.from_pretrained(self.model_dir).get_text_config()
        self.context_length = context_length(config, self.tokenizer)
        self.eos_token_ids = eos_token_ids(_generation_config(self.model_dir), config, self.tokenizer)
        self.vocab_size = max(len(self.tokenizer), int(getattr(config, "vocab_size", 0) or 0))
        self._special = set(self.tokenizer.all_special_ids) | set(self.eos_token_ids)
        self._plain_ids = [i for i in range(len(self.tokenizer)) if i not in self._special]
        self.stats = SimulatedStats()
        self.adapters: dict[str, LoraSpec] = {}
        self._lock = threading.Condition()
        self._swapping = 0  # weight or adapter loads waiting for the running sequences to drain
        self._waiters: collections.deque[_Waiter] = collections.deque()  # requests waiting for a slot, oldest first
        self._closed = False

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        limit = self._checked(prompt_ids, params)
        rng = random.Random(hash((params.seed, *prompt_ids)) if params.seed is not None else None)
        stop_at = 1 + int(rng.expovariate(1.0 / self.mean_completion_tokens))  # beyond `limit`: "length"
        echo = [i for i in prompt_ids if i not in self._special][-ECHO_WINDOW:] or self._plain_ids
        start = rng.randrange(len(echo))
        source = echo[start:] + echo[:start]  # the reply's ids, in the prompt's order, from a random place
        await self._admit()
        try:
            self.stats.prefilled_tokens += len(prompt_ids)
            await asyncio.sleep(self.latency.ttft(len(prompt_ids), self.stats.running))
            completion: list[int] = []
            chunk = GenerationChunk([], [])
            owed = 0  # decode steps of the tokens made since the last sleep (the first token's is in the TTFT)
            while True:
                token, finish = self._next_token(source, completion, stop_at, limit, params)
                self.stats.generated_tokens += 1
                chunk.token_ids.append(token)
                chunk.logprobs.append(-0.01 - rng.expovariate(1.0))
                if owed and (finish or params.stream or owed >= UNSTREAMED_STEPS_PER_WAKE):
                    await asyncio.sleep(owed * self.latency.itl(self.stats.running))
                    owed = 0
                if finish:
                    chunk.finish_reason = finish
                    self.stats.finished_requests += 1
                    yield chunk
                    return
                if params.stream:
                    yield chunk
                    chunk = GenerationChunk([], [])
                owed += 1
        finally:
            with self._lock:
                self.stats.running -= 1
                self._hand_over()
                self._lock.notify_all()

    def _next_token(self, source: list[int], completion: list[int], stop_at: int, limit: int,
                    params: SamplingParams) -> tuple[int, str | None]:  # fmt: skip
        """The next id (appended to `completion`) and why the generation ends with it (None: it goes on)."""
        if len(completion) + 1 == stop_at and self.eos_token_ids:
            completion.append(min(self.eos_token_ids))
            return completion[-1], "stop"
        completion.append(source[len(completion) % len(source)])
        if len(completion) >= limit:
            return completion[-1], "length"
        if params.stop and _hits_stop(self.tokenizer, completion, params.stop):
            return completion[-1], "stop"
        return completion[-1], None

    def _checked(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """The most tokens this request may generate; ValueError for a bad request, as the torch engine's."""
        self._check_open()
        if not prompt_ids:
            raise ValueError("the prompt is empty: at least one token id is needed")
        if len(prompt_ids) >= self.context_length:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; this model's context length is"
                             f" {self.context_length}")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        if params.adapter is not None and params.adapter not in self.adapters:
            raise ValueError(f"no LoRA adapter named {params.adapter!r} is loaded (loaded: {sorted(self.adapters)})")
        return min(params.max_tokens, self.context_length - len(prompt_ids))

    async def _admit(self) -> None:
        """Take a running slot once one is free and no weight swap waits (a swap drains the running ones first);
        in arrival order. A waiting request is woken only when a slot is handed to it (no polling: a thousand
        waiting requests would otherwise wake the server's loop hundreds of thousands of times a second)."""
        with self._lock:
            self._check_open()
            if not self._waiters and self._slot_free():
                self._take_slot()
                return
            waiter = (asyncio.get_running_loop(), asyncio.get_running_loop().create_future())
            self._waiters.append(waiter)
            self.stats.waiting += 1
        try:
            await waiter[1]  # resolved by `_hand_over` with the slot already taken for it, or failed by `close`
        except BaseException:
            with self._lock:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                    self.stats.waiting -= 1
                elif not self._closed:  # a slot was handed over as it gave up: hand it on
                    self.stats.running -= 1
                    self._hand_over()
                    self._lock.notify_all()
            raise

    def _slot_free(self) -> bool:
        return not self._swapping and self.stats.running < self.max_running

    def _take_slot(self) -> None:
        self.stats.running += 1
        self.stats.max_running = max(self.stats.max_running, self.stats.running)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    def _hand_over(self) -> None:
        """Under the lock (from the loop or a swap's thread): give the free slots to the oldest waiters."""
        while self._waiters and self._slot_free():
            loop, future = self._waiters.popleft()
            self.stats.waiting -= 1
            self._take_slot()
            loop.call_soon_threadsafe(_resolve, future, None)

    def _drained_swap(self, apply: Callable[[], None], seconds: float) -> None:
        """Hold new generations back, wait for the running ones to finish, then `apply` after `seconds` (slept
        without the lock: the event loop takes it briefly to admit and end generations)."""
        with self._lock:
            self._swapping += 1
        try:
            with self._lock:
                self._lock.wait_for(lambda: self.stats.running == 0 or self._closed)
            time.sleep(seconds)
            apply()
        finally:
            with self._lock:
                self._swapping -= 1
                self._hand_over()

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        self._drained_swap(self._count_weights, self.latency.weight_load())

    def load_weights_from(self, directory: Path) -> None:
        if not Path(directory).is_dir():
            raise FileNotFoundError(f"no weights directory {directory}")
        self._drained_swap(self._count_weights, self.latency.weight_load())

    def _count_weights(self) -> None:
        self.stats.weight_loads += 1

    def load_adapter(self, name: str, tensors: Mapping[str, Any], spec: LoraSpec) -> None:
        def apply() -> None:
            self.adapters[name] = spec
            self.stats.adapter_loads += 1

        self._drained_swap(apply, 0.0)

    def load_adapter_from(self, name: str, directory: Path) -> None:
        from servers.backends import lora_spec_in

        self.load_adapter(name, {}, lora_spec_in(directory))

    def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(name)
        self._drained_swap(lambda: self.adapters.pop(name), 0.0)

    def before_training_step(self) -> None:
        self.stats.training_steps += 1

    def close(self) -> None:
        with self._lock:
            self._closed = True
            while self._waiters:
                loop, future = self._waiters.popleft()
                self.stats.waiting -= 1
                loop.call_soon_threadsafe(_resolve, future, RuntimeError("the engine is closed"))
            self._lock.notify_all()

    @property
    def running_requests(self) -> int:
        return self.stats.running


def _resolve(future: asyncio.Future, error: Exception | None) -> None:
    if future.done():  # cancelled: the waiter hands its slot on itself (`_admit`)
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _generation_config(model_dir: Path) -> Any:
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json
        return None


def _hits_stop(tokenizer: Any, token_ids: list[int], stops: tuple[str, ...]) -> bool:
    """Whether the completion's tail now contains a stop string (as the torch engine decides it)."""
    window = max(len(s) for s in stops) + 4
    text = tokenizer.decode(token_ids[-window:], skip_special_tokens=True)
    return any(s and s in text for s in stops)


def simulated_engine_factory(speed: float = 1.0) -> Callable[[Path], SimulatedEngine]:
    """`marl serve --engine simulated`: the default latency model, `speed` times faster than real time."""

    def build(model_dir: Path) -> SimulatedEngine:
        return SimulatedEngine(model_dir, latency=LatencyModel(speed=speed))

    return build
