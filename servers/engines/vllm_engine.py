"""The vLLM inference backend: an `InferenceEngine` whose model runs in a vLLM subprocess (`marl serve --engine vllm`).

The server keeps doing what it does with any engine (chat templates, prompt splicing, recording, leases); this
engine only turns `generate(prompt_ids, params)` into a streamed `/v1/completions` call by token ids and hands back
vLLM's exact token ids and raw logprobs (servers.engines.vllm_http). vLLM's own continuous batching and automatic
prefix caching replace the torch engine's.

- The subprocess (servers.engines.vllm_process) starts in the constructor, which returns once vLLM is ready.
- Weights come as a directory (`takes_tensors = False`): `load_weights_from` keeps a copy of it (hard links when
  possible), then pauses vLLM until its running requests are done, reloads in place, empties the prefix cache and
  resumes. A generation therefore never mixes two policies, and requests that arrive meanwhile wait.
- Or, on CUDA, the trainer pushes its tensors through vLLM's weight-transfer engine (`push_weights`: ipc when vLLM
  shares the trainer's GPU, nccl when it has its own; `VLLMLaunch.weight_sync`), between the same pause and resume.
  A push that fails is logged and counted (`VLLMStats.weight_transfer_failures`), and this engine syncs through the
  directory from then on. Weights that came that way leave no copy to restart vLLM with: a vLLM that dies after
  one is not restarted (the engine is down; a new start resumes from the last checkpoint).
- Sleep mode (CUDA, when the trainer shares vLLM's GPU: `VLLMLaunch.sleeps_between_steps`): `before_training_step`
  puts vLLM to sleep (weights offloaded to host memory, KV cache dropped) so the trainer has the GPU, and the next
  weight load wakes the weights, reloads them and wakes the KV cache.
- A watcher thread waits on the subprocess. When it dies, requests running on it fail (an engine error: 5xx), new
  ones wait, and it is restarted once with the latest weights; if that fails, or it dies again, the engine is down
  and every call fails at once with the reason (until the engine is stopped and started again).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from servers.engines.model_limits import context_length, eos_token_ids
from servers.engines.vllm_http import (
    LoopClients,
    completion_body,
    generate_one_token,
    sleep_for_training,
    stream_completion,
    sync_weights,
    sync_weights_waking,
)
from servers.engines.vllm_process import VLLMLaunch, VLLMProcess, VLLMSettings
from servers.engines.vllm_push import TransferSync
from servers.engines.weight_transfer import TransferTarget
from servers.interfaces import GenerationChunk, InferenceEngine, SamplingParams
from servers.models import load_tokenizer

__all__ = ["VLLMEngine", "VLLMStats", "vllm_engine_factory"]

log = logging.getLogger(__name__)


@dataclass
class VLLMStats:
    """Counters of one engine (the server's /metrics reads the prompt-token counts)."""

    prefilled_tokens: int = 0  # prompt tokens vLLM computed
    cached_tokens: int = 0  # prompt tokens vLLM's prefix cache supplied
    weight_loads: int = 0
    weight_transfers: int = 0  # of weight_loads, those pushed through vLLM's weight-transfer engine
    weight_transfer_failures: int = 0  # pushes that failed (each then went through the disk)
    last_weight_sync_s: float | None = None
    restarts: int = 0


class VLLMEngine(InferenceEngine):
    """vLLM in a subprocess behind the `InferenceEngine` seam (see the module docstring)."""

    takes_tensors = False

    def __init__(self, model_dir: str | Path, *, device: str | None = None, settings: VLLMSettings | None = None,
                 shares_gpu: bool = False, python: Path | None = None, work_dir: Path | None = None,
                 start_timeout_s: float = 600.0, max_restarts: int = 1,
                 cuda_visible_devices: str | None = None) -> None:  # fmt: skip
        from transformers import AutoConfig

        self.model_dir = Path(model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        config = AutoConfig.from_pretrained(self.model_dir).get_text_config()
        settings = settings or VLLMSettings()
        self.context_length = _served_context(context_length(config, self.tokenizer), settings.max_model_len)
        self.eos_token_ids = eos_token_ids(_generation_config(self.model_dir), config, self.tokenizer)
        self.vocab_size = int(config.vocab_size)
        self.stats = VLLMStats()
        #: Generations sent to vLLM and not finished yet.
        self.running_requests = 0
        self._launch = VLLMLaunch(self.model_dir, self.context_length, device=device or _default_device(),
                                  settings=settings, shares_gpu=shares_gpu, python=python,
                                  cuda_visible_devices=cuda_visible_devices)  # fmt: skip
        self._asleep = False  # put to sleep for a training step; the next weight load wakes it
        self._own_work_dir = work_dir is None  # a temporary one is removed on close
        self.work_dir = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="marl-vllm-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.work_dir.glob("weights-*"):  # left by an engine whose process was killed outright
            shutil.rmtree(stale, ignore_errors=True)
        self._start_timeout_s = start_timeout_s
        self._max_restarts = max_restarts
        self._weights: Path | None = None  # our copy of the latest weights loaded (a restart loads them again)
        self._pushed = False  # the latest weights were pushed (no copy: a restart cannot bring them back)
        self._transfer = TransferSync(self._launch, self.stats)
        self._lock = threading.Lock()  # one weight sync or restart at a time
        self._ready = threading.Event()  # set while vLLM serves
        self._closing = threading.Event()
        self._down: str | None = None  # why the engine no longer serves (every call fails with it)
        self._clients = LoopClients()
        self._process: VLLMProcess | None = None
        # The watcher thread starts vLLM, and restarts it: vLLM gets SIGTERM when that thread ends (vllm_process).
        self._booted = threading.Event()
        self._boot_error: BaseException | None = None
        self._watcher = threading.Thread(target=self._run, name="marl-vllm-watcher", daemon=True)
        self._watcher.start()
        self._booted.wait()
        if self._boot_error is not None:
            self.close()
            raise self._boot_error

    @property
    def pid(self) -> int:
        """The vLLM server process (its engine core is a child in the same session)."""
        return self._process.pid

    @property
    def url(self) -> str:
        """The vLLM server's base URL (127.0.0.1, a new port after a restart): its /metrics, for operators."""
        return self._process.url

    @property
    def log_path(self) -> Path:
        return self._process.log_path

    # ---------------------------------------------------------------- InferenceEngine

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        """Stream one generation (see `InferenceEngine.generate`); stops as the torch engine does: "stop" at an eos
        token or a stop string (the tokens that formed it are included), "length" at `max_tokens` or the context.

        ValueError for a bad prompt; RuntimeError when vLLM fails the request, dies under it or is down.
        """
        prompt = _checked_prompt(prompt_ids, params, self.vocab_size, self.context_length)
        await self._wait_ready()
        process = self._process
        body = completion_body(prompt, params, max_tokens=min(params.max_tokens, self.context_length - len(prompt)),
                               stop_token_ids=sorted(self.eos_token_ids))
        self.running_requests += 1
        try:
            async for chunk in stream_completion(self._clients.get(), process.url, body, self._count_prompt):
                yield chunk
        except httpx.HTTPError as exc:
            raise RuntimeError(self._lost(process, exc)) from exc
        finally:
            self.running_requests -= 1

    def load_weights_from(self, directory: Path) -> None:
        """Serve the HF safetensors in `directory` from now on; returns once they serve (see the module docstring)."""
        if not sorted(Path(directory).glob("*.safetensors")):
            raise FileNotFoundError(f"no *.safetensors weights in {directory}")
        with self._lock:
            if self._down is not None:
                raise RuntimeError(self._down)
            started = time.perf_counter()
            self._weights = _keep_copy(Path(directory), self.work_dir / f"weights-{self.stats.weight_loads + 1}",
                                       self._weights)
            try:
                (sync_weights_waking if self._asleep else sync_weights)(self._process.url, self._weights)
            except httpx.HTTPError as exc:
                raise RuntimeError(self._lost(self._process, exc)) from exc
            finally:
                self._asleep = False  # awake, or failed: the failed step stops the engine
            self._pushed = False
            self.stats.weight_loads += 1
            self.stats.last_weight_sync_s = time.perf_counter() - started

    def push_weights(self, push: Callable[[TransferTarget], None]) -> bool:
        """Serve the trainer's weights through vLLM's weight-transfer engine: `push(target)` is the trainer's side
        (`Trainer.push_weights`, servers.engines.weight_transfer). True once the new weights serve; False when this
        engine syncs through the disk (`transfer_off` says why) or the push failed now (logged, counted, and the
        disk from then on): the caller then exports a directory for `load_weights_from`."""
        if self.transfer_off is not None:
            return False
        with self._lock:
            if self._down is not None:
                raise RuntimeError(self._down)
            started, process = time.perf_counter(), self._process
            try:
                pushed = self._transfer.sync(process, push, asleep=self._asleep)
            except (httpx.HTTPError, RuntimeError) as exc:
                raise RuntimeError(self._lost(process, exc)) from exc
            self._pushed = pushed  # failed: the disk sync that follows leaves a copy (and fixes a restart meanwhile)
            if pushed:
                self._asleep = False
                self.stats.weight_loads += 1
                self.stats.last_weight_sync_s = time.perf_counter() - started
            return pushed

    @property
    def transfer_off(self) -> str | None:
        """Why this engine syncs through the disk (None while it pushes through the weight-transfer engine)."""
        return self._transfer.off

    def before_training_step(self) -> None:
        """With sleep mode, free vLLM's GPU memory for the trainer's step (`load_weights_from` brings it back)."""
        if not self._launch.sleeps_between_steps:
            return
        with self._lock:
            try:
                sleep_for_training(self._process.url)
            except httpx.HTTPError as exc:
                raise RuntimeError(self._lost(self._process, exc)) from exc
            self._asleep = True

    def close(self) -> None:
        """Stop vLLM (idempotent); calls still running or waiting fail."""
        self._closing.set()
        self._down = self._down or "the engine is closed"
        self._ready.clear()
        if self._process is not None:
            self._process.stop()
        if self._watcher.is_alive() and threading.current_thread() is not self._watcher:
            self._watcher.join(timeout=30)
        if self._own_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        elif self._weights is not None:
            shutil.rmtree(self._weights, ignore_errors=True)  # the log stays

    # ---------------------------------------------------------------- requests

    async def _wait_ready(self) -> None:
        """Wait while vLLM restarts (not during a weight sync: vLLM itself holds requests then)."""
        deadline = time.monotonic() + self._start_timeout_s
        while not self._ready.is_set():
            if self._down is not None:
                raise RuntimeError(self._down)
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not come back within {self._start_timeout_s:.0f} s")
            await asyncio.sleep(0.05)
        if self._down is not None:
            raise RuntimeError(self._down)

    def _count_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.stats.prefilled_tokens += prompt_tokens - cached_tokens
        self.stats.cached_tokens += cached_tokens

    def _lost(self, process: VLLMProcess, error: Exception) -> str:
        code = process.exit_code()
        if code is None:
            return f"the request to vLLM failed: {type(error).__name__}: {error}"
        what = "it is down" if self._down else "it is being restarted"
        return f"the vLLM subprocess exited with code {code} during the request; {what} (log: {process.log_path})"

    # ---------------------------------------------------------------- the subprocess

    def _start(self) -> VLLMProcess:
        """Start vLLM, wait until it serves, load the latest weights into it (if any were loaded) and check that it
        generates."""
        process = VLLMProcess(self._launch, self.work_dir / "vllm.log")
        self._process, self._asleep = process, False
        try:
            process.wait_ready(self._start_timeout_s, cancelled=self._closing.is_set)
            if self._weights is not None:
                sync_weights(process.url, self._weights)
            try:
                generate_one_token(process.url)
            except RuntimeError as exc:
                raise RuntimeError(f"vLLM started but cannot generate: {exc}; {process.describe_log()}") from exc
        except BaseException:
            process.stop()
            raise
        log.info("vLLM ready on %s (pid %d)", process.url, process.pid)
        return process

    def _run(self) -> None:
        """The watcher thread: start vLLM, then wait on it and restart it when it dies (see the module docstring)."""
        try:
            self._start()
            self._ready.set()
        except BaseException as exc:  # noqa: BLE001 - the constructor raises it
            self._boot_error = exc
        finally:
            self._booted.set()
        while self._boot_error is None and not self._closing.is_set():
            process = self._process
            code = process.wait()
            if self._closing.is_set():
                return
            self._ready.clear()
            log.error("vLLM (pid %d) exited with code %s; %s", process.pid, code, process.describe_log())
            if not self._restart(process, code):
                return

    def _restart(self, dead: VLLMProcess, code: int) -> bool:
        with self._lock:
            dead.stop()  # whatever is left of its session
            if self._closing.is_set():
                return False
            if self._pushed:
                self._down = (f"the vLLM subprocess exited with code {code}, and its latest weights were pushed"
                              " through the weight-transfer engine, which leaves no copy to restart it with: start"
                              f" the engine again (it resumes from the last checkpoint) (log: {dead.log_path})")
                return False
            if self.stats.restarts >= self._max_restarts:
                self._down = (f"the vLLM subprocess exited with code {code} after {self.stats.restarts} restart(s):"
                              f" the engine is down until it is stopped and started again (log: {dead.log_path})")
                return False
            self.stats.restarts += 1
            try:
                self._start()
            except Exception as exc:  # noqa: BLE001 - reported to every later call
                self._down = f"the vLLM subprocess exited with code {code} and could not be restarted: {exc}"
                log.error("%s", self._down)
                return False
            self._ready.set()
            log.warning("vLLM restarted (%d of %d restarts used)", self.stats.restarts, self._max_restarts)
            return True



def _checked_prompt(prompt_ids: list[int], params: SamplingParams, vocab_size: int, context_length: int) -> list[int]:
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: at least one token id is needed")
    if bad := [t for t in prompt if not 0 <= t < vocab_size]:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    if len(prompt) >= context_length:
        raise ValueError(f"the prompt has {len(prompt)} tokens; this model's context length is {context_length}")
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
    return prompt


def _keep_copy(directory: Path, target: Path, previous: Path | None) -> Path:
    """A copy of `directory` at `target` that lives as long as the engine (the caller's is temporary), in place of
    the `previous` one."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(directory, target, copy_function=_link_or_copy)
    if previous is not None and previous != target:
        shutil.rmtree(previous, ignore_errors=True)
    return target


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)  # the exported files are written once and never changed: sharing is safe
    except OSError:
        shutil.copy2(source, destination)


def _generation_config(model_dir: Path) -> Any:
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json
        return None


def _served_context(model_context: int, wanted: int | None) -> int:
    """The setting's max_model_len capped to the model's context (vLLM refuses a longer one); default: the model's."""
    if wanted is not None and wanted > model_context:
        log.warning("vllm.max_model_len %d is longer than the model's context: serving %d", wanted, model_context)
    return min(wanted or model_context, model_context)


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def vllm_engine_factory(device: str | None = None, *, settings: VLLMSettings | None = None, shares_gpu: bool = False,
                        python: Path | None = None, work_dir: Path | None = None, max_restarts: int = 1,
                        cuda_visible_devices: str | None = None):  # fmt: skip
    """An `EngineFactory` (`model_dir -> InferenceEngine`) for `servers.entrypoint.build_server`: `marl serve --engine
    vllm`. `shares_gpu`: a trainer uses vLLM's GPU too (see `VLLMLaunch`); `work_dir` holds vLLM's log and the copy
    of the latest weights (default: a temporary directory); `cuda_visible_devices`: vLLM's GPUs (servers.placement)."""

    def build(model_dir: Path) -> VLLMEngine:
        return VLLMEngine(model_dir, device=device, settings=settings, shares_gpu=shares_gpu, python=python,
                          work_dir=work_dir, max_restarts=max_restarts, cuda_visible_devices=cuda_visible_devices)

    return build
