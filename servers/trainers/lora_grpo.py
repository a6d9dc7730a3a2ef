"""GRPO on several LoRA policies of one frozen base model, in one process (`LoraGRPOTrainer`).

One base model sits in memory, wrapped once by peft with one adapter per policy. Each policy is its own learner:
its `GRPOConfig` (learning rate, clipping, KL, ...), its AdamW over its adapter's parameters only, its step count,
its RNG stream and its progress. The base is frozen (no gradient, no optimizer state), so a policy's KL reference
costs no second model: it is the same model with the adapters turned off (`disable_adapter`).

A step runs exactly `GRPOTrainer.step`'s algorithm (servers.trainers.grpo: `grpo_step` for the advantages and the
batch metrics, `micro_batch_loss` for the PPO-clip + KL loss of each micro-batch, the same packing, grad-norm clip
and pass metrics) with only that policy's adapter active and trainable.

Randomness per policy: the process's RNG states (python, numpy, torch, CUDA) are swapped in for a policy's call
and its advanced states kept for its next one, so policy A's steps never shift the draws of policy B (LoRA dropout,
anything else a step samples). Each stream starts from (seed, policy name), which also initialises the adapter, so
a policy's start does not depend on which other policies share the base.

Calls are serialised by one lock: several policies' train loops call from their own threads, and they share the
model (its active adapter, its gradient-checkpointing flag).

Checkpoints are per policy: `save(policy, dir)` writes `dir/adapter/` (PEFT's format, as `export_adapter`) and
`dir/trainer_state.pt` (servers.trainers.trainer_state: optimizer, step count, the policy's RNG states).
"""

from __future__ import annotations

import contextlib
import logging
import random
import shutil
import tempfile
import threading
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

from marl.protocol import GRPOConfig, LoraSpec
from servers.backends import PolicyTrainer, TrainBatch, lora_spec_in
from servers.episodes.samples import Sample
from servers.trainers.grpo import (
    StartLogprobs,
    apply_optimizer_hparams,
    grpo_step,
    micro_batch_loss,
    optimizer_passes,
    recomputes,
)
from servers.trainers.micro_batches import MicroBatch, collate, pack_micro_batches
from servers.trainers.policy_model import load_policy_model, resolve_dtype, set_gradient_checkpointing
from servers.trainers.step_metrics import add_pass_stats
from servers.trainers.trainer_state import read_trainer_state, restore_rng_states, rng_states, write_trainer_state

__all__ = ["ADAPTER_DIR", "LoraGRPOTrainer", "lora_config"]

log = logging.getLogger(__name__)

#: A policy checkpoint's adapter, in PEFT's format, under the checkpoint directory.
ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def lora_config(spec: LoraSpec) -> LoraConfig:
    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                      target_modules=list(spec.target_modules), task_type="CAUSAL_LM")  # fmt: skip


def lora_shape(spec: LoraSpec) -> tuple[int, float, frozenset[str]]:
    """What an adapter's weights must agree on to be loaded into another (dropout is a training setting only)."""
    return spec.rank, float(spec.alpha), frozenset(spec.target_modules)


def policy_seed(seed: int, policy: str) -> int:
    """The seed of `policy`'s RNG stream: from its name, not its position, so adding a policy changes no other's."""
    return int(np.random.SeedSequence([seed, zlib.crc32(policy.encode())]).generate_state(1)[0])


@contextlib.contextmanager
def rng_stream(states: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Run the block on the RNG `states` (python, numpy, torch, CUDA); `states` holds the advanced ones afterwards
    and the process's own states are put back."""
    outer = rng_states()
    restore_rng_states(states)
    try:
        yield states
    finally:
        states.clear()
        states.update(rng_states())
        restore_rng_states(outer)


def seeded_states(seed: int) -> dict[str, Any]:
    """RNG states as `rng_states` returns them, after seeding every generator with `seed`."""
    outer = rng_states()
    try:
        torch.manual_seed(seed)  # also seeds every CUDA device
        np.random.seed(seed)
        random.seed(seed)
        return rng_states()
    finally:
        restore_rng_states(outer)


class AdapterOff:
    """The KL reference: `model` with every adapter turned off, i.e. the frozen base. Offers what
    `token_logprobs_and_entropy` calls on a model (forward, decoder, output head)."""

    def __init__(self, peft_model: PeftModel) -> None:
        self.peft_model = peft_model
        self.model = peft_model.get_base_model()

    def __call__(self, **kwargs: Any) -> Any:
        with self.peft_model.disable_adapter():
            return self.model(**kwargs)

    def get_decoder(self) -> torch.nn.Module:
        return self.model.get_decoder()

    def get_output_embeddings(self) -> Any:
        head = self.model.get_output_embeddings()

        def project(hidden: torch.Tensor) -> torch.Tensor:  # lm_head may be a LoRA target too
            with self.peft_model.disable_adapter():
                return head(hidden)

        return project


@dataclass
class PolicyState:
    """One policy's learner: everything of it but the adapter weights, which live in the shared model."""

    spec: LoraSpec
    config: GRPOConfig
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    rng: dict[str, Any]
    step_count: int = 0
    #: (done, total) micro-batch passes of the step running now, None between steps.
    progress: tuple[int, int] | None = None


def peft_key(name: str, policy: str) -> str | None:
    """PEFT's file name of the model parameter `name` if it belongs to `policy`'s adapter, else None: peft names the
    parameter `...lora_A.<policy>.weight` (or `lora_embedding_A.<policy>`) and saves it as `base_model.model.
    ...lora_A.weight`, without the adapter's name (the component right after a `lora_*` one)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_") and parts[i + 1] == policy:
            return ".".join(["base_model", "model", *parts[: i + 1], *parts[i + 2 :]])
    return None


def adapter_parameters(model: torch.nn.Module, policy: str) -> list[torch.nn.Parameter]:
    """The parameters of `policy`'s adapter, in the model's order (an optimizer's state is saved by position)."""
    return [param for name, param in model.named_parameters() if peft_key(name, policy) is not None]


def add_adapters(base: torch.nn.Module, specs: Mapping[str, LoraSpec], seed: int,
                 ) -> tuple[PeftModel, dict[str, dict[str, Any]]]:  # fmt: skip
    """`base` with one LoRA adapter per policy injected in place (peft), and each policy's RNG stream: it starts from
    (seed, policy) and initialises the adapter (A random, B = 0), so a policy's start does not depend on which other
    policies share the base."""
    peft_model: PeftModel | None = None
    rngs = {}
    for name, spec in specs.items():
        rngs[name] = seeded_states(policy_seed(seed, name))
        with rng_stream(rngs[name]):
            if peft_model is None:
                peft_model = get_peft_model(base, lora_config(spec), adapter_name=name)
            else:
                peft_model.add_adapter(name, lora_config(spec))
    return peft_model, rngs


@contextlib.contextmanager
def training_adapter(peft_model: PeftModel, policy: str) -> Iterator[None]:
    """Only `policy`'s adapter active and trainable (peft's set_adapter flags its parameters alone), its LoRA
    dropout (if any) in training mode; the rest of the model stays in eval mode."""
    peft_model.set_adapter(policy)
    dropouts = [m.lora_dropout[policy] for m in peft_model.modules()
                if hasattr(m, "lora_dropout") and policy in m.lora_dropout]  # fmt: skip
    for dropout in dropouts:
        dropout.train()
    try:
        yield
    finally:
        for dropout in dropouts:
            dropout.eval()


def check_adapter_fits(directory: Path, policy: str, spec: LoraSpec) -> None:
    """Refuse a checkpoint `directory` whose adapter is not of `policy`'s LoRA shape (it may be another policy's)."""
    saved = lora_spec_in(directory / ADAPTER_DIR)
    if lora_shape(saved) != lora_shape(spec):
        raise ValueError(f"policy {policy!r} is {spec}, the checkpoint in {directory} holds {saved}")


class PolicyStates(PolicyTrainer):
    """The per-policy bookkeeping both LoRA trainers answer the same way (this module's and the FSDP one,
    servers.trainers.fsdp_lora): `_states` maps each policy to its state (`step_count`, `progress`, `config`);
    `_lock` lets one call at a time touch them."""

    policies: tuple[str, ...]
    _states: Mapping[str, Any]
    _lock: threading.RLock

    def _state(self, policy: str) -> Any:
        try:
            return self._states[policy]
        except KeyError:
            raise KeyError(f"unknown policy {policy!r}; this trainer has {list(self.policies)}") from None

    def step_count(self, policy: str) -> int:
        return self._state(policy).step_count

    def progress(self, policy: str) -> tuple[int, int] | None:
        """(done, total) micro-batch passes of `policy`'s running step; None when it is not stepping."""
        return self._state(policy).progress

    def config(self, policy: str) -> GRPOConfig:
        return self._state(policy).config

    def set_config(self, policy: str, config: GRPOConfig) -> None:
        """Swap `policy`'s GRPO settings; read at its next step (as `GRPOTrainer.config`)."""
        with self._lock:
            self._state(policy).config = config


class LoraGRPOTrainer(PolicyStates):
    """GRPO + PPO-clip on LoRA policies of one frozen Hugging Face causal LM, CPU or one GPU."""

    def __init__(
        self,
        model_dir: str | Path,
        policies: Mapping[str, tuple[LoraSpec, GRPOConfig]],
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        seed: int = 0,
        serve_dtype: torch.dtype | str | None = None,
    ) -> None:
        """`serve_dtype`: the dtype `adapter_weights` hands out (the engine's); None: the trainer's, as
        `GRPOTrainer.named_weights` hands out its weights (the engine casts what it loads)."""
        if not policies:
            raise ValueError("LoraGRPOTrainer needs at least one policy")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype)
        self.serve_dtype = resolve_dtype(serve_dtype) if serve_dtype is not None else self.dtype
        self.numerics = str(self.dtype)  # as `GRPOTrainer.numerics`: what its logprobs are computed in
        self.policies = tuple(policies)
        self._lock = threading.RLock()
        base = load_policy_model(self.model_dir, self.dtype, self.device)
        self.peft_model, rngs = add_adapters(base, {name: spec for name, (spec, _) in policies.items()}, seed)
        self.model = self.peft_model.get_base_model()  # the HF model, its linear layers now LoRA layers
        self.model.eval()  # dropout off, as GRPOTrainer: the training forward reproduces the engine's logprobs
        self.model.requires_grad_(False)  # base and adapters; a step's set_adapter flags its own adapter trainable
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self._states = {name: self._new_state(name, spec, config, rngs[name])
                        for name, (spec, config) in policies.items()}  # fmt: skip
        self.reference = AdapterOff(self.peft_model)

    def _new_state(self, name: str, spec: LoraSpec, config: GRPOConfig, rng: dict[str, Any]) -> PolicyState:
        params = adapter_parameters(self.model, name)
        if not params:
            raise ValueError(f"policy {name!r}: its LoRA targets {spec.target_modules} match no layer of the model")
        optimizer = torch.optim.AdamW(params, lr=config.learning_rate, betas=tuple(config.adam_betas),
                                      weight_decay=config.weight_decay)  # fmt: skip
        return PolicyState(spec=spec, config=config, params=params, optimizer=optimizer, rng=rng)

    # ------------------------------------------------------------------------------------------------------------
    # The step
    # ------------------------------------------------------------------------------------------------------------

    def step(self, policy: str, batch: TrainBatch) -> dict[str, float]:
        with self._lock:
            state = self._state(policy)
            state.progress = None
            with rng_stream(state.rng), training_adapter(self.peft_model, policy):
                metrics = grpo_step(batch, state.config, step_count=state.step_count,
                                    with_ref=state.config.kl_coef > 0,
                                    train=lambda items, tokens: self._train(state, items, tokens))  # fmt: skip
            state.step_count += 1
            return metrics

    def _train(self, state: PolicyState, items: Sequence[tuple[Sample, float]], tokens_trained: float,
               ) -> dict[str, float]:  # fmt: skip
        """GRPO's steps 2-4 (as `GRPOTrainer._train`): `ppo_epochs` passes, each forward/backward over every
        micro-batch then one AdamW step of this policy's adapter."""
        cfg = state.config
        apply_optimizer_hparams(state.optimizer, cfg)
        set_gradient_checkpointing(self.model, cfg.gradient_checkpointing)
        ref = self.reference if cfg.kl_coef > 0 else None
        micro_batches = pack_micro_batches([len(s.token_ids) for s, _ in items], cfg.micro_batch_tokens)
        state.progress = (0, cfg.ppo_epochs * len(micro_batches))

        starts = StartLogprobs(cfg.ppo_epochs, recompute=recomputes(cfg))

        def collated(indices: list[int]) -> MicroBatch:
            return collate([items[i] for i in indices], self.device, self.vocab_size, state.step_count)

        def run_pass() -> dict[str, float]:  # forward + backward of L over every micro-batch (pi_start's first)
            stats = starts.recompute(self.model, map(collated, micro_batches))
            for index, indices in enumerate(micro_batches):
                mb = collated(indices)
                loss, mb_stats, start = micro_batch_loss(self.model, ref, mb, cfg, num_samples=len(items),  # type: ignore[arg-type]
                                                         start_logp=starts.get(index))  # fmt: skip
                starts.keep(index, start)
                loss.backward()
                add_pass_stats(stats, mb_stats)
                state.progress = (state.progress[0] + 1, state.progress[1])
            return stats

        totals = optimizer_passes(cfg, state.optimizer, state.params, run_pass, step_count=state.step_count)
        state.progress = None
        return totals.metrics(micro_batches=len(micro_batches), tokens_trained=tokens_trained,
                              with_ref=ref is not None)  # fmt: skip

    # ------------------------------------------------------------------------------------------------------------
    # Adapters for the inference engine
    # ------------------------------------------------------------------------------------------------------------

    def adapter_weights(self, policy: str) -> dict[str, torch.Tensor]:
        """`policy`'s adapter in PEFT's names (`base_model.model.<module>.lora_A.weight`, ...): detached CPU copies
        in `serve_dtype`."""
        with self._lock:
            self._state(policy)
            tensors = get_peft_model_state_dict(self.peft_model, adapter_name=policy, save_embedding_layers=False)
            return {name: t.detach().to("cpu", self.serve_dtype, copy=True) for name, t in tensors.items()}

    def export_adapter(self, policy: str, directory: Path) -> Path:
        """`policy`'s adapter as `directory/adapter_config.json` + `adapter_model.safetensors`."""
        with self._lock:
            self._state(policy)
            directory = Path(directory)
            directory.mkdir(parents=True, exist_ok=True)
            # peft writes a non-default adapter into a subfolder of its name: write aside, then move its files up.
            with tempfile.TemporaryDirectory(dir=directory, prefix=".export-") as tmp:
                self.peft_model.save_pretrained(tmp, selected_adapters=[policy], save_embedding_layers=False)
                written = next(p.parent for p in Path(tmp).rglob(ADAPTER_CONFIG))
                for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                    shutil.move(written / name, directory / name)
            return directory

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints (servers.trainers.trainer_state)
    # ------------------------------------------------------------------------------------------------------------

    def save(self, policy: str, directory: Path) -> None:
        """`directory/adapter/` (PEFT's format) and `directory/trainer_state.pt` (optimizer, step count, RNG)."""
        with self._lock:
            state = self._state(policy)
            directory = Path(directory)
            self.export_adapter(policy, directory / ADAPTER_DIR)
            write_trainer_state(directory, step_count=state.step_count, optimizer=state.optimizer.state_dict(),
                                config=state.config, model_dir=self.model_dir, rng=state.rng, policy=policy,
                                lora=state.spec.model_dump(mode="json"))  # fmt: skip

    def load(self, policy: str, directory: Path) -> None:
        """Restore `policy`'s adapter, optimizer, step count and RNG stream from `save`'s `directory`; it may come
        from another policy of the same LoRA shape (a policy forked from another's checkpoint)."""
        with self._lock:
            state = self._state(policy)
            directory = Path(directory)
            trainer_state = read_trainer_state(directory)
            adapter = directory / ADAPTER_DIR
            check_adapter_fits(directory, policy, state.spec)
            result = set_peft_model_state_dict(self.peft_model, load_file(adapter / ADAPTER_WEIGHTS),
                                               adapter_name=policy)  # fmt: skip
            missing = [k for k in result.missing_keys if f".{policy}." in k and "lora_" in k]
            if result.unexpected_keys or missing:
                raise ValueError(f"adapter in {adapter} does not fit policy {policy!r}: "
                                 f"unexpected {result.unexpected_keys[:3]}, missing {missing[:3]}")  # fmt: skip
            state.optimizer.load_state_dict(trainer_state["optimizer"])
            state.step_count = int(trainer_state["step_count"])
            state.rng = dict(trainer_state["rng"])

    def close(self) -> None:
        with self._lock:
            self._states.clear()
            self.peft_model = None
            self.model = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
