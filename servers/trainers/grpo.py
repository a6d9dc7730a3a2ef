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

       logp_t  = log_softmax(logits_{t-1})[x_t]                 fp32, temperature 1 (`token_logprobs`)
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

Checkpoints: `save(dir)` writes a Hugging Face model directory (weights, config, tokenizer files copied from
`model_dir`) plus `trainer_state.pt` (optimizer, step_count, RNG states); `servers.checkpoints.CheckpointDir` makes
the write atomic, names it `step_{n:06d}` and prunes old ones.
"""

from __future__ import annotations

import logging
import math
import random
import shutil
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from marl.protocol import GRPOConfig, Sample
from servers.interfaces import Group, TrainBatch, Trainer

__all__ = [
    "ADV_EPS",
    "Advantages",
    "GRPOTrainer",
    "TRAINER_STATE_FILE",
    "compute_advantages",
    "pack_micro_batches",
    "token_logprobs",
]

log = logging.getLogger(__name__)

#: eps in A = (r - mean) / (std + eps).
ADV_EPS = 1e-6
#: A group whose reward std is at most this has "zero variance" (no learning signal).
ZERO_VARIANCE_STD = 1e-8
#: log-ratios are clamped to +-this before exp, so a very stale token cannot overflow the loss to inf.
MAX_LOG_RATIO = 20.0
#: Optimizer, step count and RNG states, next to the model files of a checkpoint.
TRAINER_STATE_FILE = "trainer_state.pt"
#: Tokenizer files copied verbatim from `model_dir` into every checkpoint (copied, not re-saved: a re-save can
#: change the tokenizer class or its pre-tokenizer).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)
TOKENIZER_DIRS = ("additional_chat_templates",)


# ----------------------------------------------------------------------------------------------------------------
# Logprobs: the one function both the trainer and the tests use
# ----------------------------------------------------------------------------------------------------------------


def _forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    keep: torch.Tensor | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logp[b, t] = log softmax(logits[b, t-1])[input_ids[b, t]] (0 at t = 0 and on padding); optional entropy.

    `keep` ([B, T], nonzero where a logprob is needed, e.g. the loss mask) lets the model project only the positions
    that predict those tokens onto the vocabulary (`logits_to_keep`). Agents' prompts are long and their replies
    short, so this saves most of the [T, V] logits: time and, above all, memory. Elsewhere logp is 0.
    """
    if keep is None:
        positions = torch.arange(input_ids.shape[1] - 1, device=input_ids.device)
    else:
        positions = keep[:, 1:].bool().any(0).nonzero().squeeze(-1)  # t such that some row trains token t + 1
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                   logits_to_keep=positions).logits  # [B, P, V]: the logits at `positions` predict token t + 1
    # fp32 whatever the model dtype, temperature 1, no top-p.
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    targets = input_ids[:, positions + 1]
    dense = torch.zeros(input_ids.shape, dtype=logp_all.dtype, device=input_ids.device)
    logp = dense.index_copy(1, positions + 1, logp_all.gather(-1, targets[..., None]).squeeze(-1))
    logp = logp * attention_mask.to(logp.dtype)  # aligned with input_ids: logp[:, t] is the logprob of token t
    entropy = None
    if with_entropy:
        with torch.no_grad():  # H_t = -sum_v p_v log p_v, a metric only
            entropy = dense.index_copy(1, positions + 1, -(logp_all.exp() * logp_all).sum(-1))
            entropy = entropy * attention_mask.to(entropy.dtype)
    return logp, entropy


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-token logprobs of `input_ids` under `model`, shape [B, T], fp32, aligned with the tokens.

    `out[b, t] = log_softmax(logits[b, t - 1])[input_ids[b, t]]` with the raw logits (temperature 1): the number
    the inference engine records as a sampled token's logprob (`Sample.logprobs`). `out[:, 0]` and padded
    positions are 0. Right padding (attention_mask 0 after the tokens) is expected. Gradients flow unless the
    caller wraps the call in `torch.no_grad()`.
    """
    return _forward(model, input_ids, attention_mask)[0]


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
# Step 4 helpers: packing and padding
# ----------------------------------------------------------------------------------------------------------------


def pack_micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices into `lengths`, grouped so that len(mb) * max(length in mb) <= budget.

    Longest first (less padding; ties keep their order); a sequence longer than the budget goes alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        longest_if_added = max(longest, lengths[i])
        if current and longest_if_added * (len(current) + 1) > budget:
            batches.append(current)
            current, longest_if_added = [], lengths[i]
        current.append(i)
        longest = longest_if_added
    if current:
        batches.append(current)
    return batches


def _trained_tokens(sample: Sample) -> int:
    return sum(sample.loss_mask[1:])  # token 0 has no prefix: it cannot be trained on


@dataclass
class _MicroBatch:
    input_ids: torch.Tensor  # [B, T] long, right-padded
    attention_mask: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] float, 0 at t = 0 and on padding
    old_logp: torch.Tensor  # [B, T] float32, behaviour logprobs
    advantages: torch.Tensor  # [B] float32


def _collate(items: Sequence[tuple[Sample, float]], device: torch.device, vocab_size: int) -> _MicroBatch:
    width = max(len(s.token_ids) for s, _ in items)
    shape = (len(items), width)
    input_ids = torch.zeros(shape, dtype=torch.long)  # pad id is irrelevant: attention_mask hides it
    attention_mask = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.float32)
    old_logp = torch.zeros(shape, dtype=torch.float32)
    for row, (sample, _) in enumerate(items):
        n = len(sample.token_ids)
        if n and (max(sample.token_ids) >= vocab_size or min(sample.token_ids) < 0):
            raise ValueError(
                f"sample of episode {sample.episode_id!r} has token ids outside the model's vocabulary "
                f"[0, {vocab_size}): was it recorded by another model?"
            )
        input_ids[row, :n] = torch.tensor(sample.token_ids, dtype=torch.long)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(sample.loss_mask, dtype=torch.float32)
        old_logp[row, :n] = torch.tensor(sample.logprobs, dtype=torch.float32)
    loss_mask[:, 0] = 0.0
    advantages = torch.tensor([a for _, a in items], dtype=torch.float32)
    return _MicroBatch(
        input_ids.to(device),
        attention_mask.to(device),
        loss_mask.to(device),
        old_logp.to(device),
        advantages.to(device),
    )


# ----------------------------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------------------------


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32  # fp32 weights and optimizer state: exact on CPU, simple everywhere
    if isinstance(dtype, str):
        return getattr(torch, dtype.removeprefix("torch."))
    return dtype


def _load_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.to(device)
    model.eval()  # dropout off: the training forward must reproduce the engine's logprobs
    return model


def _set_gradient_checkpointing(model: torch.nn.Module, enabled: bool) -> None:
    """Turn activation recomputation of the decoder layers on or off (a Werewolves player's merged conversation of
    5k tokens needs about 12 GB of saved activations for SmolLM2-135M in fp32 without it).

    transformers only checkpoints a layer in training mode, and the policy stays in eval mode (dropout off, so the
    training forward reproduces the engine's logprobs). So only the layer modules themselves are flagged as
    training: their submodules, dropout included, stay in eval mode.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if enabled and not layers:
        raise ValueError(f"gradient_checkpointing: {type(model).__name__} has no checkpointable decoder layers")
    if enabled and not model.is_activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif not enabled and model.is_activation_checkpointing:
        model.activation_checkpointing_disable()
    for layer in layers:
        layer.training = enabled


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
        self.config = config
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = _resolve_dtype(dtype)
        self.policy = _load_model(self.model_dir, self.dtype, self.device)
        # Frozen reference = the initial model, for the KL penalty (also after `load`: it stays the initial model).
        self.ref: torch.nn.Module | None = None
        if config.kl_coef > 0:
            self.ref = _load_model(self.model_dir, self.dtype, self.device)
            self.ref.requires_grad_(False)
        self.params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.learning_rate, betas=tuple(config.adam_betas), weight_decay=config.weight_decay
        )
        self.vocab_size = self.policy.get_input_embeddings().num_embeddings
        self.step_count = 0  # == policy version: the number of `step` calls so far

    # ------------------------------------------------------------------------------------------------------------
    # One training step
    # ------------------------------------------------------------------------------------------------------------

    def step(self, batch: TrainBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        self.progress = None  # until the passes are known (a failed step may have left its count behind)
        cfg = self.config
        if batch.step != self.step_count + 1:
            log.warning("batch.step=%d but the trainer is at step %d", batch.step, self.step_count)

        # 1. Advantages per group.
        adv = compute_advantages(
            batch.groups,
            normalize_std=cfg.normalize_advantage_std,
            skip_zero_variance=cfg.skip_zero_variance_groups,
        )
        items = [(s, a) for s, a in adv.items if _trained_tokens(s) > 0]
        metrics = self._reward_metrics(adv)
        metrics.update(
            groups=float(adv.groups),
            groups_zero_variance=float(adv.groups_zero_variance),
            groups_trained=float(adv.groups_trained),
            samples=float(len(items)),
            tokens_trained=float(sum(_trained_tokens(s) for s, _ in items)),
            dropped_stale=float(batch.dropped_stale),
        )

        # Nothing trainable: no optimizer step, but the version still moves on (the server bumps it).
        if not items:
            self.step_count += 1
            metrics.update(
                trained=0.0, optimizer_steps=0.0, micro_batches=0.0, loss=0.0, pg_loss=0.0, pg_clipfrac=0.0, kl=0.0,
                entropy=0.0, logprob_diff_mean=0.0, logprob_diff_max=0.0, grad_norm=0.0, skipped_nonfinite=0.0,
                policy_version=float(self.step_count), seconds=time.perf_counter() - t0,
            )  # fmt: skip
            if self.ref is not None:
                metrics["kl_ref"] = 0.0
            return metrics

        # 2-4. ppo_epochs passes; each pass = forward/backward over all micro-batches, then one optimizer step.
        self._sync_optimizer_hparams()
        _set_gradient_checkpointing(self.policy, cfg.gradient_checkpointing)
        micro_batches = pack_micro_batches([len(s.token_ids) for s, _ in items], cfg.micro_batch_tokens)
        totals: dict[str, float] = defaultdict(float)
        grad_norms, optimizer_steps = [], 0
        self.progress = (0, cfg.ppo_epochs * len(micro_batches))
        for epoch in range(cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            stats = self.accumulate_gradients(items, micro_batches)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm))
            grad_norms.append(grad_norm)
            if math.isfinite(grad_norm):
                self.optimizer.step()
                optimizer_steps += 1
            else:
                log.warning("non-finite gradient norm at step %d epoch %d: update skipped", self.step_count, epoch)
            self.optimizer.zero_grad(set_to_none=True)
            for key, value in stats.items():
                if epoch == 0 or not key.startswith("logprob_diff"):
                    totals[key] = max(totals[key], value) if key.endswith("_max") else totals[key] + value
        self.step_count += 1
        self.progress = None

        tokens = totals["tokens"]  # trained tokens summed over epochs
        metrics.update(
            trained=1.0,
            optimizer_steps=float(optimizer_steps),
            micro_batches=float(len(micro_batches)),
            loss=totals["loss"] / cfg.ppo_epochs,  # L, averaged over epochs
            pg_loss=totals["pg_loss"] / cfg.ppo_epochs,
            pg_clipfrac=totals["clipped"] / tokens,  # tokens whose gradient the clip removed
            kl=totals["kl_old"] / tokens,  # approx KL(old || new), k3, token mean
            entropy=totals["entropy"] / tokens,
            # Engine-vs-trainer gap: |logp_new - logp_old| on the first pass, before any update.
            logprob_diff_mean=totals["logprob_diff_sum"] / metrics["tokens_trained"],
            logprob_diff_max=totals["logprob_diff_max"],
            grad_norm=sum(grad_norms) / len(grad_norms),  # before clipping, mean over epochs
            skipped_nonfinite=float(len(grad_norms) - optimizer_steps),
            policy_version=float(self.step_count),
            seconds=time.perf_counter() - t0,
        )
        if self.ref is not None:
            metrics["kl_ref"] = totals["kl_ref"] / tokens  # k3 KL(new || ref), token mean
        return metrics

    def accumulate_gradients(
        self, items: Sequence[tuple[Sample, float]], micro_batches: list[list[int]] | None = None
    ) -> dict[str, float]:
        """One pass: forward + backward of L over all micro-batches; gradients add up in `param.grad`.

        No optimizer step, no zero_grad. `items` are (sample, advantage) pairs, each sample with >= 1 trained token.
        Returns sums for the metrics (tokens, clipped tokens, entropy, KLs, ...) and the loss L.
        """
        cfg = self.config
        if micro_batches is None:
            micro_batches = pack_micro_batches([len(s.token_ids) for s, _ in items], cfg.micro_batch_tokens)
        num_samples = len(items)  # S in L = 1/S * sum_s token_mean_s
        stats: dict[str, float] = defaultdict(float)
        for indices in micro_batches:
            mb = _collate([items[i] for i in indices], self.device, self.vocab_size)
            logp, entropy = _forward(self.policy, mb.input_ids, mb.attention_mask, keep=mb.loss_mask, with_entropy=True)
            mask = mb.loss_mask
            tokens_per_sample = mask.sum(-1).clamp(min=1.0)  # |T_s|

            # ratio_t = exp(logp_t - logp_old_t), 1 off the trained tokens
            log_ratio = ((logp - mb.old_logp) * mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
            ratio = torch.exp(log_ratio)
            # pg_t = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
            a = mb.advantages[:, None]
            pg_unclipped = -a * ratio
            pg_clipped = -a * torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
            pg = torch.maximum(pg_unclipped, pg_clipped)
            loss_t = pg
            # kl_t = exp(logp_ref - logp) - (logp_ref - logp) - 1   (k3, >= 0)
            if self.ref is not None:
                with torch.no_grad():
                    ref_logp = token_logprobs(self.ref, mb.input_ids, mb.attention_mask)
                ref_log_ratio = ((ref_logp - logp) * mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
                kl_ref = torch.exp(ref_log_ratio) - ref_log_ratio - 1.0
                if cfg.kl_coef > 0:
                    loss_t = loss_t + cfg.kl_coef * kl_ref
                stats["kl_ref"] += float((kl_ref.detach() * mask).sum())

            # L_mb = sum_{s in mb} (sum_t l_t * mask_t / |T_s|) / S   -> sum over micro-batches = L
            per_sample = (loss_t * mask).sum(-1) / tokens_per_sample
            loss = per_sample.sum() / num_samples
            loss.backward()
            if self.progress is not None:
                self.progress = (self.progress[0] + 1, self.progress[1])

            with torch.no_grad():
                trained = mask.bool()
                stats["loss"] += float(loss)
                stats["pg_loss"] += float(((pg * mask).sum(-1) / tokens_per_sample).sum() / num_samples)
                stats["tokens"] += float(mask.sum())
                stats["clipped"] += float(((pg_clipped > pg_unclipped) & trained).sum())
                # approx KL(old || new) = E_old[(ratio - 1) - log ratio]   (k3)
                stats["kl_old"] += float(((ratio - 1.0 - log_ratio) * mask).sum())
                stats["entropy"] += float((entropy * mask).sum())
                diff = (logp - mb.old_logp).abs()[trained]
                stats["logprob_diff_sum"] += float(diff.sum())
                stats["logprob_diff_max"] = max(stats["logprob_diff_max"], float(diff.max()))
        return dict(stats)

    def _sync_optimizer_hparams(self) -> None:
        """Apply `self.config` to the optimizer (after `load`, whose saved param groups hold the old run's values)."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.learning_rate
            group["betas"] = tuple(self.config.adam_betas)
            group["weight_decay"] = self.config.weight_decay

    @staticmethod
    def _reward_metrics(adv: Advantages) -> dict[str, float]:
        out: dict[str, float] = {}
        every = [r for rs in adv.rewards_by_agent.values() for r in rs]
        out["reward_mean"] = float(np.mean(every)) if every else 0.0
        out["reward_std"] = float(np.std(every)) if every else 0.0
        for agent, rewards in sorted(adv.rewards_by_agent.items()):
            out[f"reward_mean/{agent}"] = float(np.mean(rewards)) if rewards else 0.0
            out[f"reward_std/{agent}"] = float(np.std(rewards)) if rewards else 0.0
        return out

    # ------------------------------------------------------------------------------------------------------------
    # Weights for the inference engine
    # ------------------------------------------------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(state_dict name, tensor) of the policy; the tensors are the live weights (detached): copy, don't keep."""
        yield from self.policy.state_dict().items()

    def export_weights(self, directory: Path) -> Path:
        """The policy as a Hugging Face model directory (config + safetensors), for an engine in another process."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(directory)
        return directory

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        """Write a checkpoint into `directory` (servers.checkpoints makes it atomic and prunes old ones)."""
        directory = self.export_weights(directory)
        self._copy_tokenizer(directory)
        torch.save(self._trainer_state(), directory / TRAINER_STATE_FILE)

    def load(self, directory: Path) -> None:
        """Restore weights, optimizer state, step_count and RNG states written by `save`."""
        directory = Path(directory)
        state_file = directory / TRAINER_STATE_FILE
        if not state_file.is_file():
            raise FileNotFoundError(f"{directory} is not a complete checkpoint: {TRAINER_STATE_FILE} is missing")
        # Our own file: RNG states are python/numpy objects, so weights_only=False.
        state = torch.load(state_file, map_location="cpu", weights_only=False)
        loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=self.dtype)
        with torch.no_grad():
            self.policy.load_state_dict(loaded.state_dict())
        del loaded
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step_count"])
        rng = state["rng"]
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "step_count": self.step_count,
            "optimizer": self.optimizer.state_dict(),
            "rng": {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            },
            "config": self.config.model_dump(mode="json"),
            "model_dir": str(self.model_dir),
        }

    def _copy_tokenizer(self, target: Path) -> None:
        copied = 0
        for name in TOKENIZER_FILES:
            source = self.model_dir / name
            if source.is_file():
                shutil.copy2(source, target / name)
                copied += 1
        for name in TOKENIZER_DIRS:
            source = self.model_dir / name
            if source.is_dir():
                shutil.copytree(source, target / name)
        if not copied:
            # No tokenizer files to copy (e.g. a GGUF source): fall back to re-saving the loaded tokenizer.
            from transformers import AutoTokenizer

            try:
                AutoTokenizer.from_pretrained(self.model_dir).save_pretrained(target)
            except Exception as exc:  # noqa: BLE001 - the weights are still worth saving
                log.warning("checkpoint %s has no tokenizer: %s", target, exc)
