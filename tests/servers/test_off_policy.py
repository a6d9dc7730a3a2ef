"""Off-policy tokens in a GRPO step (servers/trainers/grpo.py, step 2): per-token policy versions recorded and kept
by the ledger; a token of an older policy than the step's start is trained against pi_start, weighted by
min(pi_start / mu, importance_cap); on-policy tokens train exactly as before. Tiny model, seconds."""

from __future__ import annotations

import math

import pytest
import torch

from servers.backends import Group, TrainBatch
from servers.episodes.ledger import Ledger
from servers.episodes.samples import CallRecord, Sample, merge_calls, token_versions
from servers.trainers.grpo import GRPOTrainer, micro_batch_loss
from servers.trainers.micro_batches import collate
from tests.servers.test_grpo_trainer import COMPLETIONS, config, make_sample


def behind(sample: Sample, version: int, shift: float) -> Sample:
    """`sample` as if an older policy (`version`) had generated it, with behaviour logprobs `shift` below the
    current model's (so pi_start / mu = exp(shift) on every generated token)."""
    logprobs = [lp - shift if m else 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True)]
    return sample.model_copy(update={"policy_version": version, "logprobs": logprobs,
                                     "versions": [(version, len(sample.token_ids))]})


def batch_of(trainer, tokenizer, *, version: int, shift: float, step: int) -> TrainBatch:
    samples = [behind(make_sample(tokenizer, trainer.policy, "What is 2 + 3?", c, reward=r, episode=f"e{i}"),
                      version, shift) for i, (c, r) in enumerate(COMPLETIONS)]  # fmt: skip
    return TrainBatch(step=step, groups=[Group(job="default", task_id="t0", agent="a", samples=samples)])


def test_calls_on_two_versions_make_one_sample_with_each_tokens_version():
    first = CallRecord(agent="a", prompt_ids=[1, 2], completion_ids=[3, 4], logprobs=[-0.1, -0.2], policy_version=4)
    second = CallRecord(agent="a", prompt_ids=[1, 2, 3, 4, 5], completion_ids=[6], logprobs=[-0.3], policy_version=5)
    [sample] = merge_calls("e", [first, second], reward=1.0)
    assert sample.policy_version == 4 and sample.versions == [(4, 4), (5, 2)]
    assert token_versions(sample) == [4, 4, 4, 4, 5, 5] and sample.loss_mask == [0, 0, 1, 1, 0, 1]
    old = sample.model_copy(update={"versions": []})  # recorded before versions were kept
    assert token_versions(old) == [4] * 6


def test_the_ledger_keeps_each_tokens_version(tmp_path):
    calls = [CallRecord(agent="a", prompt_ids=[1], completion_ids=[2], logprobs=[-0.5], policy_version=1),
             CallRecord(agent="a", prompt_ids=[1, 2, 3], completion_ids=[4], logprobs=[-0.5], policy_version=2)]
    ledger = Ledger(tmp_path / "ledger.sqlite")
    try:
        ledger.record_episode(episode_id="e", job="j", task_id="t", client_id="c", reward=1.0, agent_rewards=None,
                              metadata={}, num_calls=2, samples=merge_calls("e", calls, reward=1.0))
        [sample] = ledger.samples_of("e")
    finally:
        ledger.close()
    assert sample.versions == [(1, 2), (2, 2)] and token_versions(sample) == [1, 1, 2, 2]


def test_an_on_policy_step_is_unchanged_by_the_correction(model_dir, tokenizer):
    """Versions equal to the step's start: prox = logp_old and w = 1 exactly, so the loss and every weight after the
    step are those of samples recorded with no versions at all."""
    with_versions = GRPOTrainer(model_dir, config(ppo_epochs=2))
    plain = GRPOTrainer(model_dir, config(ppo_epochs=2))
    batch = batch_of(with_versions, tokenizer, version=0, shift=0.0, step=1)
    bare = TrainBatch(step=1, groups=[Group(job="default", task_id="t0", agent="a", samples=[
        s.model_copy(update={"versions": []}) for s in batch.groups[0].samples])])
    metrics, bare_metrics = with_versions.step(batch), plain.step(bare)
    assert metrics == {**bare_metrics, "seconds": metrics["seconds"]}
    assert metrics["offpolicy_frac"] == 0.0 and metrics["importance_weight_mean"] == 0.0
    for (name, a), b in zip(with_versions.policy.state_dict().items(), plain.policy.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(("shift", "weight"), [(0.3, math.exp(0.3)), (2.0, 2.0), (-0.5, math.exp(-0.5))])
def test_stale_tokens_are_weighted_by_the_capped_importance_ratio(model_dir, tokenizer, shift, weight):
    trainer = GRPOTrainer(model_dir, config(importance_cap=2.0))
    trainer.step_count = 3  # the step starts from version 3; the samples are version 1's
    m = trainer.step(batch_of(trainer, tokenizer, version=1, shift=shift, step=4))
    assert m["offpolicy_frac"] == 1.0 and m["staleness_min"] == m["staleness_max"] == 2.0
    assert m["importance_weight_mean"] == pytest.approx(weight, rel=1e-4)
    assert m["importance_capfrac"] == (1.0 if weight == 2.0 else 0.0)
    assert m["logprob_diff_mean"] == 0.0  # the engine-vs-trainer gap is taken on on-policy tokens only
    assert m["pg_clipfrac"] == 0.0  # the ratio is against pi_start: 1 on the first pass, whatever mu was


def test_the_gradient_is_w_times_the_on_policy_gradient(model_dir, tokenizer):
    """On the first pass ratio = pi / pi_start = 1, so a stale token's gradient is w times the same token's
    on-policy gradient: with one constant w over the batch, the whole gradient scales by w."""
    def gradient(version: int, shift: float) -> list[torch.Tensor]:
        trainer = GRPOTrainer(model_dir, config())
        trainer.step_count = 2
        batch = batch_of(trainer, tokenizer, version=version, shift=shift, step=3)
        mb = collate([(s, a) for s, a in zip(batch.groups[0].samples, (1.0, -1.0, 0.5, -0.5), strict=True)],
                     trainer.device, trainer.vocab_size, start_version=trainer.step_count)
        loss, _, _ = micro_batch_loss(trainer.policy, None, mb, trainer.config, num_samples=4)
        loss.backward()
        return [p.grad.clone() for p in trainer.params if p.grad is not None]

    on_policy, stale = gradient(version=2, shift=0.0), gradient(version=0, shift=0.4)
    for a, b in zip(on_policy, stale, strict=True):
        torch.testing.assert_close(b, a * math.exp(0.4), rtol=1e-4, atol=1e-7)


def test_later_passes_keep_pi_start(model_dir, tokenizer):
    """With ppo_epochs = 2 the second pass weighs against the first pass's logprobs (pi_start), not the updated
    model's: the importance weights of both passes are the same, so their mean is one pass's."""
    one, two = GRPOTrainer(model_dir, config()), GRPOTrainer(model_dir, config(ppo_epochs=2, learning_rate=0.05))
    for trainer in (one, two):
        trainer.step_count = 1
    m1 = one.step(batch_of(one, tokenizer, version=0, shift=0.2, step=2))
    m2 = two.step(batch_of(two, tokenizer, version=0, shift=0.2, step=2))
    assert m2["optimizer_steps"] == 2.0 and m2["kl"] > 0  # the second pass ran on moved weights
    assert m2["importance_weight_mean"] == pytest.approx(m1["importance_weight_mean"], rel=1e-6)
