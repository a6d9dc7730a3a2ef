"""The two small interfaces every backend implements.

`InferenceEngine` turns prompt token ids into generated token ids with their logprobs, and takes new weights.
`Trainer` takes a batch of GRPO groups, steps the policy, hands its weights to the engine, and checkpoints.

A backend never sees HTTP, leases or games: the server drives both through these methods only.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marl.protocol import Sample


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
    """Generates from token ids; requests from many agents may share forward passes."""

    #: A Hugging Face tokenizer with a chat template (used by the server to render prompts and decode replies).
    tokenizer: Any
    #: Longest prompt + completion the model accepts.
    context_length: int
    #: Token ids that end a generation (finish_reason "stop"); they are part of the generated ids.
    eos_token_ids: frozenset[int]

    @abc.abstractmethod
    def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        """Stream the generation of one request.

        `logprobs[i]` is log softmax of the raw logits (temperature 1, no top-p) at the sampled token: the same
        number a training forward pass computes, whatever temperature the token was sampled at.

        Waits (does not fail) while weights are being swapped.
        """

    @abc.abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Serve these weights from now on (called between steps, when no generation is running)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the model (engine stopped)."""


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
    extra: dict[str, Any] = field(default_factory=dict)


class Trainer(abc.ABC):
    """Steps the policy on GRPO batches; owns the optimizer and checkpoints."""

    #: Steps taken so far (restored by `load`); the policy version the engine serves after `named_weights` sync.
    step_count: int
    #: (done, total) units of work of the step running now (GRPO: micro-batch passes), None when unknown: read by
    #: monitors from another thread while a long step runs.
    progress: tuple[int, int] | None = None

    @abc.abstractmethod
    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One policy update; returns metrics (loss, clip fraction, KL, entropy, rewards, tokens, seconds)."""

    @abc.abstractmethod
    def named_weights(self) -> Iterable[tuple[str, Any]]:
        """Current policy weights, for `InferenceEngine.load_weights`."""

    @abc.abstractmethod
    def save(self, directory: Path) -> None:
        """Write a checkpoint: model (loadable by `from_pretrained`), optimizer, step, RNG."""

    @abc.abstractmethod
    def load(self, directory: Path) -> None:
        """Restore everything `save` wrote."""
