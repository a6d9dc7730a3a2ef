"""The vLLM inference backend: an `InferenceEngine` whose model runs in a vLLM subprocess (`marl serve --engine vllm`).

The server keeps doing what it does with any engine (chat templates, prompt splicing, recording, leases); this
engine only turns `generate(prompt_ids, params)` into a `/v1/completions` call by token ids (streamed when the
caller streams) and hands back vLLM's exact token ids and raw logprobs (servers.engines.vllm_http). vLLM's own
continuous batching and automatic prefix caching replace the torch engine's.

- The subprocess (servers.engines.vllm_process) starts in the constructor, which returns once vLLM is ready.
- Weights come as a directory (`takes_tensors = False`): `load_weights_from` keeps a copy of it (hard links when
  possible), then pauses vLLM until its running requests are done, reloads in place, empties the prefix cache and
  resumes. A generation therefore never mixes two policies, and requests that arrive meanwhile wait.
- Or, on CUDA, the trainer pushes its tensors through vLLM's weight-transfer engine (`push_weights`: ipc when every
  vLLM GPU is a trainer GPU, each rank to the worker on its GPU; nccl when vLLM's GPUs are its own;
  `VLLMLaunch.weight_sync`, servers.engines.vllm_push), between the same pause and resume.
  A push that fails is logged and counted (`VLLMStats.weight_transfer_failures`), and this engine syncs through the
  directory from then on. Weights that came that way leave no copy to restart vLLM with: a vLLM that dies after
  one is not restarted (the engine is down; a new start resumes from the last checkpoint).
- Sleep mode (CUDA, when the trainer shares vLLM's GPU: `VLLMLaunch.sleeps_between_steps`): `before_training_step`
  puts vLLM to sleep (weights offloaded to host memory, KV cache dropped) so the trainer has the GPU, and the next
  weight load wakes the weights, reloads them and wakes the KV cache.
- LoRA adapters (a server of LoRA policies, or a static server with an adapter: `lora`): vLLM starts with
  `--enable-lora`; `load_adapter_from` loads or replaces one adapter at runtime while the base and the other adapters
  keep generating, and a request picks one by name (servers.engines.vllm_lora).
- A watcher thread waits on the subprocess (servers.engines.vllm_supervisor). When it dies, requests running on it
  fail (an engine error: 5xx), new ones wait, and it is restarted once with the latest weights and adapters; if that
  fails, or it dies again, the engine is down and every call fails at once with the reason (until the engine is
  stopped and started again).
- `vllm.data_parallel_size: N` runs N such subprocesses (servers.engines.vllm_replicas): a lease's calls go to one
  (`SamplingParams.affinity`: its prefix cache), every load to all; each restarts alone; down once all are. While a
  weight sync has vLLM paused (or asleep), new generations wait at a gate in marl, and one refused as paused anyway
  (a 503, `vllm_http.paused_refusal`) is sent again shortly after: with `overlap`, calls run through weight syncs.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from marl.protocol import LoraSpec
from servers.backends import GenerationChunk, InferenceEngine, SamplingParams
from servers.engines.model_limits import context_length, eos_token_ids
from servers.engines.vllm_http import (
    LoopClients,
    completion_body,
    sleep_for_training,
    stream_completion,
    sync_weights,
    sync_weights_waking,
    whole_completion,
)
from servers.engines.vllm_lora import LoraSlots, VLLMAdapters, link_or_copy, write_peft_adapter, zero_adapter
from servers.engines.vllm_process import VLLMLaunch, VLLMProcess, VLLMSettings
from servers.engines.vllm_push import TransferSync
from servers.engines.vllm_replicas import Replica, VLLMReplicas
from servers.engines.weight_transfer import TransferTarget
from servers.model_files import load_tokenizer

__all__ = ["VLLMEngine", "VLLMStats", "vllm_engine_factory"]

log = logging.getLogger(__name__)
#: How long a vLLM restart waits for the copy of weights pushed just before it died (a 7B model's export: ~1 min).
RESTART_COPY_WAIT_S = 600.0



@dataclass
class VLLMStats:
    """Counters of one engine (the server's /metrics reads the prompt-token counts)."""

    prefilled_tokens: int = 0  # prompt tokens vLLM computed
    cached_tokens: int = 0  # prompt tokens vLLM's prefix cache supplied
    weight_loads: int = 0
    adapter_loads: int = 0  # LoRA adapters loaded (each policy's after each of its steps)
    weight_transfers: int = 0  # of weight_loads, those pushed through vLLM's weight-transfer engine
    weight_transfer_failures: int = 0  # pushes that failed (each then went through the disk)
    last_weight_sync_s: float | None = None
    restarts: int = 0  # of every replica
    paused_retries: int = 0  # generations vLLM refused as paused, sent again


class VLLMEngine(InferenceEngine):
    """vLLM in a subprocess behind the `InferenceEngine` seam (see the module docstring)."""

    takes_tensors = False

    def __init__(self, model_dir: str | Path, *, device: str | None = None, settings: VLLMSettings | None = None,
                 shares_gpu: bool = False, python: Path | None = None, work_dir: Path | None = None,
                 start_timeout_s: float = 600.0, max_restarts: int = 1,
                 cuda_visible_devices: str | None = None, lora: LoraSlots | None = None,
                 engine_gpus: tuple[int, ...] | None = None, trainer_gpus: tuple[int, ...] | None = None,
                 ranks_elsewhere: bool = False, ray_group: str | None = None,
                 ray_address: str | None = None) -> None:  # fmt: skip
        from transformers import AutoConfig

        self.model_dir = Path(model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        config = AutoConfig.from_pretrained(self.model_dir).get_text_config()
        settings = settings or VLLMSettings()
        self.context_length = _served_context(context_length(config, self.tokenizer), settings.max_model_len)
        self.eos_token_ids = eos_token_ids(_generation_config(self.model_dir), config, self.tokenizer)
        self.vocab_size = int(config.vocab_size)
        self.stats = VLLMStats()
        self._launch = VLLMLaunch(self.model_dir, self.context_length, device=device or _default_device(),
                                  settings=settings, shares_gpu=shares_gpu, python=python,
                                  cuda_visible_devices=cuda_visible_devices, lora=lora,
                                  engine_gpus=engine_gpus, trainer_gpus=trainer_gpus,
                                  ranks_elsewhere=ranks_elsewhere, ray_group=ray_group,
                                  ray_address=ray_address)  # fmt: skip
        self._asleep = False  # put to sleep for a training step (the gate closed); the next weight load wakes it
        if work_dir is None and self._launch.replicas_elsewhere:
            raise ValueError("vLLM replicas as Ray actors need a work_dir on a filesystem every node shares (they"
                             " write their logs there and read the weights from it), not a temporary one")
        self._own_work_dir = work_dir is None  # a temporary one is removed on close
        self.work_dir = Path(work_dir).resolve() if work_dir else Path(tempfile.mkdtemp(prefix="marl-vllm-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.work_dir.glob("weights-*"):  # left by an engine whose process was killed outright
            shutil.rmtree(stale, ignore_errors=True)
        stand_in = zero_adapter(config) if self._launch.base_stand_in else None
        self._adapters = VLLMAdapters(self.work_dir / "adapters", base_stand_in=stand_in)
        self._weights: Path | None = None  # our copy of the latest weights loaded (a restart loads them again)
        self._pushed = False  # the latest weights were pushed and no copy of them is kept yet
        #: Clear from a push until the train loop hands over the pushed weights' copy (`keep_restart_copy`): a
        #: restart meanwhile waits for it rather than find nothing to start from.
        self._restart_copy = threading.Event()
        self._restart_copy.set()
        self._transfer = TransferSync(self._launch, self.stats)
        self._clients = LoopClients()
        self._replicas = VLLMReplicas(self._launch, self.work_dir, replay=self._replay,
                                      unrestorable=self._unrestorable, stats=self.stats,
                                      start_timeout_s=start_timeout_s, max_restarts=max_restarts)
        try:
            self._replicas.start()
        except BaseException:
            self.close()  # its temporary work directory too
            raise

    @property
    def pid(self) -> int:
        """The (first replica's) vLLM server process (its engine core is a child in the same session)."""
        return self._replicas.replicas[0].process.pid

    @property
    def url(self) -> str:
        """The (first replica's) vLLM server's base URL (127.0.0.1, a new port after a restart): its /metrics."""
        return self._replicas.replicas[0].process.url

    @property
    def replica_urls(self) -> list[str]:
        """Every replica's base URL, in order."""
        return [replica.process.url for replica in self._replicas.replicas]

    @property
    def log_path(self) -> Path:
        return self._replicas.replicas[0].process.log_path

    @property
    def running_requests(self) -> int:
        """Generations sent to vLLM and not finished yet."""
        return self._replicas.running

    # ---------------------------------------------------------------- InferenceEngine

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        """Stream one generation (see `InferenceEngine.generate`); stops as the torch engine does: "stop" at an eos
        token or a stop string (the tokens that formed it are included), "length" at `max_tokens` or the context.

        ValueError for a bad prompt; RuntimeError when vLLM fails the request, dies under it or is down.
        """
        prompt = _checked_prompt(prompt_ids, params, self.vocab_size, self.context_length)
        body = completion_body(prompt, params, max_tokens=min(params.max_tokens, self.context_length - len(prompt)),
                               stop_token_ids=sorted(self.eos_token_ids))
        if (model := self._adapters.model_of(params.adapter)) is not None:
            body["model"] = model  # vLLM names a LoRA adapter as a model
        completion = stream_completion if params.stream else whole_completion
        client = self._clients.get()
        async for chunk in self._replicas.send(
                params.affinity, lambda url: completion(client, url, body, self._count_prompt)):
            yield chunk

    def load_weights_from(self, directory: Path) -> None:
        """Serve the HF safetensors in `directory` from now on; returns once they serve (see the module docstring)."""
        if not sorted(Path(directory).glob("*.safetensors")):
            raise FileNotFoundError(f"no *.safetensors weights in {directory}")
        with self._sync() as replicas:
            started = time.perf_counter()
            target = self.work_dir / f"weights-{self.stats.weight_loads + 1}"
            self._weights = weights = _keep_copy(Path(directory), target, self._weights)

            def reload(replica: Replica) -> None:
                try:
                    if replica.asleep:
                        sync_weights_waking(replica.process.url, weights, kv_setting=self._launch.kv_setting)
                    else:
                        sync_weights(replica.process.url, weights)
                finally:
                    replica.asleep = False  # awake, or failed: the failed step stops the engine

            try:
                self._replicas.each(replicas, reload)
            finally:
                self._awake()
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
        with self._sync(RuntimeError) as replicas:
            started = time.perf_counter()
            pushed = self._transfer.sync([replica.process for replica in replicas], push, asleep=self._asleep)
            self._pushed = pushed  # failed: the disk sync that follows leaves a copy (and fixes a restart meanwhile)
            if pushed:
                self._restart_copy.clear()  # until the train loop's export lands (`keep_restart_copy`)
                for replica in replicas:
                    replica.asleep = False
                self._awake()
                self.stats.weight_loads += 1
                self.stats.last_weight_sync_s = time.perf_counter() - started
            return pushed

    def keep_restart_copy(self, directory: Path | None) -> None:
        """The weights just pushed, as the trainer exported them after the push (None: the export failed): what a
        vLLM that dies from now on restarts with. A push leaves vLLM no file to reload, and the trainer's own weights
        move on at its next step, so the train loop exports them while the rollouts run and waits for this before
        that step."""
        try:
            if directory is not None:
                target = self.work_dir / f"weights-{self.stats.weight_loads}-pushed"
                self._weights = _keep_copy(Path(directory), target, self._weights)
                self._pushed = False
        finally:
            self._restart_copy.set()

    @property
    def transfer_off(self) -> str | None:
        """Why this engine syncs through the disk (None while it pushes through the weight-transfer engine)."""
        return self._transfer.off

    def before_training_step(self) -> None:
        """With sleep mode, free vLLM's GPU memory for the trainer's step (`load_weights_from` brings it back)."""
        if not self._launch.sleeps_between_steps:
            return
        with self._sync() as replicas:
            if not self._asleep:  # the gate stays closed until a weight load wakes vLLM
                self._asleep = True
                self._replicas.gate.close()

            def sleep(replica: Replica) -> None:
                sleep_for_training(replica.process.url)
                replica.asleep = True

            self._replicas.each(replicas, sleep)

    # ---------------------------------------------------------------- LoRA adapters (servers.engines.vllm_lora)

    @property
    def serves_adapters(self) -> bool:  # type: ignore[override]
        return self._launch.lora is not None

    def load_adapter(self, name: str, tensors: Mapping[str, Any], spec: LoraSpec) -> None:
        with tempfile.TemporaryDirectory(dir=self.work_dir, prefix="adapter-") as tmp:
            self.load_adapter_from(name, write_peft_adapter(Path(tmp), tensors, spec, str(self.model_dir)))

    def load_adapter_from(self, name: str, directory: Path) -> None:
        """Serve the PEFT adapter in `directory` as `name` (requests with `model: name`); the base and the other
        adapters keep generating meanwhile, none of their cached prefixes is dropped."""
        if not self.serves_adapters:
            raise NotImplementedError("this vLLM engine was started without LoRA (no policies, no adapter)")
        with self._sync(pauses=False) as replicas:  # an adapter load does not pause vLLM
            self._adapters.load([replica.process.url for replica in replicas], name, Path(directory))
            self.stats.adapter_loads += 1

    def unload_adapter(self, name: str) -> None:
        with self._sync(pauses=False) as replicas:
            self._adapters.unload([replica.process.url for replica in replicas], name)

    def close(self) -> None:
        """Stop vLLM (idempotent); calls still running or waiting fail."""
        self._replicas.close()
        if self._own_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        elif self._weights is not None:
            shutil.rmtree(self._weights, ignore_errors=True)  # the log stays

    # ---------------------------------------------------------------- requests

    @contextlib.contextmanager
    def _sync(self, *errors: type[Exception], pauses: bool = True) -> Iterator[list[Replica]]:
        """One change of what vLLM serves at a time, on the replicas that are up (no restart meanwhile); with
        `pauses` (it pauses vLLM), new generations wait at the gate until it is done. Its HTTP failures (and
        `errors`) say whether a vLLM died under it."""
        with self._replicas.changing() as replicas, \
                (self._replicas.gate.closed() if pauses else contextlib.nullcontext()):
            try:
                yield replicas
            except (httpx.HTTPError, *errors) as exc:
                raise RuntimeError(self._replicas.lost(exc)) from exc

    def _awake(self) -> None:
        """A weight load woke vLLM (or failed to): generations pass the gate again."""
        if self._asleep:
            self._asleep = False
            self._replicas.gate.open()

    def _count_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.stats.prefilled_tokens += prompt_tokens - cached_tokens
        self.stats.cached_tokens += cached_tokens

    def _replay(self, process: VLLMProcess) -> None:
        """What a (re)started vLLM replica must serve: the latest weights loaded (if any) and every adapter."""
        if self._weights is not None:
            sync_weights(process.url, self._weights)
        self._adapters.load_all(process.url)

    def _unrestorable(self) -> str | None:
        """Why a vLLM that died cannot be restarted with what it served (None: it can). Right after a push, the
        copy being exported is waited for (`keep_restart_copy`)."""
        self._restart_copy.wait(RESTART_COPY_WAIT_S)
        if not self._pushed:
            return None
        return ("its latest weights were pushed through the weight-transfer engine and their copy for restarts"
                " could not be exported (see the server log)" if self._restart_copy.is_set() else
                f"its latest weights were pushed through the weight-transfer engine and their copy for restarts did"
                f" not land within {RESTART_COPY_WAIT_S:g}s")


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
    shutil.copytree(directory, target, copy_function=link_or_copy)
    if previous is not None and previous != target:
        shutil.rmtree(previous, ignore_errors=True)
    return target


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
                        cuda_visible_devices: str | None = None, lora: LoraSlots | None = None,
                        engine_gpus: tuple[int, ...] | None = None, trainer_gpus: tuple[int, ...] | None = None,
                        ranks_elsewhere: bool = False, ray_group: str | None = None,
                        ray_address: str | None = None):  # fmt: skip
    """An `EngineFactory` (`model_dir -> InferenceEngine`) for `servers.entrypoint.build_server`: `marl serve --engine
    vllm`. `shares_gpu`: a trainer uses vLLM's GPU too (see `VLLMLaunch`); `work_dir` holds vLLM's log and the copy
    of the latest weights (default: a temporary directory); `cuda_visible_devices`: vLLM's GPUs (servers.placement);
    `lora`: the adapters to make room for (`lora_slots`: a server of LoRA policies); `engine_gpus`, `trainer_gpus`,
    `ranks_elsewhere`: the placement's, which pick the weight sync (`VLLMLaunch`); `ray_group`, `ray_address`: the
    server's Ray placement group, whose last bundles hold the replicas after the first (servers.engines.vllm_ray)."""

    def build(model_dir: Path) -> VLLMEngine:
        return VLLMEngine(model_dir, device=device, settings=settings, shares_gpu=shares_gpu, python=python,
                          work_dir=work_dir, max_restarts=max_restarts, cuda_visible_devices=cuda_visible_devices,
                          lora=lora, engine_gpus=engine_gpus, trainer_gpus=trainer_gpus,
                          ranks_elsewhere=ranks_elsewhere, ray_group=ray_group, ray_address=ray_address)

    return build
