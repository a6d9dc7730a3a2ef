"""LoRA GRPO trainer: several policies on one frozen base; each trains alone, exports PEFT adapters, resumes
exactly (also after its process is killed). Tiny models, seconds."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from marl.protocol import LoraSpec
from servers.backends import Group, TrainBatch
from servers.trainers.grpo import GRPOTrainer
from servers.trainers.lora_grpo import LoraGRPOTrainer
from tests.servers.test_grpo_trainer import COMPLETIONS, config, make_sample, seq_logprobs

REPO = Path(__file__).resolve().parents[2]
SPEC = LoraSpec(rank=4, alpha=8.0)


def make_trainer(model_dir, **overrides) -> LoraGRPOTrainer:
    """Policies "red" and "blue"; `overrides` replace a policy's (spec, config)."""
    policies = {"red": (SPEC, config()), "blue": (SPEC, config())}
    policies.update(overrides)
    return LoraGRPOTrainer(model_dir, policies, device="cpu")


def make_batch(base, tokenizer, *, step=1, prompt="What is 2 + 3?", agent="red") -> TrainBatch:
    """One group of COMPLETIONS, their behaviour logprobs from the base model."""
    samples = [make_sample(tokenizer, base, prompt, c, reward=r, episode=f"{agent}{i}", agent=agent)
               for i, (c, r) in enumerate(COMPLETIONS)]  # fmt: skip
    return TrainBatch(step=step, groups=[Group(job="default", task_id="t0", agent=agent, samples=samples)])


def adapter(trainer: LoraGRPOTrainer, policy: str) -> dict[str, torch.Tensor]:
    return trainer.adapter_weights(policy)


def base_weights(trainer: LoraGRPOTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}


def assert_same(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert x.keys() == y.keys() and x
    for k in x:
        torch.testing.assert_close(x[k], y[k], rtol=0, atol=atol, msg=k)


def policy_logprobs(trainer: LoraGRPOTrainer, policy: str, ids: list[int]) -> list[float]:
    trainer.peft_model.set_adapter(policy)
    return seq_logprobs(trainer.model, ids)


# --------------------------------------------------------------------------------------------------------------
# One policy trains, nothing else moves
# --------------------------------------------------------------------------------------------------------------


def test_a_step_trains_only_its_adapter(model_dir, tokenizer, base):
    trainer = make_trainer(model_dir)
    a0, b0, base0 = adapter(trainer, "red"), adapter(trainer, "blue"), base_weights(trainer)
    metrics = trainer.step("red", make_batch(base, tokenizer))
    assert metrics["trained"] == 1.0 and metrics["optimizer_steps"] == 1.0
    a1 = adapter(trainer, "red")
    assert any(not torch.equal(a0[k], a1[k]) for k in a0)
    assert_same(adapter(trainer, "blue"), b0)  # bit for bit
    assert_same(base_weights(trainer), base0)
    assert trainer.step_count("red") == 1 and trainer.step_count("blue") == 0
    # The base is frozen: no gradient, no optimizer state; each optimizer holds its own adapter's parameters only.
    assert all(p.grad is None and not p.requires_grad for n, p in trainer.model.named_parameters() if "lora_" not in n)
    for policy in ("red", "blue"):
        held = {id(p) for g in trainer._state(policy).optimizer.param_groups for p in g["params"]}
        mine = {id(p) for n, p in trainer.model.named_parameters() if f".{policy}." in n and "lora_" in n}
        assert held == mine and mine


def test_per_policy_learning_rates(model_dir, tokenizer, base):
    # Adam's first step moves every parameter with a gradient by about lr (m / sqrt(v) = +-1); only lora_B has
    # one at the start (B = 0 makes A's gradient 0).
    trainer = make_trainer(model_dir, red=(SPEC, config(learning_rate=1e-3)), blue=(SPEC, config(learning_rate=1e-2)))
    for policy, lr in (("red", 1e-3), ("blue", 1e-2)):
        before = adapter(trainer, policy)
        trainer.step(policy, make_batch(base, tokenizer, agent=policy))
        after = adapter(trainer, policy)
        moved = max(float((after[k] - before[k]).abs().max()) for k in before)
        assert moved == pytest.approx(lr, rel=1e-2), policy
        assert trainer._state(policy).optimizer.param_groups[0]["lr"] == lr


def test_unknown_policy_is_named(model_dir, tokenizer, base):
    trainer = make_trainer(model_dir)
    calls = (lambda: trainer.step("green", make_batch(base, tokenizer)), lambda: trainer.step_count("green"),
             lambda: trainer.adapter_weights("green"), lambda: trainer.save("green", Path("/nonexistent")),
             lambda: trainer.export_adapter("green", Path("/nonexistent")))  # fmt: skip
    for call in calls:
        with pytest.raises(KeyError, match="'green'"):
            call()


# --------------------------------------------------------------------------------------------------------------
# The base as the start and as the KL reference
# --------------------------------------------------------------------------------------------------------------


def test_a_new_policy_is_the_base_and_its_kl_to_the_base_is_zero(model_dir, tokenizer, base):
    trainer = make_trainer(model_dir, red=(SPEC, config(kl_coef=0.1)))
    batch = make_batch(base, tokenizer)
    ids = batch.groups[0].samples[0].token_ids
    assert policy_logprobs(trainer, "red", ids) == seq_logprobs(base, ids)
    first = trainer.step("red", batch)
    assert first["kl_ref"] == 0.0  # measured before the update: adapter on == adapter off
    second = trainer.step("red", make_batch(base, tokenizer, step=2))
    assert second["kl_ref"] > 0.0
    assert policy_logprobs(trainer, "red", ids) != seq_logprobs(base, ids)
    # The reference is still exactly the base.
    with torch.no_grad():
        ref = trainer.reference(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)))
    torch.testing.assert_close(ref.logits, base(torch.tensor([ids])).logits, rtol=0, atol=0)


def test_same_step_as_the_full_weight_trainer_on_the_same_loss(model_dir, tokenizer, base):
    """The step's metrics before the update (loss, advantages, clipping) are GRPOTrainer's: at B = 0 the policy is
    the base, so the two trainers see the same logprobs."""
    batch = make_batch(base, tokenizer)
    lora = make_trainer(model_dir).step("red", batch)
    full = GRPOTrainer(model_dir, config()).step(batch)
    for key in ("loss", "pg_loss", "entropy", "samples", "tokens_trained", "reward_mean", "logprob_diff_max"):
        assert lora[key] == pytest.approx(full[key], abs=1e-6), key


# --------------------------------------------------------------------------------------------------------------
# Adapters out: PEFT's format
# --------------------------------------------------------------------------------------------------------------


def test_exported_adapter_loads_with_peft(model_dir, tokenizer, base, tmp_path):
    trainer = make_trainer(model_dir)
    batch = make_batch(base, tokenizer)
    trainer.step("blue", batch)
    out = trainer.export_adapter("blue", tmp_path / "blue")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert_same(load_file(out / "adapter_model.safetensors"), adapter(trainer, "blue"))
    fresh = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    loaded = PeftModel.from_pretrained(fresh, out).eval()
    ids = batch.groups[0].samples[1].token_ids
    assert seq_logprobs(loaded, ids) == pytest.approx(policy_logprobs(trainer, "blue", ids), abs=1e-6)
    assert seq_logprobs(loaded, ids) != pytest.approx(seq_logprobs(base, ids), abs=1e-6)  # it did learn


def test_adapter_weights_are_copies_in_peft_names(model_dir, tokenizer, base):
    trainer = LoraGRPOTrainer(model_dir, {"red": (SPEC, config())}, device="cpu", serve_dtype="bfloat16")
    weights = trainer.adapter_weights("red")
    assert all(k.startswith("base_model.model.") and ".lora_" in k and ".red." not in k for k in weights)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    snapshot = {k: v.clone() for k, v in weights.items()}
    trainer.step("red", make_batch(base, tokenizer))
    assert_same(weights, snapshot)  # not views of the live adapter


# --------------------------------------------------------------------------------------------------------------
# Randomness and threads: a policy's step never depends on another's
# --------------------------------------------------------------------------------------------------------------


def test_each_policy_has_its_own_rng_stream(model_dir, tokenizer, base):
    # LoRA dropout draws from the RNG: b's step must be the same whether or not a stepped before it.
    dropout = LoraSpec(rank=4, alpha=8.0, dropout=0.3)
    make = lambda: make_trainer(model_dir, red=(dropout, config()), blue=(dropout, config()))  # noqa: E731
    batch = make_batch(base, tokenizer)
    one, two = make(), make()
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    one.step("red", batch)
    one.step("blue", batch)
    assert torch.equal(torch.rand(1), expected)  # the process's own stream is left where it was
    two.step("blue", batch)
    assert_same(adapter(one, "blue"), adapter(two, "blue"))
    no_dropout = make_trainer(model_dir)
    no_dropout.step("blue", batch)
    assert any(not torch.equal(adapter(one, "blue")[k], adapter(no_dropout, "blue")[k]) for k in adapter(one, "blue"))


def test_threads_step_their_policies_at_once(model_dir, tokenizer, base):
    batches = {p: [make_batch(base, tokenizer, step=s, agent=p) for s in (1, 2)] for p in ("red", "blue")}
    alone = make_trainer(model_dir)
    for policy in ("red", "blue"):
        for batch in batches[policy]:
            alone.step(policy, batch)
    shared = make_trainer(model_dir)
    threads = [threading.Thread(target=lambda p=p: [shared.step(p, b) for b in batches[p]]) for p in ("red", "blue")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for policy in ("red", "blue"):
        assert shared.step_count(policy) == 2
        assert_same(adapter(shared, policy), adapter(alone, policy))


# --------------------------------------------------------------------------------------------------------------
# Checkpoints: exact resume, also after the process is killed
# --------------------------------------------------------------------------------------------------------------

RESUME = dict(red=(LoraSpec(rank=4, alpha=8.0, dropout=0.2), config(kl_coef=0.05, ppo_epochs=2, micro_batch_tokens=64)))


def uninterrupted(model_dir, batches) -> tuple[LoraGRPOTrainer, dict[str, float]]:
    """Step "red" on batch 1 then 2 (with "blue" stepping in between), no checkpoint."""
    trainer = make_trainer(model_dir, **RESUME)
    trainer.step("red", batches[0])
    trainer.step("blue", batches[0])
    return trainer, trainer.step("red", batches[1])


def assert_resumes(model_dir, ckpt: Path, batches, expected: LoraGRPOTrainer, expected_metrics) -> None:
    torch.manual_seed(7)  # scramble the process's RNG: the policy's stream comes from the checkpoint
    resumed = make_trainer(model_dir, **RESUME)
    blue0 = adapter(resumed, "blue")
    resumed.load("red", ckpt)
    assert resumed.step_count("red") == 1 and resumed.step_count("blue") == 0
    assert_same(adapter(resumed, "blue"), blue0)  # loading one policy leaves the other alone
    metrics = resumed.step("red", batches[1])
    assert_same(adapter(resumed, "red"), adapter(expected, "red"), atol=1e-6)
    assert metrics["loss"] == pytest.approx(expected_metrics["loss"], abs=1e-6)


def resume_batches(base, tokenizer) -> list[TrainBatch]:
    return [make_batch(base, tokenizer), make_batch(base, tokenizer, step=2, prompt="Red green blue?")]


def test_save_load_resumes_exactly(model_dir, tokenizer, base, tmp_path):
    batches = resume_batches(base, tokenizer)
    expected, expected_metrics = uninterrupted(model_dir, batches)
    first = make_trainer(model_dir, **RESUME)
    first.step("red", batches[0])
    first.save("red", tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt" / "adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]  # fmt: skip
    assert_resumes(model_dir, tmp_path / "ckpt", batches, expected, expected_metrics)


TRAIN_SAVE_AND_HANG = """
import pickle, sys, time, torch
torch.set_num_threads(1)
from tests.servers.test_lora_trainer import RESUME, make_trainer
model_dir, batch_file, ckpt = sys.argv[1:4]
trainer = make_trainer(model_dir, **RESUME)
trainer.step("red", pickle.loads(open(batch_file, "rb").read()))
trainer.save("red", ckpt)
print("SAVED", flush=True)
time.sleep(600)
"""


def test_resume_after_the_process_is_killed(model_dir, tokenizer, base, tmp_path):
    batches = resume_batches(base, tokenizer)
    (tmp_path / "batch.pkl").write_bytes(pickle.dumps(batches[0]))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-c", TRAIN_SAVE_AND_HANG, *map(str, (model_dir, tmp_path / "batch.pkl", tmp_path / "ck"))]
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = iter(proc.stdout.readline, "")
        assert any(line.strip() == "SAVED" for line in lines), "the trainer process ended before saving"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
    expected, expected_metrics = uninterrupted(model_dir, batches)
    assert_resumes(model_dir, tmp_path / "ck", batches, expected, expected_metrics)


def test_load_refuses_an_adapter_of_another_shape(model_dir, tokenizer, base, tmp_path):
    trainer = make_trainer(model_dir, blue=(LoraSpec(rank=2, alpha=8.0), config()))
    trainer.save("red", tmp_path / "red")
    with pytest.raises(ValueError, match="blue"):
        trainer.load("blue", tmp_path / "red")


def test_gradient_checkpointing_and_micro_batches_give_the_same_step(model_dir, tokenizer, base):
    # Recomputed layers on a frozen base (no input needs a gradient) and split micro-batches change no update.
    batch = make_batch(base, tokenizer)
    plain = make_trainer(model_dir)
    plain.step("red", batch)
    recomputed = make_trainer(model_dir, red=(SPEC, config(gradient_checkpointing=True, micro_batch_tokens=32)))
    metrics = recomputed.step("red", batch)
    assert metrics["micro_batches"] > 1
    assert_same(adapter(recomputed, "red"), adapter(plain, "red"), atol=1e-6)
