"""`grpo.recompute_logprobs`: the PPO ratio against the trainer's own pi_start logprobs (servers/trainers/grpo.py,
step 2), in every trainer, and `auto` resolved by the server from the engine's and the trainer's numerics.
Tiny model on the CPU; one 2-rank gloo group."""

from __future__ import annotations

import json
import math

import pytest
import torch

from marl.protocol import FSDPConfig, GRPOConfig, TrainConfig
from servers.backends import TrainBatch
from servers.engines.torch_engine import TorchEngine
from servers.entrypoint import lora_trainer_factory
from servers.episodes.samples import Sample
from servers.policies.views import PolicyBackends
from servers.trainers.fsdp import FSDPTrainer
from servers.trainers.grpo import GRPOTrainer
from servers.trainers.lora_grpo import LoraGRPOTrainer
from servers.training.lifecycle import recompute_wanted, resolve_recompute_logprobs
from tests.servers.test_grpo_trainer import config, make_batch
from tests.servers.test_lora_trainer import SPEC
from tests.servers.test_lora_trainer import make_batch as lora_batch

#: How far the "engine's" logprobs are moved from the model's: a ratio of e^0.5 = 1.65 or e^-0.5 = 0.61, which the
#: clip (0.8, 1.28) cuts wherever the advantage's sign makes it bind.
NOISE = 0.5


def perturbed(sample: Sample, noise: float = NOISE) -> Sample:
    """`sample` as an engine with other kernels might record it: every generated token's logprob off by +-`noise`."""
    logprobs = [lp + (noise if t % 2 else -noise) if m else 0.0
                for t, (lp, m) in enumerate(zip(sample.logprobs, sample.loss_mask, strict=True))]  # fmt: skip
    return sample.model_copy(update={"logprobs": logprobs})


def perturb(batch: TrainBatch) -> TrainBatch:
    for group in batch.groups:
        group.samples = [perturbed(s) for s in group.samples]
    return batch


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_on_the_first_pass_the_ratio_is_one_against_the_recomputed_logprobs(model_dir, tokenizer):
    on = GRPOTrainer(model_dir, config(recompute_logprobs=True))
    off = GRPOTrainer(model_dir, config(recompute_logprobs=False))
    batch = perturb(make_batch(on, tokenizer))
    m_on, m_off = on.step(batch), off.step(batch)
    # on: nothing clipped, KL(pi_start || pi) 0 on the one pass, whatever the engine recorded
    assert m_on["recomputed_logprobs"] == 1.0 and m_on["recompute_seconds"] > 0
    assert m_on["pg_clipfrac"] == 0.0 and abs(m_on["kl"]) < 1e-7
    # off (today's math): the ratio is against the recorded logprobs, so their noise is clipped as a policy change
    assert m_off["recomputed_logprobs"] == 0.0 and m_off["recompute_seconds"] == 0.0
    assert m_off["pg_clipfrac"] > 0.1 and m_off["kl"] > 0.05
    # the engine-vs-trainer gap keeps its meaning either way: |pi_start's logprob - the recorded one|
    for m in (m_on, m_off):
        assert m["logprob_diff_mean"] == pytest.approx(NOISE, rel=1e-4)
        assert m["logprob_diff_max"] == pytest.approx(NOISE, rel=1e-4)


def test_with_the_engines_own_logprobs_recomputing_changes_nothing(model_dir, tokenizer):
    """Recorded logprobs that are the model's (fp32 torch on both sides): the two anchors agree to float noise, so
    two passes make the same update either way."""
    on = GRPOTrainer(model_dir, config(recompute_logprobs=True, ppo_epochs=2, micro_batch_tokens=16))
    off = GRPOTrainer(model_dir, config(recompute_logprobs=False, ppo_epochs=2, micro_batch_tokens=16))
    batch = make_batch(on, tokenizer)
    m_on, m_off = on.step(batch), off.step(batch)
    assert m_on["micro_batches"] == 4.0 and m_on["optimizer_steps"] == 2.0 and m_on["recomputed_logprobs"] == 1.0
    for key in ("loss", "pg_clipfrac", "kl", "entropy", "grad_norm"):
        assert m_on[key] == pytest.approx(m_off[key], rel=1e-4, abs=1e-7), key
    got, want = weights(on.policy), weights(off.policy)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("shift", "weight"), [(0.3, math.exp(0.3)), (2.0, 2.0)])
def test_stale_tokens_keep_their_capped_importance_weight(model_dir, tokenizer, shift, weight):
    from tests.servers.test_off_policy import batch_of

    trainer = GRPOTrainer(model_dir, config(recompute_logprobs=True, importance_cap=2.0))
    trainer.step_count = 3
    m = trainer.step(batch_of(trainer, tokenizer, version=1, shift=shift, step=4))
    assert m["offpolicy_frac"] == 1.0 and m["recomputed_logprobs"] == 1.0
    assert m["importance_weight_mean"] == pytest.approx(weight, rel=1e-4)  # min(pi_start / mu, cap), as before
    assert m["pg_clipfrac"] == 0.0 and m["logprob_diff_mean"] == 0.0  # the gap is taken on on-policy tokens only


def test_a_lora_policy_recomputes_too(model_dir, tokenizer, base):
    policies = {"red": (SPEC, config(recompute_logprobs=True)), "blue": (SPEC, config(recompute_logprobs=False))}
    trainer = LoraGRPOTrainer(model_dir, policies, device="cpu")
    try:
        m_red = trainer.step("red", perturb(lora_batch(base, tokenizer, agent="red")))
        m_blue = trainer.step("blue", perturb(lora_batch(base, tokenizer, agent="blue")))
    finally:
        trainer.close()
    assert m_red["recomputed_logprobs"] == 1.0 and m_red["pg_clipfrac"] == 0.0 and abs(m_red["kl"]) < 1e-7
    assert m_blue["recomputed_logprobs"] == 0.0 and m_blue["pg_clipfrac"] > 0.1
    assert m_red["logprob_diff_mean"] == pytest.approx(NOISE, rel=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# auto, resolved where the server has the engine and the trainer
# ----------------------------------------------------------------------------------------------------------------


def test_auto_is_on_unless_both_sides_compute_in_fp32_torch():
    assert not recompute_wanted("torch.float32", "torch.float32")
    assert recompute_wanted("torch.bfloat16", "torch.float32")
    assert recompute_wanted("torch.bfloat16", "torch.bfloat16")  # one dtype, but KV-cached decode vs one forward
    assert recompute_wanted(None, "torch.float32")  # vLLM (or any engine that does not say): kernels of its own


def test_a_policy_trainer_view_gets_the_resolved_setting(model_dir):
    """A LoRA policy's view: the engine's numerics through its adapter view, the bool into the shared trainer's
    config of that policy alone."""
    backends = PolicyBackends({"red": SPEC, "blue": SPEC},
                              lambda d: TorchEngine(d, device="cpu", dtype=torch.bfloat16, max_batch_size=2),
                              lora_trainer_factory("cpu"), lambda: {"red": TrainConfig(), "blue": TrainConfig()})
    engine = backends.engine_factory("red")(model_dir)
    trainers = [backends.trainer_factory(name)(model_dir, TrainConfig()) for name in ("red", "blue")]
    try:
        assert engine.numerics == "torch.bfloat16" and trainers[0].numerics == "torch.float32"
        resolve_recompute_logprobs(engine, trainers[0])
        shared = backends.trainer.current
        assert shared.config("red").recompute_logprobs is True
        assert shared.config("blue").recompute_logprobs == "auto"  # resolved at its own boot
    finally:
        for backend in (*trainers, engine):
            backend.close()


def test_a_server_resolves_auto_from_its_engine_and_trainer(local_server):
    """fp32 torch engine + fp32 trainer: off. The same server rebooted on a bf16 torch engine: on, and its step
    says so, with the engine-vs-trainer gap bf16 makes. The synced config still says auto."""
    from tests.conftest import admin_http, play_episode, start_rolling, wait_state, wait_version

    with local_server() as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=1, num_repeat=2, save_freq=0)
        lifecycle = srv.server.lifecycle
        assert lifecycle.trainer.config.recompute_logprobs is False
        assert http.post("/control/stop").status_code == 200
        wait_state(http, "OFFLINE")
        lifecycle.engine_factory = lambda d: TorchEngine(d, device="cpu", dtype=torch.bfloat16, max_batch_size=4)
        assert http.post("/control/start").status_code == 200
        wait_state(http, "ROLLING")
        assert lifecycle.engine.numerics == "torch.bfloat16" and lifecycle.trainer.numerics == "torch.float32"
        assert lifecycle.trainer.config.recompute_logprobs is True
        assert lifecycle.config.grpo.recompute_logprobs == "auto"
        play_episode(http, "t0", 1.0), play_episode(http, "t0", 0.0)
        wait_version(http, 1, timeout=120)
        [step] = [json.loads(line) for line in (srv.data_dir / "metrics.jsonl").read_text().splitlines()]
    assert step["trained"] == 1.0 and step["recomputed_logprobs"] == 1.0 and step["recompute_seconds"] > 0
    assert step["pg_clipfrac"] == 0.0  # bf16's noise in the recorded logprobs is not clipped as a policy change
    assert step["logprob_diff_max"] > 1e-4  # ... and it is seen: the engine's bf16 against the trainer's fp32


# ----------------------------------------------------------------------------------------------------------------
# FSDP: the ranks recompute as the one process does
# ----------------------------------------------------------------------------------------------------------------


def test_two_ranks_recompute_as_the_one_process_trainer(model_dir, tokenizer, tmp_path):
    """Padding passes, gradient checkpointing, a KL reference, two passes, stale and perturbed samples: the ranks'
    update and metrics are the one-process trainer's."""
    from tests.servers.test_fsdp_trainer import KNOBS, assert_weights_close, exported, two_group_batch
    from tests.servers.test_off_policy import behind

    knobs = {**KNOBS, "recompute_logprobs": True}
    one = GRPOTrainer(model_dir, GRPOConfig(**knobs))
    batch = perturb(two_group_batch(one, tokenizer, step=3))
    batch.groups[0].samples = [s.model_copy(update={"policy_version": 2}) for s in batch.groups[0].samples]
    batch.groups[1].samples = [behind(s, version=0, shift=0.2) for s in batch.groups[1].samples]  # stale
    sharded = FSDPTrainer(model_dir, FSDPConfig(ranks=2, **knobs), threads_per_rank=1)
    try:
        sharded.step_count = one.step_count = 2
        m_sharded, m_one = sharded.step(batch), one.step(batch)
        assert_weights_close(exported(sharded, tmp_path / "w"), one.policy.state_dict(), rel=1e-4)
    finally:
        sharded.close()
    assert m_one["recomputed_logprobs"] == m_sharded["recomputed_logprobs"] == 1.0
    assert 0 < m_one["offpolicy_frac"] < 1 and m_sharded["recompute_seconds"] > 0
    for key in ("loss", "pg_clipfrac", "kl", "kl_ref", "logprob_diff_mean", "logprob_diff_max",
                "importance_weight_mean", "offpolicy_frac", "grad_norm"):  # fmt: skip
        assert m_sharded[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-7), key
