"""GRPO trainer (torch + transformers): group-relative advantages, PPO-clip, optional KL, in one file.

Read top to bottom. One `GRPOTrainer.step(batch)` does:

1. **Advantages, per group** (a group = one (job, task, agent) with the samples of `num_repeat`+ episodes).
   Rewards are taken per *episode* (all samples of one episode and agent share its reward), so an episode that
   produced two unmerged samples does not count twice in the baseline::

       r_e  = reward of episode e in the group
       A_e  = r_e - mean_g(r)                                   group-relative baseline
       A_e  = A_e / (std_g(r) + eps)   if normalize_advantage_std   (population std, eps = 1e-6)

   A group whose rewards are all equal (std_g(r) <= 1e-8) carries no signal: it is counted in
   `groups_zero_variance` and, with `skip_zero_variance_groups`, not trained on. Every sample gets its episode's A.

2. **PPO-clip loss** against the behaviour logprobs recorded by the inference engine (`Sample.logprobs`). For each
   token t of sample s with loss_mask 1 (the model's own tokens)::

       logp_t  = log_softmax(logits_{t-1})[x_t]                 fp32, temperature 1 (`token_logprobs`), computed
                                                                a chunk of tokens at a time, never the [T, V]
                                                                logits at once (servers.trainers.policy_model)
       ratio_t = exp(logp_t - logp_old_t)
       pg_t    = max(-A_s * ratio_t, -A_s * clip(ratio_t, 1 - clip_eps_low, 1 + clip_eps_high))
       kl_t    = exp(logp_ref_t - logp_t) - (logp_ref_t - logp_t) - 1     k3 estimator of KL(pi || pi_ref),
                                                                          only when kl_coef > 0
       l_t     = pg_t + kl_coef * kl_t

3. **Loss aggregation: the mean over samples of each sample's token-mean**::

       L = 1/S * sum_s ( 1/|T_s| * sum_{t in T_s} l_t )          S = samples with >= 1 trained token

   A sample is one agent's merged sequence of one episode (all its calls, interleaved loss mask). Each sample
   weighs the same whatever its length, so a long episode does not drown the short ones in its group (a token-level
   mean over the batch would weight a sample by its length). The price, known from "Dr. GRPO": within one sample a
   token of a short reply moves more than a token of a long one. Samples with no trained token are left out of S.

4. **Micro-batches and epochs.** Samples are sorted by length and packed greedily so that
   (sequences in the micro-batch) x (longest sequence) <= `micro_batch_tokens`; right padding inside a micro-batch;
   a sequence longer than the budget goes alone. Each micro-batch adds `sum_{s in mb} loss_s / S` to the loss and
   calls backward, so the accumulated gradient is exactly dL/dtheta whatever the packing. One AdamW step per pass
   (after clipping the global grad norm to `max_grad_norm`), `ppo_epochs` passes per `step`.

The model runs in eval mode (dropout off): with the same weights, the training forward pass reproduces the
engine's logprobs, so on the first pass ratio = 1 up to kernel noise (`logprob_diff_max` measures the gap between
the engine and the trainer: a large value means they disagree about the model).

Around the algorithm, in their own modules: packing samples into micro-batches (servers.trainers.micro_batches),
loading the policy in eval mode and taking its logprobs a chunk of tokens at a time (servers.trainers.policy_model),
the metrics dict (servers.trainers.step_metrics), and checkpoints (servers.trainers.trainer_state): `save(dir)` writes
a Hugging Face model directory plus the optimizer, step count and RNG states. Steps 1-3 are module functions
(`grpo_step`, `trainable_items`, `micro_batch_loss`): the FSDP2 trainer (servers.trainers.fsdp) runs the same ones,
step 1 in the server and 2-3 on each rank.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from marl.protocol import GRPOConfig
from servers.engines.weight_transfer import TransferTarget, WeightPusher, unique_tensors
from servers.interfaces import Group, TrainBatch, Trainer
from servers.samples import Sample
from servers.trainers.micro_batches import MicroBatch, collate, pack_micro_batches, trained_tokens
from servers.trainers.policy_model import (
    load_policy_model,
    resolve_dtype,
    set_gradient_checkpointing,
    token_logprobs_and_entropy,
)
from servers.trainers.step_metrics import PassTotals, add_pass_stats, batch_metrics, idle_pass_metrics
from servers.trainers.trainer_state import (
    SHARDED_DIR,
    TRAINER_STATE_FILE,
    copy_tokenizer,
    load_sharded_state,
    read_trainer_state,
    restore_rng_states,
    rng_states,
    write_trainer_state,
)

__all__ = [
    "ADV_EPS",
    "Advantages",
    "GRPOTrainer",
    "TRAINER_STATE_FILE",
    "apply_optimizer_hparams",
    "compute_advantages",
    "grpo_step",
    "micro_batch_loss",
    "optimizer_passes",
    "pack_micro_batches",
    "token_logprobs",
    "trainable_items",
]

log = logging.getLogger(__name__)

#: eps in A = (r - mean) / (std + eps).
ADV_EPS = 1e-6
#: A group whose reward std is at most this has "zero variance" (no learning signal).
ZERO_VARIANCE_STD = 1e-8
#: log-ratios are clamped to +-this before exp, so a very stale token cannot overflow the loss to inf.
MAX_LOG_RATIO = 20.0


# ----------------------------------------------------------------------------------------------------------------
# Logprobs: the one function both the trainer and the tests use
# ----------------------------------------------------------------------------------------------------------------


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-token logprobs of `input_ids` under `model`, shape [B, T], fp32, aligned with the tokens.

    `out[b, t] = log_softmax(logits[b, t - 1])[input_ids[b, t]]` with the raw logits (temperature 1): the number
    the inference engine records as a sampled token's logprob (`Sample.logprobs`). `out[:, 0]` and padded
    positions are 0. Right padding (attention_mask 0 after the tokens) is expected. Gradients flow unless the
    caller wraps the call in `torch.no_grad()`.
    """
    return token_logprobs_and_entropy(model, input_ids, attention_mask)[0]


# ----------------------------------------------------------------------------------------------------------------
# Step 1: group-relative advantages
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Advantages:
    """What `compute_advantages` makes of a batch's groups."""

    #: (sample, advantage) of every sample in a group that is trained on, in batch order.
    items: list[tuple[Sample, float]] = field(default_factory=list)
    groups: int = 0
    groups_zero_variance: int = 0
    groups_trained: int = 0
    #: Episode rewards per agent (one per episode of each group), for the reward metrics.
    rewards_by_agent: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))


def _check_sample(sample: Sample) -> None:
    n = len(sample.token_ids)
    if len(sample.loss_mask) != n or len(sample.logprobs) != n:
        raise ValueError(
            f"sample of episode {sample.episode_id!r} (agent {sample.agent!r}) has {n} token_ids, "
            f"{len(sample.loss_mask)} loss_mask entries and {len(sample.logprobs)} logprobs: they must be equal"
        )
    if any(m not in (0, 1) for m in sample.loss_mask):
        raise ValueError(f"sample of episode {sample.episode_id!r}: loss_mask entries must be 0 or 1")


def compute_advantages(
    groups: Sequence[Group], *, normalize_std: bool = True, skip_zero_variance: bool = True, eps: float = ADV_EPS
) -> Advantages:
    """A_e = r_e - mean_g(r) [/ (std_g(r) + eps)], per group, over the group's episodes; see the module docstring."""
    out = Advantages()
    for group in groups:
        out.groups += 1
        for sample in group.samples:
            _check_sample(sample)
        # r_e: one reward per episode (its samples share it; the mean guards against a caller that differs).
        per_episode: dict[str, list[float]] = defaultdict(list)
        for sample in group.samples:
            per_episode[sample.episode_id].append(float(sample.reward))
        rewards = {ep: sum(rs) / len(rs) for ep, rs in per_episode.items()}
        out.rewards_by_agent[group.agent].extend(rewards.values())

        r = np.array(list(rewards.values()), dtype=np.float64)
        mean = float(r.mean()) if len(r) else 0.0
        std = float(r.std()) if len(r) else 0.0  # population std (ddof=0)
        zero_variance = std <= ZERO_VARIANCE_STD
        if zero_variance:
            out.groups_zero_variance += 1
            if skip_zero_variance:
                continue
        out.groups_trained += 1
        for sample in group.samples:
            a = rewards[sample.episode_id] - mean  # A = r - mean(group)
            if normalize_std:
                a = a / (std + eps)  # A = (r - mean) / (std + eps)
            out.items.append((sample, a))
    return out


# ----------------------------------------------------------------------------------------------------------------
# Steps 2-4: the trainer
# ----------------------------------------------------------------------------------------------------------------


def trainable_items(batch: TrainBatch, config: GRPOConfig) -> tuple[list[tuple[Sample, float]], dict[str, float]]:
    """Step 1: the (sample, advantage) pairs to train on (a sample without a trained token adds nothing to L) and
    the batch's metrics (rewards, groups, tokens)."""
    adv = compute_advantages(
        batch.groups, normalize_std=config.normalize_advantage_std, skip_zero_variance=config.skip_zero_variance_groups
    )
    items = [(s, a) for s, a in adv.items if trained_tokens(s) > 0]
    return items, batch_metrics(adv, items, batch.dropped_stale)


def grpo_step(
    batch: TrainBatch,
    config: GRPOConfig,
    *,
    step_count: int,
    with_ref: bool,
    train: Callable[[list[tuple[Sample, float]], float], dict[str, float]],
) -> dict[str, float]:
    """One GRPO step around a backend's passes (one process or N ranks): step 1 here, then
    `train(items, tokens_trained)` runs steps 2-4 and returns the pass metrics. The caller bumps its step count."""
    t0 = time.perf_counter()
    if batch.step != step_count + 1:
        log.warning("batch.step=%d but the trainer is at step %d", batch.step, step_count)
    items, metrics = trainable_items(batch, config)
    if items:
        metrics.update(train(items, metrics["tokens_trained"]))
    else:  # nothing trainable: no optimizer step, but the version still moves on (the server bumps it)
        metrics.update(idle_pass_metrics(with_ref=with_ref))
    metrics.update(policy_version=float(step_count + 1), seconds=time.perf_counter() - t0)
    return metrics


def micro_batch_loss(
    policy: torch.nn.Module, ref: torch.nn.Module | None, mb: MicroBatch, config: GRPOConfig, num_samples: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """Steps 2-3 on one micro-batch: L_mb = sum_{s in mb} (1/|T_s| sum_t l_t) / S, with S = `num_samples` (all the
    samples of the step, on every rank), so the micro-batches' L_mb add up to L; and the metric sums of mb."""
    logp, entropy = token_logprobs_and_entropy(policy, mb.input_ids, mb.attention_mask, keep=mb.loss_mask,
                                               with_entropy=True)  # fmt: skip
    mask = mb.loss_mask
    tokens_per_sample = mask.sum(-1).clamp(min=1.0)  # |T_s|
    stats: dict[str, float] = {}

    # ratio_t = exp(logp_t - logp_old_t), 1 off the trained tokens
    log_ratio = ((logp - mb.old_logp) * mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    # pg_t = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
    a = mb.advantages[:, None]
    pg_unclipped = -a * ratio
    pg_clipped = -a * torch.clamp(ratio, 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    loss_t = pg
    # kl_t = exp(logp_ref - logp) - (logp_ref - logp) - 1   (k3, >= 0)
    if ref is not None:
        with torch.no_grad():
            ref_logp = token_logprobs_and_entropy(ref, mb.input_ids, mb.attention_mask, keep=mask)[0]
        ref_log_ratio = ((ref_logp - logp) * mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        kl_ref = torch.exp(ref_log_ratio) - ref_log_ratio - 1.0
        if config.kl_coef > 0:
            loss_t = loss_t + config.kl_coef * kl_ref
        stats["kl_ref"] = float((kl_ref.detach() * mask).sum())

    # L_mb = sum_{s in mb} (sum_t l_t * mask_t / |T_s|) / S   -> sum over micro-batches = L
    loss = ((loss_t * mask).sum(-1) / tokens_per_sample).sum() / num_samples

    with torch.no_grad():
        trained = mask.bool()
        diff = (logp - mb.old_logp).abs()[trained]
        stats.update(
            loss=float(loss),
            pg_loss=float(((pg * mask).sum(-1) / tokens_per_sample).sum() / num_samples),
            tokens=float(mask.sum()),
            clipped=float(((pg_clipped > pg_unclipped) & trained).sum()),
            kl_old=float(((ratio - 1.0 - log_ratio) * mask).sum()),  # approx KL(old || new) = E_old[(r - 1) - log r]
            entropy=float((entropy * mask).sum()),
            logprob_diff_sum=float(diff.sum()),
            logprob_diff_max=float(diff.max()) if diff.numel() else 0.0,
        )
    return loss, stats


def apply_optimizer_hparams(optimizer: torch.optim.Optimizer, config: GRPOConfig) -> None:
    """Apply `config` to the optimizer (after a load, whose saved param groups hold the old run's values)."""
    for group in optimizer.param_groups:
        group["lr"] = config.learning_rate
        group["betas"] = tuple(config.adam_betas)
        group["weight_decay"] = config.weight_decay


def optimizer_passes(config: GRPOConfig, optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter],
                     run_pass: Callable[[], dict[str, float]], *, step_count: int) -> PassTotals:  # fmt: skip
    """Step 4's loop, `ppo_epochs` times: `run_pass()` (forward + backward of L over every micro-batch, returning
    the metric sums), clip the global grad norm of `params` to `max_grad_norm`, one optimizer step unless that norm
    is not finite. Shared by `GRPOTrainer` and the LoRA trainer (servers.trainers.lora_grpo)."""
    totals = PassTotals()
    for epoch in range(config.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        stats = run_pass()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm))
        finite = math.isfinite(grad_norm)
        if finite:
            optimizer.step()
        else:
            log.warning("non-finite gradient norm at step %d epoch %d: update skipped", step_count, epoch)
        optimizer.zero_grad(set_to_none=True)
        totals.add(stats, grad_norm, stepped=finite)
    return totals


class GRPOTrainer(Trainer):
    """GRPO + PPO-clip on a Hugging Face causal LM, CPU or one GPU."""

    def __init__(
        self,
        model_dir: str | Path,
        config: GRPOConfig,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.config = config  # read at every step: a caller may swap it between steps
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype)
        self.policy = load_policy_model(self.model_dir, self.dtype, self.device)
        # Frozen reference = the initial model, for the KL penalty (also after `load`: it stays the initial model).
        self.ref: torch.nn.Module | None = None
        if config.kl_coef > 0:
            self.ref = load_policy_model(self.model_dir, self.dtype, self.device)
            self.ref.requires_grad_(False)
        self.params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.learning_rate, betas=tuple(config.adam_betas), weight_decay=config.weight_decay
        )
        self.vocab_size = self.policy.get_input_embeddings().num_embeddings
        self.step_count = 0  # == policy version: the number of `step` calls so far
        self._pusher: WeightPusher | None = None  # pushes into vLLM's weight-transfer engine (push_weights)

    def step(self, batch: TrainBatch) -> dict[str, float]:
        self.progress = None  # until the passes are known (a failed step may have left its count behind)
        metrics = grpo_step(batch, self.config, step_count=self.step_count, with_ref=self.ref is not None,
                            train=self._train)  # fmt: skip
        self.step_count += 1
        return metrics

    def _train(self, items: Sequence[tuple[Sample, float]], tokens_trained: float) -> dict[str, float]:
        """2-4. `ppo_epochs` passes; each pass = forward/backward over all micro-batches, then one AdamW step."""
        cfg = self.config
        apply_optimizer_hparams(self.optimizer, cfg)
        set_gradient_checkpointing(self.policy, cfg.gradient_checkpointing)
        micro_batches = pack_micro_batches([len(s.token_ids) for s, _ in items], cfg.micro_batch_tokens)
        self.progress = (0, cfg.ppo_epochs * len(micro_batches))
        run_pass = lambda: self.accumulate_gradients(items, micro_batches)  # noqa: E731 - read at call time (tests wrap it)
        totals = optimizer_passes(cfg, self.optimizer, self.params, run_pass, step_count=self.step_count)
        self.progress = None
        return totals.metrics(micro_batches=len(micro_batches), tokens_trained=tokens_trained,
                              with_ref=self.ref is not None)  # fmt: skip

    def accumulate_gradients(
        self, items: Sequence[tuple[Sample, float]], micro_batches: list[list[int]] | None = None
    ) -> dict[str, float]:
        """One pass: forward + backward of L over all micro-batches; gradients add up in `param.grad`.

        No optimizer step, no zero_grad. `items` are (sample, advantage) pairs, each sample with >= 1 trained token.
        Returns sums for the metrics (tokens, clipped tokens, entropy, KLs, ...) and the loss L.
        """
        if micro_batches is None:
            micro_batches = pack_micro_batches([len(s.token_ids) for s, _ in items], self.config.micro_batch_tokens)
        stats: dict[str, float] = {}
        for indices in micro_batches:
            mb = collate([items[i] for i in indices], self.device, self.vocab_size)
            loss, mb_stats = micro_batch_loss(self.policy, self.ref, mb, self.config, num_samples=len(items))
            loss.backward()
            add_pass_stats(stats, mb_stats)
            if self.progress is not None:
                self.progress = (self.progress[0] + 1, self.progress[1])
        return stats

    # ------------------------------------------------------------------------------------------------------------
    # Weights for the inference engine
    # ------------------------------------------------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(state_dict name, tensor) of the policy; the tensors are the live weights (detached): copy, don't keep."""
        yield from self.policy.state_dict().items()

    def push_weights(self, target: TransferTarget) -> None:
        """The policy into vLLM's weight-transfer engine (servers.engines.weight_transfer), bucket by bucket, each
        tensor once, cast to the engine's dtype as it goes; raises when the transfer failed (the server then falls
        back to `export_weights`)."""
        if self._pusher is None:
            self._pusher = WeightPusher(self.device)
        self._pusher.push(target, unique_tensors(self.policy.state_dict().items()))

    def export_weights(self, directory: Path) -> Path:
        """The policy as a Hugging Face model directory (config + safetensors), for an engine in another process."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(directory)
        return directory

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints (servers.trainers.trainer_state)
    # ------------------------------------------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        """Write a checkpoint into `directory` (servers.checkpoint_dirs makes it atomic and prunes old ones)."""
        directory = self.export_weights(directory)
        copy_tokenizer(self.model_dir, directory)
        write_trainer_state(directory, step_count=self.step_count, optimizer=self.optimizer.state_dict(),
                            config=self.config, model_dir=self.model_dir, rng=rng_states())  # fmt: skip

    def load(self, directory: Path) -> None:
        """Restore weights, optimizer state, step_count and RNG states written by `save`."""
        directory = Path(directory)
        state = read_trainer_state(directory)
        if (directory / SHARDED_DIR).is_dir():  # the FSDP2 trainer's: fp32 weights and optimizer state by name
            load_sharded_state(self.policy, self.optimizer, directory, with_optimizer=state["sharded_optimizer"])
        else:
            loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=self.dtype)
            with torch.no_grad():
                self.policy.load_state_dict(loaded.state_dict())
            del loaded
            self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step_count"])
        restore_rng_states(state["rng"])
