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
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servers.samples import Sample


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None


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

        Waits (does not fail) while weights are being swapped.
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

    @abc.abstractmethod
    def save(self, directory: Path) -> None:
        """Write a checkpoint: model (loadable by `from_pretrained`), optimizer, step, RNG."""

    @abc.abstractmethod
    def load(self, directory: Path) -> None:
        """Restore everything `save` wrote."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the trainer (engine stopped); a trainer with processes of its own stops them. May block."""
