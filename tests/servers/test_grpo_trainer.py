"""GRPO trainer: advantages, the direction of the update, micro-batching, checkpoints. Tiny models, seconds."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from marl.protocol import GRPOConfig
from servers.backends import Group, TrainBatch
from servers.episodes.samples import Sample
from servers.trainers import grpo
from servers.trainers.grpo import (
    ADV_EPS,
    GRPOTrainer,
    compute_advantages,
    pack_micro_batches,
    token_logprobs,
)
from servers.training.checkpoint_dirs import CheckpointDir

# --------------------------------------------------------------------------------------------------------------
# Fixtures and hand-made samples
# --------------------------------------------------------------------------------------------------------------




def config(**overrides) -> GRPOConfig:
    base = dict(learning_rate=1e-3, micro_batch_tokens=4096)
    base.update(overrides)
    return GRPOConfig(**base)


def encode(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """(prompt ids from the chat template, completion ids ending with <|im_end|>)."""
    enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    prompt_ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    completion_ids = tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt_ids, completion_ids


@torch.no_grad()
def seq_logprobs(model, token_ids: list[int]) -> list[float]:
    ids = torch.tensor([token_ids])
    return token_logprobs(model, ids, torch.ones_like(ids))[0].tolist()


def make_sample(
    tokenizer, model, prompt, completion, *, reward, episode="e0", agent="a", logprobs_from_model=True
) -> Sample:
    p, c = encode(tokenizer, prompt, completion)
    ids = p + c
    mask = [0] * len(p) + [1] * len(c)
    if logprobs_from_model:
        lp = [x if m else 0.0 for x, m in zip(seq_logprobs(model, ids), mask, strict=True)]
    else:
        lp = [-1.0 if m else 0.0 for m in mask]
    return Sample(
        episode_id=episode, agent=agent, token_ids=ids, loss_mask=mask, logprobs=lp, reward=reward,
        policy_version=0, num_calls=1,
    )  # fmt: skip


def fake_sample(episode: str, reward: float, agent: str = "a") -> Sample:
    return Sample(
        episode_id=episode, agent=agent, token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0],
        reward=reward, policy_version=0, num_calls=1,
    )  # fmt: skip


COMPLETIONS = [("Yes.", 1.0), ("No.", 0.0), ("Maybe yes.", 1.0), ("The quick brown fox.", 0.0)]


def make_batch(trainer, tokenizer, *, step=1, prompt="What is 2 + 3?", agent="a", job="default") -> TrainBatch:
    samples = [
        make_sample(tokenizer, trainer.policy, prompt, c, reward=r, episode=f"{agent}{i}", agent=agent)
        for i, (c, r) in enumerate(COMPLETIONS)
    ]
    return TrainBatch(step=step, groups=[Group(job=job, task_id="t0", agent=agent, samples=samples)])


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}


# --------------------------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------------------------


def test_advantages_by_hand():
    # Group 1: rewards 1, 0, 0, 3 -> mean 1, population std sqrt((0 + 1 + 1 + 4) / 4) = sqrt(1.5).
    g1 = Group("j", "t1", "a", [fake_sample("e1", 1.0), fake_sample("e2", 0.0), fake_sample("e3", 0.0),
                                fake_sample("e4", 3.0)])  # fmt: skip
    # Group 2: episode x has two unmerged samples; rewards per episode are 2 (x) and 0 (y): counted once each.
    g2 = Group("j", "t2", "b", [fake_sample("x", 2.0, "b"), fake_sample("x", 2.0, "b"), fake_sample("y", 0.0, "b")])
    out = compute_advantages([g1, g2], normalize_std=True)
    std1 = 1.5**0.5
    expected = [0.0 / (std1 + ADV_EPS), -1.0 / (std1 + ADV_EPS), -1.0 / (std1 + ADV_EPS), 2.0 / (std1 + ADV_EPS),
                1.0 / (1.0 + ADV_EPS), 1.0 / (1.0 + ADV_EPS), -1.0 / (1.0 + ADV_EPS)]  # fmt: skip
    assert [a for _, a in out.items] == pytest.approx(expected, abs=1e-12)
    assert out.groups == 2 and out.groups_trained == 2 and out.groups_zero_variance == 0
    assert out.rewards_by_agent["b"] == [2.0, 0.0]

    raw = compute_advantages([g1, g2], normalize_std=False)
    assert [a for _, a in raw.items] == pytest.approx([0.0, -1.0, -1.0, 2.0, 1.0, 1.0, -1.0], abs=1e-12)


def test_zero_variance_groups_counted_and_skipped():
    flat = Group("j", "t1", "a", [fake_sample("e1", 0.5), fake_sample("e2", 0.5)])
    lone = Group("j", "t2", "a", [fake_sample("e3", 1.0)])  # one episode: no variance either
    live = Group("j", "t3", "a", [fake_sample("e4", 1.0), fake_sample("e5", 0.0)])
    skipped = compute_advantages([flat, lone, live], skip_zero_variance=True)
    assert skipped.groups_zero_variance == 2 and skipped.groups_trained == 1
    assert [s.episode_id for s, _ in skipped.items] == ["e4", "e5"]
    kept = compute_advantages([flat, lone, live], skip_zero_variance=False)
    assert kept.groups_zero_variance == 2 and kept.groups_trained == 3
    assert [a for _, a in kept.items][:3] == [0.0, 0.0, 0.0]


def test_with_a_kl_term_zero_variance_groups_train_for_it_and_the_policy_gradient_is_unchanged():
    """kl_coef > 0: a zero-variance group is trained with A = 0 (the KL term acts on it), and the other samples'
    advantages are scaled by S / S_pg, so the policy-gradient term of L (a mean over all S samples) is what it was."""
    flat = Group("j", "t1", "a", [fake_sample("e1", 0.5), fake_sample("e2", 0.5)])
    live = Group("j", "t3", "a", [fake_sample("e4", 1.0), fake_sample("e5", 0.0)])
    batch = TrainBatch(step=1, groups=[flat, live])
    plain, _ = grpo.trainable_items(batch, config())
    with_kl, metrics = grpo.trainable_items(batch, config(kl_coef=0.1))
    assert [s.episode_id for s, _ in plain] == ["e4", "e5"]
    assert [s.episode_id for s, _ in with_kl] == ["e1", "e2", "e4", "e5"]
    assert [a for _, a in with_kl[:2]] == [0.0, 0.0]
    # pg term: (1/S) sum A' = (1/S_pg) sum A, sample by sample
    assert [a / len(with_kl) for _, a in with_kl[2:]] == pytest.approx([a / len(plain) for _, a in plain])
    assert metrics["groups_zero_variance"] == 1.0 and metrics["groups_trained"] == 2.0
    unskipped, _ = grpo.trainable_items(batch, config(kl_coef=0.1, skip_zero_variance_groups=False))
    assert [a for _, a in unskipped] == pytest.approx([0.0, 0.0, *(a for _, a in plain)])  # as before: no scaling


def test_a_collapsed_policy_is_pulled_back_towards_the_initial_model_by_the_kl_term(model_dir, tokenizer):
    """Every group of one reply (a policy that stopped exploring): without a KL term nothing trains; with one, the
    step moves the policy back towards the reference, whose distribution the collapse left."""
    trainer = GRPOTrainer(model_dir, config(learning_rate=3e-3, kl_coef=0.5))
    for _ in range(4):  # collapse it onto "Yes." first: reward the one reply against the others
        trainer.step(make_batch(trainer, tokenizer))
    collapsed = completion_logprob(trainer, tokenizer, "What is 2 + 3?", "Yes.")
    same = [make_sample(tokenizer, trainer.policy, "What is 2 + 3?", "Yes.", reward=1.0, episode=f"e{i}")
            for i in range(4)]
    steps = [trainer.step(TrainBatch(step=5 + i, groups=[Group("j", "t0", "a", same)])) for i in range(3)]
    assert all(m["trained"] == 1.0 and m["groups_zero_variance"] == 1.0 for m in steps)
    assert steps[-1]["kl_ref"] < steps[0]["kl_ref"]  # back towards the initial model
    assert completion_logprob(trainer, tokenizer, "What is 2 + 3?", "Yes.") < collapsed
    unregularized = GRPOTrainer(model_dir, config(learning_rate=3e-3))
    assert unregularized.step(TrainBatch(step=1, groups=[Group("j", "t0", "a", same)]))["trained"] == 0.0


def test_the_entropy_bonus_spreads_a_policy_that_answers_one_way(model_dir, tokenizer):
    """Every group of one reply: with `entropy_coef` > 0 the groups train (A = 0) and the bonus alone raises the
    entropy of the policy where it replies; without it nothing trains."""
    trainer = GRPOTrainer(model_dir, config(learning_rate=3e-3, entropy_coef=0.5))
    same = [make_sample(tokenizer, trainer.policy, "What is 2 + 3?", "Yes.", reward=1.0, episode=f"e{i}")
            for i in range(4)]
    steps = [trainer.step(TrainBatch(step=1 + i, groups=[Group("j", "t0", "a", same)])) for i in range(3)]
    assert all(m["trained"] == 1.0 and m["groups_zero_variance"] == 1.0 for m in steps)
    assert steps[0]["entropy"] < steps[1]["entropy"] < steps[2]["entropy"]  # each step's forward, before its update
    unregularized = GRPOTrainer(model_dir, config(learning_rate=3e-3))
    assert unregularized.step(TrainBatch(step=1, groups=[Group("j", "t0", "a", same)]))["trained"] == 0.0
    assert grpo.regularized(config(entropy_coef=0.1)) and not grpo.regularized(config())


def test_bad_sample_is_rejected():
    bad = fake_sample("e1", 1.0).model_copy(update={"logprobs": [0.0]})
    with pytest.raises(ValueError, match="must be equal"):
        compute_advantages([Group("j", "t", "a", [bad, fake_sample("e2", 0.0)])])


def test_step_with_nothing_trainable_still_counts(model_dir, tokenizer):
    trainer = GRPOTrainer(model_dir, config())
    before = weights(trainer)
    flat = [make_sample(tokenizer, trainer.policy, "Hi", c, reward=0.5, episode=f"e{i}") for i, c in enumerate("ab")]
    m = trainer.step(TrainBatch(step=1, groups=[Group("j", "t", "a", flat)], dropped_stale=3))
    assert trainer.step_count == 1
    assert m["trained"] == 0.0 and m["optimizer_steps"] == 0.0
    assert m["groups"] == 1.0 and m["groups_zero_variance"] == 1.0 and m["samples"] == 0.0
    assert m["dropped_stale"] == 3.0 and m["reward_mean"] == 0.5 and m["reward_std"] == 0.0
    after = weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not trainer.optimizer.state  # AdamW never stepped


# --------------------------------------------------------------------------------------------------------------
# The update
# --------------------------------------------------------------------------------------------------------------


def completion_logprob(trainer, tokenizer, prompt, completion) -> float:
    p, c = encode(tokenizer, prompt, completion)
    return sum(seq_logprobs(trainer.policy, p + c)[len(p) :])


def test_update_moves_probability_toward_reward(model_dir, tokenizer):
    trainer = GRPOTrainer(model_dir, config(learning_rate=3e-3))
    prompt = "What is 2 + 3?"
    good0 = completion_logprob(trainer, tokenizer, prompt, "Yes.")
    bad0 = completion_logprob(trainer, tokenizer, prompt, "No.")
    for step in range(1, 6):  # on-policy each time: fresh behaviour logprobs from the current policy
        metrics = trainer.step(make_batch(trainer, tokenizer, step=step, prompt=prompt))
        assert metrics["trained"] == 1.0 and metrics["samples"] == 4.0
    good1 = completion_logprob(trainer, tokenizer, prompt, "Yes.")
    bad1 = completion_logprob(trainer, tokenizer, prompt, "No.")
    assert good1 > good0 + 0.5, (good0, good1)
    assert bad1 < bad0 - 0.5, (bad0, bad1)


def test_ratio_is_one_on_first_pass(model_dir, tokenizer):
    # Budget 16 < every sequence: each goes alone in its micro-batch, as token_logprobs saw it -> ratio 1 up to float
    # noise (kernels may differ between the two calls on another CPU: 5e-7 was seen); a wrong pairing is off by > 0.1.
    trainer = GRPOTrainer(model_dir, config(micro_batch_tokens=16, ppo_epochs=2))
    batch = make_batch(trainer, tokenizer)
    m = trainer.step(batch)
    assert m["micro_batches"] == 4.0
    assert m["logprob_diff_max"] < 1e-5 and m["logprob_diff_mean"] < 1e-5
    assert m["optimizer_steps"] == 2.0
    # A pass directly on the untouched model: ratio 1, nothing clipped, KL(old||new) 0 (up to float noise).
    fresh = GRPOTrainer(model_dir, config(micro_batch_tokens=16))
    items = [(s, a) for s, a in compute_advantages(batch.groups).items]
    stats = fresh.accumulate_gradients(items)
    assert stats["clipped"] == 0.0 and abs(stats["kl_old"]) < 1e-6 and stats["logprob_diff_max"] < 1e-5
    # Padded together in one micro-batch: equal up to kernel noise, still nothing clipped.
    big = GRPOTrainer(model_dir, config(micro_batch_tokens=4096))
    m = big.step(batch)
    assert m["micro_batches"] == 1.0
    assert m["logprob_diff_max"] < 1e-5 and m["pg_clipfrac"] == 0.0


def test_metrics(model_dir, tokenizer):
    trainer = GRPOTrainer(model_dir, config(kl_coef=0.05, ppo_epochs=2))
    batch = make_batch(trainer, tokenizer, agent="wolf")
    batch.groups += make_batch(trainer, tokenizer, agent="seer").groups
    batch.dropped_stale = 2
    m = trainer.step(batch)
    for key in ("loss", "pg_clipfrac", "kl", "kl_ref", "entropy", "grad_norm", "reward_mean", "reward_std",
                "reward_mean/wolf", "reward_std/seer", "groups", "groups_zero_variance", "samples",
                "tokens_trained", "dropped_stale", "seconds"):  # fmt: skip
        assert key in m, key
        assert isinstance(m[key], float), key
    assert m["groups"] == 2.0 and m["samples"] == 8.0 and m["dropped_stale"] == 2.0
    assert m["reward_mean/wolf"] == 0.5 and m["reward_std/wolf"] == 0.5
    assert m["tokens_trained"] == sum(sum(s.loss_mask) for g in batch.groups for s in g.samples)
    assert m["entropy"] > 0 and m["grad_norm"] > 0 and m["kl"] >= 0 and m["kl_ref"] >= 0
    assert m["policy_version"] == 1.0 and trainer.step_count == 1


# --------------------------------------------------------------------------------------------------------------
# Micro-batching
# --------------------------------------------------------------------------------------------------------------


def test_pack_micro_batches():
    assert pack_micro_batches([10, 30, 20], 60) == [[1, 2], [0]]
    assert pack_micro_batches([100, 5, 5], 16) == [[0], [1, 2]]  # too long: alone
    assert pack_micro_batches([], 16) == []
    for budget in (16, 40, 100):
        lengths = [3, 17, 9, 9, 40, 1]
        batches = pack_micro_batches(lengths, budget)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:
            assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget


def test_micro_batching_gives_the_same_gradient(model_dir, tokenizer):
    ref = GRPOTrainer(model_dir, config(kl_coef=0.1))
    batch = make_batch(ref, tokenizer)
    # Off-policy behaviour logprobs (-1 per token): ratios far from 1, so clipping is exercised too.
    batch.groups[0].samples[1] = make_sample(tokenizer, ref.policy, "What is 2 + 3?", "No.", reward=0.0,
                                             episode="a1", logprobs_from_model=False)  # fmt: skip
    items = compute_advantages(batch.groups).items
    grads = {}
    for budget in (4096, 16, 40, 60):
        trainer = GRPOTrainer(model_dir, config(kl_coef=0.1, micro_batch_tokens=budget))
        stats = trainer.accumulate_gradients(items)
        grads[budget] = ({n: p.grad.clone() for n, p in trainer.policy.named_parameters()}, stats)
    one, many = grads[4096], grads[16]
    assert one[1]["loss"] == pytest.approx(many[1]["loss"], rel=1e-5)
    assert one[1]["clipped"] == many[1]["clipped"] > 0
    for budget in (16, 40, 60):
        for name, g in one[0].items():
            torch.testing.assert_close(grads[budget][0][name], g, rtol=1e-4, atol=1e-6)


def test_progress_counts_micro_batch_passes_during_a_step(model_dir, tokenizer, monkeypatch):
    trainer = GRPOTrainer(model_dir, config(micro_batch_tokens=16, ppo_epochs=2))
    batch = make_batch(trainer, tokenizer)
    seen = []
    backward = torch.Tensor.backward

    def watch(tensor, *args, **kwargs):  # progress as a monitor on another thread would read it, pass by pass
        seen.append(trainer.progress)
        return backward(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", watch)
    assert trainer.progress is None
    m = trainer.step(batch)
    passes = 2 * int(m["micro_batches"])
    assert m["micro_batches"] > 1 and seen == [(i, passes) for i in range(passes)]
    assert trainer.progress is None  # between steps


# --------------------------------------------------------------------------------------------------------------
# Weights and checkpoints
# --------------------------------------------------------------------------------------------------------------


def test_named_weights_load_into_a_fresh_model(model_dir, tokenizer):
    trainer = GRPOTrainer(model_dir, config())
    trainer.step(make_batch(trainer, tokenizer))
    engine_model = AutoModelForCausalLM.from_pretrained(model_dir)
    engine_model.load_state_dict(dict(trainer.named_weights()))
    ids = torch.tensor([encode(tokenizer, "Hi", "Yes.")[0]])
    with torch.no_grad():
        torch.testing.assert_close(engine_model(ids).logits, trainer.policy(ids).logits, rtol=0, atol=0)


def test_exported_weights_load_into_a_fresh_model(model_dir, tokenizer, tmp_path):
    """`export_weights` is the route to an engine in another process: a plain HF directory of the current policy."""
    trainer = GRPOTrainer(model_dir, config())
    trainer.step(make_batch(trainer, tokenizer))
    exported = trainer.export_weights(tmp_path / "weights")
    assert list(exported.glob("*.safetensors"))
    engine_model = AutoModelForCausalLM.from_pretrained(exported)
    ids = torch.tensor([encode(tokenizer, "Hi", "Yes.")[0]])
    with torch.no_grad():
        torch.testing.assert_close(engine_model(ids).logits, trainer.policy(ids).logits, rtol=0, atol=0)


def rng_draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_save_load_resumes_exactly(model_dir, tokenizer, tmp_path):
    cfg = config(kl_coef=0.05, ppo_epochs=2, micro_batch_tokens=64)
    a = GRPOTrainer(model_dir, cfg)
    a.step(make_batch(a, tokenizer, step=1))
    batch2 = make_batch(a, tokenizer, step=2, prompt="Red green blue?")  # built before save: same samples for both
    a.save(tmp_path / "ckpt")
    saved_weights = weights(a)
    saved_opt = copy.deepcopy(a.optimizer.state_dict())
    draws_after_save = rng_draws()
    m_a = a.step(batch2)

    random.seed(1), np.random.seed(1), torch.manual_seed(1)  # scramble: load must restore the saved RNG states
    b = GRPOTrainer(model_dir, cfg)
    b.load(tmp_path / "ckpt")
    assert rng_draws() == draws_after_save
    assert b.step_count == 1
    loaded = weights(b)
    assert all(torch.equal(saved_weights[k], loaded[k]) for k in saved_weights)
    opt = b.optimizer.state_dict()
    assert opt["param_groups"] == saved_opt["param_groups"]
    assert saved_opt["state"].keys() == opt["state"].keys() and opt["state"]
    for idx, st in saved_opt["state"].items():
        for key, value in st.items():
            assert torch.equal(value, opt["state"][idx][key]), (idx, key)

    m_b = b.step(batch2)
    after_a, after_b = weights(a), weights(b)
    for k in after_a:
        torch.testing.assert_close(after_b[k], after_a[k], rtol=0, atol=1e-6)
    assert m_b["loss"] == pytest.approx(m_a["loss"], abs=1e-6)
    assert b.step_count == a.step_count == 2


def test_checkpoint_is_a_plain_hf_model(model_dir, tokenizer, tmp_path):
    trainer = GRPOTrainer(model_dir, config())
    trainer.step(make_batch(trainer, tokenizer))
    path = CheckpointDir(tmp_path / "ckpts").save(trainer, trainer.step_count, keep=2)
    assert path.name == "step_000001"
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.encode("What is 2 + 3?") == tokenizer.encode("What is 2 + 3?")
    prompt = encode(tok, "What is 2 + 3?", "")[0]
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert isinstance(tok.decode(out[0, ids.shape[1] :]), str)


def test_keep_checkpoints_prunes_and_latest(model_dir, tmp_path):
    checkpoints = CheckpointDir(tmp_path / "ckpts")
    assert checkpoints.latest() is None
    trainer = GRPOTrainer(model_dir, config())
    (checkpoints.root / ".step_000009.tmp-abc123").mkdir(parents=True)  # leftover of a crashed save
    for n in (1, 2, 3):
        trainer.step_count = n
        checkpoints.save(trainer, n, keep=2)
    assert sorted(p.name for p in checkpoints.root.iterdir()) == ["step_000002", "step_000003"]
    assert checkpoints.latest() == checkpoints.root / "step_000003"
    checkpoints.prune(1)
    assert [p.name for _, p in checkpoints.all()] == ["step_000003"]
    fresh = GRPOTrainer(model_dir, config())
    fresh.load(checkpoints.latest())
    assert fresh.step_count == 3


def test_crash_mid_save_leaves_no_checkpoint(model_dir, tmp_path, monkeypatch):
    checkpoints = CheckpointDir(tmp_path / "ckpts")
    trainer = GRPOTrainer(model_dir, config())
    trainer.step_count = 1
    checkpoints.save(trainer, 1, keep=5)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(grpo.torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoints.save(trainer, 2, keep=5)
    assert sorted(p.name for p in checkpoints.root.iterdir()) == ["step_000001"]  # no half step_000002
    # Overwriting an existing checkpoint that fails keeps the old one.
    with pytest.raises(OSError):
        checkpoints.save(trainer, 1, keep=5)
    assert sorted(p.name for p in checkpoints.root.iterdir()) == ["step_000001"]
    fresh = GRPOTrainer(model_dir, config())
    fresh.load(checkpoints.latest())
    assert fresh.step_count == 1


def test_gradient_checkpointing_gives_the_same_step_with_dropout_still_off(model_dir, tokenizer):
    from transformers.modeling_layers import GradientCheckpointingLayer

    batch_of = {}
    weights = {}
    for checkpointing in (False, True):
        trainer = GRPOTrainer(model_dir, config(gradient_checkpointing=checkpointing, kl_coef=0.05))
        batch_of[checkpointing] = trainer.step(make_batch(trainer, tokenizer))
        weights[checkpointing] = dict(trainer.named_weights())
        layers = [m for m in trainer.policy.modules() if isinstance(m, GradientCheckpointingLayer)]
        assert layers and all(layer.gradient_checkpointing == checkpointing for layer in layers)
        # Only the layer modules are flagged as training (transformers checkpoints only then); nothing else is.
        assert {m.training for m in trainer.policy.modules() if m not in layers} == {False}
    plain, recomputed = batch_of[False], batch_of[True]
    assert recomputed["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-7)
    assert recomputed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)
    assert recomputed["logprob_diff_max"] < 1e-5  # the training forward still reproduces the engine's logprobs
    for name, tensor in weights[False].items():
        torch.testing.assert_close(weights[True][name], tensor, rtol=1e-5, atol=1e-7)
    trainer.config = config(gradient_checkpointing=False)  # a config synced between steps turns it off again
    trainer.step(make_batch(trainer, tokenizer, step=2))
    assert not trainer.policy.is_activation_checkpointing
    assert {m.training for m in trainer.policy.modules()} == {False}
