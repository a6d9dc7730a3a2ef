"""One base model's engine and trainer, shared by the LoRA policies of one server, each policy seeing its own.

A server of several policies (`servers.policies.server`) runs one `TrainableServer` per policy. Each boots through the
factories here, which hand out *views* of one engine and one `PolicyTrainer`: the policy's engine generates with its
adapter and a weight load replaces only that adapter; its trainer steps, exports, saves and loads only that policy.
So everything a `TrainableServer` does (drain, train, publish, checkpoint) works per policy unchanged, and one
policy's step leaves the others rolling. The first view builds the shared backend; the last one closed closes it.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Generic, TypeVar

from marl.protocol import GRPOConfig, LoraSpec, TrainConfig
from servers.backends import GenerationChunk, InferenceEngine, PolicyTrainer, SamplingParams, TrainBatch, Trainer

Backend = TypeVar("Backend", InferenceEngine, PolicyTrainer)


class Shared(Generic[Backend]):
    """A backend built by its first user and closed by its last (users are views, in worker threads)."""

    def __init__(self, build: Callable[[Path], Backend]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._backend: Backend | None = None
        self._users = 0

    @property
    def current(self) -> Backend | None:
        """The backend while someone holds it (None: not built)."""
        return self._backend

    def hold(self, model_dir: Path) -> Hold[Backend]:
        """The backend, built now if nobody holds it; release the hold once done with it."""
        with self._lock:
            if self._backend is None:
                self._backend = self._build(model_dir)
            self._users += 1
            return Hold(self._backend, self._release)

    def _release(self) -> None:
        with self._lock:
            self._users -= 1
            backend = self._backend if self._users == 0 else None
            if backend is not None:
                self._backend = None
        if backend is not None:
            backend.close()


class Hold(Generic[Backend]):
    """One user's hold on a `Shared` backend; releasing it twice releases it once (a view may be closed twice)."""

    def __init__(self, backend: Backend, release: Callable[[], None]) -> None:
        self.backend, self._release = backend, release
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release()


class AdapterEngine(InferenceEngine):
    """One policy's view of the shared engine: its adapter on every generation; its weights are that adapter."""

    needs_first_publish = True  # the adapter exists in the engine only once loaded

    def __init__(self, shared: Shared[InferenceEngine], model_dir: Path, policy: str, spec: LoraSpec) -> None:
        self._hold = shared.hold(model_dir)
        engine = self._hold.backend
        if not engine.serves_adapters:
            self._hold.release()
            raise ValueError(f"{type(engine).__name__} serves no LoRA adapters: policy '{policy}' needs an engine"
                             " that does (the torch engine, or vLLM)")
        self._engine, self.policy, self.spec = engine, policy, spec
        self.tokenizer, self.context_length = engine.tokenizer, engine.context_length
        self.eos_token_ids, self.takes_tensors = engine.eos_token_ids, engine.takes_tensors
        # what its logprobs are computed in (servers.training.lifecycle)
        self.numerics = getattr(engine, "numerics", None)

    @property
    def stats(self) -> Any:
        return getattr(self._engine, "stats", None)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        return self._engine.generate(prompt_ids, replace(params, adapter=self.policy))

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        self._engine.load_adapter(self.policy, dict(named_tensors), self.spec)

    def load_weights_from(self, directory: Path) -> None:
        self._engine.load_adapter_from(self.policy, directory)

    def close(self) -> None:
        self._hold.release()


class PolicyTrainerView(Trainer):
    """One policy's view of the shared `PolicyTrainer`, as the `Trainer` its train loop drives."""

    def __init__(self, shared: Shared[PolicyTrainer], model_dir: Path, policy: str, config: TrainConfig) -> None:
        self._hold = shared.hold(model_dir)
        self._trainer, self.policy = self._hold.backend, policy
        # The shared trainer may have been built at another policy's boot, before this one's config was synced.
        self._trainer.set_config(policy, config.trainer_section)  # grpo:, or fsdp: (an FSDPConfig is a GRPOConfig)

    @property
    def step_count(self) -> int:  # type: ignore[override]
        return self._trainer.step_count(self.policy)

    @property
    def config(self) -> GRPOConfig:
        """This policy's GRPO section as the shared trainer trains it; set, it trains by the new one from its next
        step on (the server resolves `recompute_logprobs: auto` so: servers.training.lifecycle)."""
        return self._trainer.config(self.policy)

    @config.setter
    def config(self, config: GRPOConfig) -> None:
        self._trainer.set_config(self.policy, config)

    @property
    def numerics(self) -> str | None:
        """What the shared trainer computes logprobs in."""
        return getattr(self._trainer, "numerics", None)

    @property
    def progress(self) -> tuple[int, int] | None:  # type: ignore[override]
        return self._trainer.progress(self.policy)

    def step(self, batch: TrainBatch) -> dict[str, float]:
        return self._trainer.step(self.policy, batch)

    def export_weights(self, directory: Path) -> Path:
        return self._trainer.export_adapter(self.policy, directory)

    def named_weights(self) -> Iterable[tuple[str, Any]] | None:
        return self._trainer.adapter_weights(self.policy).items()

    def save(self, directory: Path) -> None:
        self._trainer.save(self.policy, directory)

    def load(self, directory: Path) -> None:
        self._trainer.load(self.policy, directory)

    def close(self) -> None:
        self._hold.release()


PolicyTrainerFactory = Callable[[Path, Mapping[str, tuple[LoraSpec, TrainConfig]]], PolicyTrainer]


class PolicyBackends:
    """The shared engine and trainer of one server's policies, and each policy's factories for its lifecycle.

    `configs` gives every policy's `TrainConfig` when the trainer is built (at the first policy's boot: a server's
    policies start together, so each has its synced config by then).
    """

    def __init__(self, specs: Mapping[str, LoraSpec], engine_factory: Callable[[Path], InferenceEngine],
                 trainer_factory: PolicyTrainerFactory, configs: Callable[[], Mapping[str, TrainConfig]]) -> None:
        self.specs = dict(specs)
        self.engine = Shared(engine_factory)
        self.trainer = Shared(lambda model_dir: trainer_factory(
            model_dir, {name: (self.specs[name], config) for name, config in configs().items()}))

    def engine_factory(self, policy: str) -> Callable[[Path], InferenceEngine]:
        return lambda model_dir: AdapterEngine(self.engine, model_dir, policy, self.specs[policy])

    def trainer_factory(self, policy: str) -> Callable[[Path, TrainConfig], Trainer]:
        return lambda model_dir, config: PolicyTrainerView(self.trainer, model_dir, policy, config)
