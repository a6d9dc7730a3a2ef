"""The two seams every backend implements: `InferenceEngine` (generation) and `Trainer` (policy updates).

A backend never sees HTTP, leases or games: the server drives both through these methods only, and only passes
plain data across them (token ids, `SamplingParams`, a `TrainBatch` of `Sample`s, metrics dicts, directory paths).
So either side may live in another process, e.g. vLLM in a subprocess or a trainer spread over torch.distributed
ranks, behind a thin client that implements these classes:

- Every call but `generate` may block: the server makes each from a worker thread, never on its event loop.
- Weights travel as a directory (`Trainer.export_weights` -> `InferenceEngine.load_weights_from`): Hugging Face
  safetensors that `from_pretrained` loads, on a filesystem both processes see. When both live in this process,
  the server takes the fast path instead: `Trainer.named_weights` tensors straight into `InferenceEngine.load_weights`.
- Checkpoints are directories too (`Trainer.save` / `Trainer.load`).
"""

from __future__ import annotations

import abc
import json
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marl.protocol import GRPOConfig, LoraSpec
from servers.episodes.samples import Sample


def lora_spec_of(adapter_config: Mapping[str, Any]) -> LoraSpec:
    """The `LoraSpec` of a PEFT `adapter_config.json` (what vLLM's `--lora-modules` reads too)."""
    targets = adapter_config.get("target_modules") or ()
    return LoraSpec(rank=adapter_config["r"], alpha=adapter_config["lora_alpha"],
                    dropout=adapter_config.get("lora_dropout", 0.0),
                    target_modules=tuple(sorted(targets)) if not isinstance(targets, str) else (targets,))


def lora_spec_in(directory: Path) -> LoraSpec:
    """The `LoraSpec` of the PEFT adapter saved in `directory` (its adapter_config.json)."""
    return lora_spec_of(json.loads((Path(directory) / "adapter_config.json").read_text()))


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    #: The LoRA adapter (a policy's name) to generate with; None: the base model.
    adapter: str | None = None
    #: Whether anyone reads the tokens as they come. False (a non-streaming API call): the engine may hand back the
    #: whole generation as one chunk, which spares the server a wake-up per token (docs/scale.md).
    stream: bool = True
    #: Calls that share this key (a lease's episode id) go to one replica of an engine of several, so that each call
    #: finds the previous ones' prompt in that replica's prefix cache; None: any replica (servers.engines.
    #: vllm_replicas).
    affinity: str | None = None
    #: Token sequences the generation must begin with one of (a forced tool call's declared function names:
    #: servers.calls.tool_choice, with the tokens that cross their end: servers.calls.lead_texts): until one is
    #: complete, only a token that continues one of them is sampled; after it, sampling is free. The logprobs stay the
    #: raw model's, as under temperature and top-p. Empty: no constraint.
    lead: tuple[tuple[int, ...], ...] = ()


@dataclass
class GenerationChunk:
    """New tokens of one generation. The last chunk has `finish_reason` set ("stop" or "length")."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None


class InferenceEngine(abc.ABC):
    """Generates from token ids; requests from many agents may share forward passes.

    What a remote implementation must honour, as the in-process torch engine does:
    - Exact ids: `generate` takes the prompt as token ids and returns the generated ids; it never re-tokenizes text
      (the server records these ids as the training sample).
    - Exact logprobs: see `generate`. They are the behaviour policy of PPO: anything else biases the ratio.
    - Drained weight swaps: a weight load waits until the running generations finished on the old weights, and
      generations that arrive meanwhile run on the new ones; no generation ever mixes two policies.
    """

    #: A Hugging Face tokenizer with a chat template, in this process (the server renders prompts and decodes
    #: replies with it; a remote engine loads it locally from the model directory).
    tokenizer: Any
    #: Longest prompt + completion the model accepts.
    context_length: int
    #: Token ids that end a generation (finish_reason "stop"); they are part of the generated ids.
    eos_token_ids: frozenset[int]
    #: Whether `load_weights` takes tensors directly (an engine in this process). A remote engine sets False: the
    #: server then always publishes through `load_weights_from`.
    takes_tensors: bool = True

    @abc.abstractmethod
    def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        """Stream the generation of one request (awaited on the server's event loop: it must not block).

        `logprobs[i]` is log softmax of the raw logits (temperature 1, no top-p) at the sampled token: the same
        number a training forward pass computes, whatever temperature the token was sampled at.

        Waits (does not fail) while weights are being swapped. With `params.stream` False the chunks may come all at
        once, at the end; their concatenation is the same either way.
        """

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """The in-process fast path: serve these tensors (names as in the model's `state_dict`) from now on.

        Called between steps, when no lease is running; still drains running generations first (see the class).
        """
        raise NotImplementedError(f"{type(self).__name__} takes weights only from a directory (load_weights_from)")

    def load_weights_from(self, directory: Path) -> None:
        """Serve the weights saved in `directory` (HF safetensors, as `Trainer.export_weights` writes) from now on.

        Returns once the new weights serve. The default reads the files in this process and calls `load_weights`;
        a remote engine overrides it to have its own process load them.
        """
        from safetensors.torch import load_file

        files = sorted(Path(directory).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {directory}")
        self.load_weights(item for path in files for item in load_file(path).items())

    #: Whether this engine serves LoRA adapters (`SamplingParams.adapter`, `load_adapter`).
    serves_adapters: bool = False
    #: Whether the server publishes the trainer's weights at boot even without a checkpoint (a LoRA policy's view:
    #: its adapter exists in the engine only once loaded). Otherwise the engine already serves the initial weights.
    needs_first_publish: bool = False

    def load_adapter(self, name: str, tensors: Mapping[str, Any], spec: LoraSpec) -> None:
        """Serve adapter `name` (new, or replacing one of that name) from now on: `tensors` in PEFT's names (as
        `peft.get_peft_model_state_dict` returns them: `base_model.model.<module>.lora_A.weight`, ...).

        Called when no generation of that adapter runs; other adapters and the base keep generating meanwhile.
        """
        raise NotImplementedError(f"{type(self).__name__} serves no LoRA adapters")

    def load_adapter_from(self, name: str, directory: Path) -> None:
        """Serve the adapter saved in `directory` (PEFT's format: adapter_config.json, adapter_model.safetensors)
        as `name`. The default reads it in this process and calls `load_adapter`."""
        from safetensors.torch import load_file

        self.load_adapter(name, load_file(Path(directory) / "adapter_model.safetensors"), lora_spec_in(directory))

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name` and free what it took (a frozen policy retired from a league): returns once
        its running generations finished and it is gone; generations still waiting for it fail. KeyError if it is
        not loaded. Other adapters and the base keep generating meanwhile."""
        raise NotImplementedError(f"{type(self).__name__} cannot unload LoRA adapters")

    def before_training_step(self) -> None:  # noqa: B027 - optional hook
        """Called right before each training step, with no generation running: an engine that shares its device
        with the trainer may free memory here (the vLLM engine's sleep mode); the next weight load brings it back."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the model (engine stopped). May block; the server calls it from a worker thread."""


@dataclass
class Group:
    """The samples of one GRPO group: same job, same task, same agent, `num_repeat` (or more) episodes."""

    job: str
    task_id: str
    agent: str
    samples: list[Sample]


@dataclass
class TrainBatch:
    step: int  # the step this batch trains (policy version after it: step)
    groups: list[Group]
    dropped_stale: int = 0  # samples dropped because they were too old to train on


class Trainer(abc.ABC):
    """Steps the policy on batches of groups; owns the optimizer and checkpoints.

    A remote implementation (e.g. the driver of N torch.distributed ranks) takes the same plain data: `step` gets a
    `TrainBatch` and returns a metrics dict; weights and checkpoints go through directories. Every method may
    block (the server calls them from a worker thread) and is called one at a time.
    """

    #: Steps taken so far (restored by `load`); the policy version the engine serves once it has these weights.
    step_count: int
    #: (done, total) units of work of the step running now (GRPO: micro-batch passes), None when unknown: read by
    #: monitors from another thread while a long step runs.
    progress: tuple[int, int] | None = None

    @abc.abstractmethod
    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One policy update; returns metrics (loss, clip fraction, KL, entropy, rewards, tokens, seconds)."""

    @abc.abstractmethod
    def export_weights(self, directory: Path) -> Path:
        """Write the current policy weights into `directory` as HF safetensors (loadable by `from_pretrained`),
        for `InferenceEngine.load_weights_from`; returns the directory holding them."""

    def named_weights(self) -> Iterable[tuple[str, Any]] | None:
        """The in-process fast path: current policy weights as (name, tensor), for `InferenceEngine.load_weights`.

        None (the default) when the weights live in another process: the server then uses `export_weights`.
        """
        return None

    def release_memory(self) -> dict[str, float]:
        """Hand the device memory the step cached back to the driver (servers.trainers.device_memory), before the
        server publishes the new weights and an engine that shares the device wakes. The default frees this
        process's cache (a trainer in the server's process); a trainer with processes of its own has them free
        theirs. Returns metrics (GB, on a GPU only): what the allocator reserved after the step and after freeing."""
        from servers.trainers.device_memory import free_cached_memory, memory_metrics

        return memory_metrics([free_cached_memory(getattr(self, "device", None))])

    @abc.abstractmethod
    def save(self, directory: Path) -> None:
        """Write a checkpoint: model (loadable by `from_pretrained`), optimizer, step, RNG."""

    @abc.abstractmethod
    def load(self, directory: Path) -> None:
        """Restore everything `save` wrote."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the trainer (engine stopped); a trainer with processes of its own stops them. May block."""


class PolicyTrainer(abc.ABC):
    """Trains the LoRA policies of one frozen base model, each its own learner: its own adapter, optimizer state,
    step count, RNG and checkpoints (adapter-only, in PEFT's format). The base is never trained, so its KL reference
    is the policy with its adapter turned off.

    Several policies' train loops call it from their own threads: an implementation runs one call at a time (a lock)
    and never lets one policy's call touch another's adapter or optimizer.
    """

    #: The policies' names, fixed when it is built.
    policies: tuple[str, ...]

    @abc.abstractmethod
    def step_count(self, policy: str) -> int:
        """Steps `policy` has taken (restored by `load`): its policy version once the engine serves them."""

    @abc.abstractmethod
    def step(self, policy: str, batch: TrainBatch) -> dict[str, float]:
        """One update of `policy`'s adapter; the same objective and metrics as `Trainer.step`."""

    @abc.abstractmethod
    def set_config(self, policy: str, config: GRPOConfig) -> None:
        """Train `policy` with `config` from its next step on (its synced config, given at each of its boots)."""

    def progress(self, policy: str) -> tuple[int, int] | None:
        """`Trainer.progress` of `policy`'s step running now (None: none, or unknown)."""
        return None

    @abc.abstractmethod
    def adapter_weights(self, policy: str) -> dict[str, Any]:
        """`policy`'s adapter tensors in PEFT's names, for `InferenceEngine.load_adapter` (copies: safe to keep)."""

    @abc.abstractmethod
    def export_adapter(self, policy: str, directory: Path) -> Path:
        """Write `policy`'s adapter into `directory` in PEFT's format (adapter_config.json,
        adapter_model.safetensors), as `PeftModel.from_pretrained` and vLLM's LoRA loading read it; returns it."""

    @abc.abstractmethod
    def save(self, policy: str, directory: Path) -> None:
        """Checkpoint `policy`: its adapter (PEFT's format), optimizer state, step count and RNG."""

    @abc.abstractmethod
    def load(self, policy: str, directory: Path) -> None:
        """Restore everything `save` wrote for `policy`; the other policies are untouched."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the model (engine stopped). May block."""
