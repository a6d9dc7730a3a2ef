"""GRPO on several LoRA policies of one frozen base model sharded over FSDP2 ranks (`FSDPLoraTrainer`).

The `PolicyTrainer` of a server whose policies sync `trainer: fsdp`: the one-process `LoraGRPOTrainer`'s policies
(each its own adapter, optimizer, step count, RNG stream and checkpoints; the base frozen, the KL reference the base
with the adapters off) with the base sharded like the full `FSDPTrainer`'s. It owns the rank processes
(servers.trainers.fsdp_ranks.RankGroup), each a `servers.trainers.fsdp_lora_rank.ShardedLoraPolicies`.

A step of a policy is the full FSDP trainer's (`grpo_step` here, the samples split over the ranks and their metric
sums added up by `train_on_ranks`), with that policy's name sent first: its ranks run its passes with only its
adapter active, and its AdamW steps its adapter's shards alone. The step's math is the one-process trainer's: N ranks
make the update `LoraGRPOTrainer` makes, up to float summation order (tests/servers/test_fsdp_lora.py).

The ranks' settings are the policies' `fsdp` sections: `ranks` and `mixed_precision` are read once, at start, and
every policy must give the same ones. Checkpoints are per policy: `adapter/` in PEFT's format and
`trainer_state.pt` (servers.trainers.trainer_state; the optimizer gathered and keyed by position, as the one-process
trainer writes it). Like the full FSDP trainer, this has only run on the CPU with gloo, never on a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from marl.protocol import FSDPConfig, GRPOConfig, LoraSpec
from servers.backends import TrainBatch
from servers.episodes.samples import Sample
from servers.placement import Placement
from servers.trainers.fsdp import rank_numerics, start_ranks, train_on_ranks
from servers.trainers.fsdp_lora_rank import ShardedLoraPolicies
from servers.trainers.grpo import grpo_step
from servers.trainers.lora_grpo import ADAPTER_DIR, PolicyStates, check_adapter_fits
from servers.trainers.policy_model import resolve_dtype

__all__ = ["FSDPLoraTrainer", "rank_settings"]


def rank_settings(configs: Mapping[str, FSDPConfig]) -> FSDPConfig:
    """What the shared ranks start with: the `ranks` and `mixed_precision` every policy's section agrees on."""
    settings = {(config.ranks, config.mixed_precision) for config in configs.values()}
    if len(settings) != 1:
        given = ", ".join(f"{name}: ranks={c.ranks}, mixed_precision={c.mixed_precision}"
                          for name, c in configs.items())  # fmt: skip
        raise ValueError(f"the policies of one server share their FSDP ranks: give them the same fsdp.ranks and"
                         f" fsdp.mixed_precision ({given})")  # fmt: skip
    ranks, mixed_precision = settings.pop()
    return FSDPConfig(ranks=ranks, mixed_precision=mixed_precision)


@dataclass
class _Policy:
    spec: LoraSpec
    config: GRPOConfig
    step_count: int = 0
    #: (done, total) micro-batch passes of the step running now, None between steps.
    progress: tuple[int, int] | None = None


class FSDPLoraTrainer(PolicyStates):
    """GRPO + PPO-clip on LoRA policies of one frozen base sharded over `fsdp.ranks` processes (CPU gloo, or a GPU
    each). `threads_per_rank`, `timeout_s`, `placement`: as `FSDPTrainer`'s. `serve_dtype`: the dtype
    `adapter_weights` hands out (None: the master weights')."""

    def __init__(
        self,
        model_dir: str | Path,
        policies: Mapping[str, tuple[LoraSpec, FSDPConfig]],
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        seed: int = 0,
        serve_dtype: torch.dtype | str | None = None,
        threads_per_rank: int | None = None,
        timeout_s: float = 600.0,
        placement: Placement | None = None,
    ) -> None:
        if not policies:
            raise ValueError("FSDPLoraTrainer needs at least one policy")
        self.model_dir = Path(model_dir)
        self.policies = tuple(policies)
        self.serve_dtype = resolve_dtype(serve_dtype) if serve_dtype is not None else None
        self._lock = threading.RLock()  # one call at a time: the policies share the ranks
        self._states = {name: _Policy(spec, config) for name, (spec, config) in policies.items()}
        settings = rank_settings({n: c for n, (_, c) in policies.items()})
        self.ranks = start_ranks(self.model_dir, settings,
                                 device=device, dtype=dtype, threads_per_rank=threads_per_rank, timeout_s=timeout_s,
                                 placement=placement, lora=dict(policies), seed=seed,
                                 shard_class=ShardedLoraPolicies)  # fmt: skip
        self.vocab_size = int(self.ranks.started[0]["vocab_size"])
        self.numerics = rank_numerics(settings, self.ranks.started[0]["device"], dtype)  # as `FSDPTrainer.numerics`

    def step(self, policy: str, batch: TrainBatch) -> dict[str, float]:
        with self._lock:
            state = self._state(policy)
            state.progress = None
            with_ref = state.config.kl_coef > 0  # the reference costs nothing here: the adapter turned off

            def train(items: list[tuple[Sample, float]], tokens_trained: float) -> dict[str, float]:
                def report(done: int, total: int) -> None:
                    state.progress = (done, total)

                try:
                    return train_on_ranks(self.ranks, items, tokens_trained, state.config, vocab_size=self.vocab_size,
                                          with_ref=with_ref, report=report, head=(policy,),
                                          start_version=state.step_count)  # fmt: skip
                finally:
                    state.progress = None

            metrics = grpo_step(batch, state.config, step_count=state.step_count, with_ref=with_ref, train=train)
            state.step_count += 1
            return metrics

    def adapter_weights(self, policy: str) -> dict[str, torch.Tensor]:
        """`policy`'s adapter in PEFT's names, gathered by rank 0: CPU tensors in `serve_dtype`."""
        with self._lock:
            self._state(policy)
            return self.ranks.call("adapter", policy, self.serve_dtype)[0]

    def export_adapter(self, policy: str, directory: Path) -> Path:
        """`policy`'s adapter as `directory/adapter_config.json` + `adapter_model.safetensors`, written by rank 0."""
        with self._lock:
            self._state(policy)
            directory = Path(directory)
            directory.mkdir(parents=True, exist_ok=True)
            self.ranks.call("export", policy, str(directory))
            return directory

    def save(self, policy: str, directory: Path) -> None:
        """`directory/adapter/` (PEFT's format) and `directory/trainer_state.pt` (optimizer, step count, RNGs)."""
        with self._lock:
            state = self._state(policy)
            (Path(directory) / ADAPTER_DIR).mkdir(parents=True, exist_ok=True)
            self.ranks.call("save", policy, str(directory), state.step_count, state.config)

    def load(self, policy: str, directory: Path) -> None:
        """Restore `policy` from `save`'s `directory` (or `LoraGRPOTrainer.save`'s; it may be another policy's of
        the same LoRA shape)."""
        with self._lock:
            state = self._state(policy)
            check_adapter_fits(Path(directory), policy, state.spec)
            state.step_count = self.ranks.call("load", policy, str(directory), state.config)[0]

    def close(self) -> None:
        """Stop the rank processes. Idempotent."""
        self.ranks.close()
