"""The FSDP2 trainer: the GRPO step of `servers.trainers.grpo`, sharded over N torch.distributed ranks.

`FSDPTrainer` is what the server holds (`trainer: fsdp`, knobs under `fsdp:` with `ranks: N`). It owns N rank
processes (`servers.trainers.fsdp_ranks.RankGroup`, each a `servers.trainers.fsdp_worker` shard of the policy),
kept alive across steps. A step:

1. computes advantages and the batch metrics here (`grpo_step`, as the one-process trainer does);
2. splits the trained samples over the ranks (longest first, each to the rank with the fewest tokens so far), packs
   each rank's share into micro-batches under `micro_batch_tokens`, and pads every rank to as many micro-batches
   as the busiest one (FSDP's collectives need every rank in every forward and backward);
3. sends each rank its plan and S, the step's sample count: the ranks' gradients sum to the one-process trainer's
   dL/dtheta, so N ranks make the same update as one process (up to float summation order);
4. adds up the ranks' metric sums per pass into the same metrics dict `GRPOTrainer` returns.

Built for models no one device holds (7B, 14B): each rank builds its shard on the meta device and takes its
weights from rank 0's read of the files; the forward computes in bf16 over fp32 master weights (`mixed_precision`,
bf16 on CUDA by default); gradients are reduce-scattered after every micro-batch; logprobs are taken a chunk of
tokens at a time (servers.trainers.policy_model). None of this has run on a GPU yet: it is tested on the CPU with
gloo (tests/servers/test_fsdp_trainer.py, test_fsdp_scale.py).

Weights leave through directories only (`named_weights` is None): `export_weights` has rank 0 gather the full
model in the compute dtype and write a Hugging Face directory (plus the tokenizer), which the engine loads with
`load_weights_from`. A checkpoint holds every rank's shards of the weights and the optimizer state
(`torch.distributed.checkpoint`, written by each rank on a thread), every rank's RNG, and that same export, so a
static server can serve it (servers.trainers.fsdp_state). It loads at any number of ranks, and the one-process
trainer loads it too (and this one the one-process trainer's). A dead or failing rank makes the call raise
`RankFailure` and takes the group down; `close` stops the ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from marl.protocol import FSDPConfig, GRPOConfig
from servers.backends import TrainBatch, Trainer
from servers.engines.weight_transfer import TransferTarget, WeightTransferError
from servers.episodes.samples import Sample
from servers.placement import Placement
from servers.trainers.device_memory import memory_metrics
from servers.trainers.fsdp_model import compute_dtype
from servers.trainers.fsdp_ranks import RankFailure, RankGroup
from servers.trainers.fsdp_worker import PassResult, RankSpec
from servers.trainers.grpo import grpo_step
from servers.trainers.micro_batches import check_token_ids, pack_micro_batches
from servers.trainers.policy_model import resolve_dtype
from servers.trainers.step_metrics import PassTotals, add_pass_stats
from servers.trainers.trainer_state import copy_tokenizer, restore_rng_states, rng_states

if TYPE_CHECKING:
    from servers.trainers.ray_ranks import RayRankGroup

__all__ = ["FSDPConfig", "FSDPTrainer", "RankFailure", "plan_micro_batches", "rank_numerics", "start_ranks",
           "train_on_ranks"]


def plan_micro_batches(lengths: Sequence[int], ranks: int, budget: int) -> list[list[list[int] | None]]:
    """For each rank, its micro-batches as indices into `lengths`, every rank with as many (None: a padding pass).

    Samples go longest first to the rank with the fewest tokens so far (ties: the lowest rank); each rank's share is
    packed by `pack_micro_batches`.
    """
    shares: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += lengths[i]
    plans: list[list[list[int] | None]] = [
        [[share[j] for j in mb] for mb in pack_micro_batches([lengths[i] for i in share], budget)] for share in shares
    ]
    width = max(len(plan) for plan in plans)
    return [plan + [None] * (width - len(plan)) for plan in plans]


def rank_numerics(config: FSDPConfig, device: str | torch.device | None, dtype: torch.dtype | str | None) -> str:
    """What the ranks compute logprobs in (their `compute_dtype`), said as an engine's `numerics` says it: the
    server compares the two to resolve `recompute_logprobs: auto` (servers.training.lifecycle)."""
    device_type = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type
    return str(compute_dtype(config.mixed_precision, device_type, resolve_dtype(dtype)))


def check_rank_gpus(ranks: int, placement: Placement) -> tuple[int, ...] | None:
    """The server's trainer GPUs for `fsdp.ranks` local ranks (one each), or ValueError if they are not as many."""
    gpus = placement.trainer_gpus
    if gpus is not None and len(gpus) != ranks:
        raise ValueError(f"fsdp.ranks={ranks}, but the server's placement gives {len(gpus)} trainer GPUs (one rank"
                         " each): make them equal")
    return gpus


def start_ranks(model_dir: Path, config: FSDPConfig, *, device: str | torch.device | None,
                dtype: torch.dtype | str | None, threads_per_rank: int | None, timeout_s: float,
                placement: Placement | None, **spec_fields: Any) -> RankGroup | RayRankGroup:  # fmt: skip
    """`config.ranks` ranks, each started with a `RankSpec` (plus `spec_fields`): processes of this server, or with
    `placement.ranks_on_ray` Ray actors in the server's placement group (servers.trainers.ray_ranks)."""
    placement = placement or Placement()

    def spec(device_type: str, threads: int | None) -> RankSpec:
        return RankSpec(model_dir=str(model_dir), config=config, world_size=config.ranks, device_type=device_type,
                        dtype=None if dtype is None else str(dtype), threads=threads, timeout_s=timeout_s,
                        **spec_fields)  # fmt: skip

    if placement.ranks_on_ray:  # ray is imported only here: a server without Ray never imports it
        from servers.trainers.ray_ranks import RayRankGroup, rank_bundle

        bundle = rank_bundle(placement.ray_group, placement.ray_address)  # each rank's: a GPU, or CPUs
        device_type = torch.device(device).type if device is not None else "cuda" if bundle.get("GPU") else "cpu"
        threads = threads_per_rank or (max(1, int(bundle.get("CPU", 1))) if device_type == "cpu" else None)
        return RayRankGroup(spec(device_type, threads), group=placement.ray_group, start_timeout_s=timeout_s)
    device_type = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type
    gpus = check_rank_gpus(config.ranks, placement)
    gpus_needed = max(gpus) + 1 if gpus else config.ranks
    if device_type == "cuda" and torch.cuda.device_count() < gpus_needed:
        raise ValueError(f"fsdp.ranks={config.ranks} on this node needs GPUs 0..{gpus_needed - 1};"
                         f" {torch.cuda.device_count()} visible")
    if device_type == "cpu" and threads_per_rank is None:
        threads_per_rank = cpu_threads_per_rank(config.ranks)
    return RankGroup(spec(device_type, threads_per_rank), start_timeout_s=timeout_s, trainer_gpus=gpus)


def cpu_threads_per_rank(ranks: int) -> int:
    """CPU ranks share the threads this server was given (OMP_NUM_THREADS, which `marl run` sets to the server's
    share of the cores, else torch's default of one per core), not every core of the machine."""
    return max(1, torch.get_num_threads() // ranks)


def train_on_ranks(ranks: RankGroup, items: list[tuple[Sample, float]], tokens_trained: float, config: GRPOConfig,
                   *, vocab_size: int, with_ref: bool, report: Callable[[int, int], None],
                   head: tuple = (), start_version: int | None = None) -> dict[str, float]:  # fmt: skip
    """GRPO's steps 2-4 on the ranks (module docstring, 2-4): each rank's plan, its passes, their metrics added up.
    `head`: arguments sent before each rank's (plan, S, config, start_version), e.g. the LoRA policy's name;
    `start_version`: the version the step starts from (older tokens are off-policy: grpo.py, step 2)."""
    for sample, _ in items:  # refused here, before the ranks start a step they could not finish together
        check_token_ids(sample, vocab_size)
    plans = plan_micro_batches([len(s.token_ids) for s, _ in items], ranks.world_size, config.micro_batch_tokens)
    per_rank: list[tuple] = [
        (*head, [None if mb is None else [items[i] for i in mb] for mb in plan], len(items), config, start_version)
        for plan in plans
    ]
    report(0, config.ppo_epochs * len(plans[0]))
    passes: list[list[PassResult]] = ranks.call("train", per_rank=per_rank, on_progress=report)
    totals = PassTotals()
    for epoch in zip(*passes, strict=True):  # the ranks' results of one pass
        stats: dict[str, float] = {}
        for rank_stats, _, _ in epoch:
            add_pass_stats(stats, rank_stats)
        _, grad_norm, stepped = epoch[0]  # global: the same on every rank
        totals.add(stats, grad_norm, stepped=stepped)
    micro_batches = sum(mb is not None for plan in plans for mb in plan)
    return totals.metrics(micro_batches=micro_batches, tokens_trained=tokens_trained, with_ref=with_ref)


class FSDPTrainer(Trainer):
    """GRPO + PPO-clip with the policy sharded over `config.ranks` processes (CPU with gloo, or a GPU each).

    `threads_per_rank`: torch threads of each CPU rank (default: the cores split between the ranks). `timeout_s`: how
    long the ranks may take to start, and a collective may wait for a peer before the step fails.
    """

    def __init__(
        self,
        model_dir: str | Path,
        config: FSDPConfig,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        threads_per_rank: int | None = None,
        timeout_s: float = 600.0,
        placement: Placement | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.config = config  # read at every step: a caller may swap it between steps (not `ranks`)
        self._with_ref = config.kl_coef > 0  # the ranks hold the frozen reference iff asked for at start
        self.ranks = start_ranks(self.model_dir, config, device=device, dtype=dtype, threads_per_rank=threads_per_rank,
                                 timeout_s=timeout_s, placement=placement)  # fmt: skip
        self.vocab_size = int(self.ranks.started[0]["vocab_size"])
        # bf16 on CUDA by default (`mixed_precision`), as the ranks' own device says (under Ray: their bundles')
        self.numerics = rank_numerics(config, self.ranks.started[0]["device"], dtype)
        self.step_count = 0

    def step(self, batch: TrainBatch) -> dict[str, float]:
        self.progress = None
        metrics = grpo_step(batch, self.config, step_count=self.step_count, with_ref=self._with_ref,
                            train=self._train)  # fmt: skip
        self.step_count += 1
        return metrics

    def _train(self, items: list[tuple[Sample, float]], tokens_trained: float) -> dict[str, float]:
        try:
            return train_on_ranks(self.ranks, items, tokens_trained, self.config, vocab_size=self.vocab_size,
                                  with_ref=self._with_ref, report=self._on_progress,
                                  start_version=self.step_count)  # fmt: skip
        finally:
            self.progress = None

    def _on_progress(self, done: int, total: int) -> None:
        self.progress = (done, total)

    def push_weights(self, target: TransferTarget) -> None:
        """The policy into vLLM's weight-transfer engine, gathered by all ranks and sent by rank 0 bucket by bucket
        (servers.trainers.fsdp_push); WeightTransferError when it failed (the ranks stay whole: the server falls
        back to `export_weights`)."""
        failure = self.ranks.call("push", target)[0]
        if failure is not None:
            raise WeightTransferError(failure)

    def release_memory(self) -> dict[str, float]:
        """Every rank emptied its allocator's cache at the end of the step already (servers.trainers.fsdp_worker);
        this reads what they held before and after, largest over the ranks (on a GPU; nothing on the CPU)."""
        return memory_metrics(self.ranks.call("memory"))

    def export_weights(self, directory: Path) -> Path:
        """The policy as a Hugging Face model directory (config, safetensors, tokenizer), gathered by rank 0."""
        directory = Path(directory)
        self.ranks.call("export", str(directory))
        copy_tokenizer(self.model_dir, directory)
        return directory

    def save(self, directory: Path) -> None:
        """A checkpoint (servers.training.checkpoint_dirs makes it atomic): the ranks' shards of the weights and
        optimizer, an export a static server serves, step, RNGs. Returns once all of it is on disk."""
        directory = Path(directory)
        self.ranks.call("save", str(directory), self.step_count, self.config, rng_states())
        copy_tokenizer(self.model_dir, directory)

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote (or what `GRPOTrainer.save` wrote) on every rank, and this process's RNG."""
        state = self.ranks.call("load", str(directory), self.config)[0]
        self.step_count = state["step_count"]
        restore_rng_states(state["rng"])

    def close(self) -> None:
        """Stop the rank processes (the engine stopped). Idempotent."""
        self.ranks.close()
