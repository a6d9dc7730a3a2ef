"""The FSDP LoRA trainer: 2 ranks make the one-process LoRA step, train one policy alone, resume exactly in a fresh
group, export adapters PEFT loads, and train a real server's policies. Tiny model, real gloo ranks on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from marl.protocol import FSDPConfig, GRPOConfig, LoraSpec, TrainConfig
from servers.backends import TrainBatch
from servers.entrypoint import lora_trainer_factory
from servers.trainers.fsdp import plan_micro_batches
from servers.trainers.fsdp_lora import FSDPLoraTrainer
from servers.trainers.lora_grpo import LoraGRPOTrainer
from tests.conftest import admin_http
from tests.servers.test_fsdp_trainer import KNOBS
from tests.servers.test_grpo_trainer import make_sample, seq_logprobs
from tests.servers.test_lora_trainer import COMPLETIONS, assert_same, make_batch
from tests.servers.test_policy_server import POLICIES as SERVED
from tests.servers.test_policy_server import greedy, start_policies, wait_policy

#: Dropout off: the ranks' LoRA dropout draws differ from one process's, so only a dropout-free step can match it.
SPEC = LoraSpec(rank=4, alpha=8.0)
POLICIES = ("red", "blue")


def fsdp_trainer(model_dir: Path) -> FSDPLoraTrainer:
    return FSDPLoraTrainer(model_dir, {p: (SPEC, FSDPConfig(ranks=2, **KNOBS)) for p in POLICIES}, device="cpu",
                           threads_per_rank=1)  # fmt: skip


def one_process(model_dir: Path) -> LoraGRPOTrainer:
    return LoraGRPOTrainer(model_dir, {p: (SPEC, GRPOConfig(**KNOBS)) for p in POLICIES}, device="cpu")


@pytest.fixture(scope="module")
def step0(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("step0")


@pytest.fixture(scope="module")
def ranks(model_dir, step0):
    """Two ranks for the module; every policy's untrained state is checkpointed in `step0/<policy>` first."""
    trainer = fsdp_trainer(model_dir)
    for policy in POLICIES:
        trainer.save(policy, step0 / policy)
    yield trainer
    trainer.close()


@pytest.fixture
def sharded(ranks, step0) -> FSDPLoraTrainer:
    """The module's ranks with every policy back at step 0."""
    for policy in POLICIES:
        ranks.load(policy, step0 / policy)
        assert ranks.step_count(policy) == 0
    return ranks


def two_group_batch(base, tokenizer, *, step: int = 1) -> TrainBatch:
    """Groups of four and three samples (7 over 2 ranks: one rank runs a padding pass); one sample's behaviour
    logprobs are off-policy, so the PPO clip acts too."""
    batch = make_batch(base, tokenizer, step=step)
    batch.groups += make_batch(base, tokenizer, step=step, prompt="Red green blue?", agent="seer").groups
    del batch.groups[1].samples[2]
    batch.groups[0].samples[1] = make_sample(tokenizer, base, "What is 2 + 3?", COMPLETIONS[1][0], reward=0.0,
                                             episode="red1", agent="red", logprobs_from_model=False)  # fmt: skip
    return batch


def test_one_step_matches_the_one_process_trainer(sharded, model_dir, base, tokenizer):
    one = one_process(model_dir)
    assert_same(sharded.adapter_weights("red"), one.adapter_weights("red"))  # the same start, bit for bit
    batch = two_group_batch(base, tokenizer)
    lengths = [len(s.token_ids) for g in batch.groups for s in g.samples]
    plans = plan_micro_batches(lengths, 2, KNOBS["micro_batch_tokens"])
    assert any(mb is None for plan in plans for mb in plan)  # padding passes are exercised
    m_sharded, m_one = sharded.step("red", batch), one.step("red", batch)
    assert sharded.step_count("red") == 1 and sharded.progress("red") is None
    assert_same(sharded.adapter_weights("red"), one.adapter_weights("red"), atol=1e-5)
    assert m_sharded.keys() == m_one.keys()
    assert m_sharded["micro_batches"] > 2 and m_sharded["pg_clipfrac"] > 0 and m_sharded["kl_ref"] > 0
    for key in ("loss", "pg_loss", "pg_clipfrac", "kl", "kl_ref", "entropy", "grad_norm", "logprob_diff_mean",
                "tokens_trained", "samples", "optimizer_steps", "reward_mean/red", "policy_version"):  # fmt: skip
        assert m_sharded[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-7), key


def test_a_step_trains_only_its_policy(sharded, base, tokenizer):
    before = {policy: sharded.adapter_weights(policy) for policy in POLICIES}
    for step in (1, 2):
        sharded.step("red", two_group_batch(base, tokenizer, step=step))
    red = sharded.adapter_weights("red")
    assert all(not torch.equal(red[k], before["red"][k]) for k in red)  # A moves too from the second pass on
    assert_same(sharded.adapter_weights("blue"), before["blue"])  # bit for bit
    assert sharded.step_count("red") == 2 and sharded.step_count("blue") == 0


def test_save_then_a_fresh_group_resumes_exactly(sharded, model_dir, base, tokenizer, tmp_path):
    sharded.step("red", two_group_batch(base, tokenizer, step=1))
    sharded.save("red", tmp_path / "ckpt")
    batch2 = two_group_batch(base, tokenizer, step=2)
    m_a = sharded.step("red", batch2)
    fresh = fsdp_trainer(model_dir)
    try:
        fresh.load("red", tmp_path / "ckpt")
        assert fresh.step_count("red") == 1
        m_b = fresh.step("red", batch2)
        assert_same(fresh.adapter_weights("red"), sharded.adapter_weights("red"))  # bit for bit
        assert fresh.step_count("red") == sharded.step_count("red") == 2
    finally:
        fresh.close()
    assert {k: v for k, v in m_b.items() if k != "seconds"} == {k: v for k, v in m_a.items() if k != "seconds"}
    one = one_process(model_dir)  # the checkpoint is the one-process trainer's format: it resumes from it too
    one.load("red", tmp_path / "ckpt")
    one.step("red", batch2)
    assert_same(one.adapter_weights("red"), sharded.adapter_weights("red"), atol=1e-5)


def test_exported_adapter_loads_with_peft(sharded, model_dir, base, tokenizer, tmp_path):
    batch = two_group_batch(base, tokenizer)
    sharded.step("blue", batch)
    out = sharded.export_adapter("blue", tmp_path / "blue")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    weights = sharded.adapter_weights("blue")
    assert_same(load_file(out / "adapter_model.safetensors"), weights)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), out)
    # the trainer's adapter: its gathered tensors put into a PEFT model of the base by hand
    by_hand = one_process(model_dir).peft_model
    set_peft_model_state_dict(by_hand, weights, adapter_name="blue")
    by_hand.set_adapter("blue")
    ids = batch.groups[0].samples[1].token_ids
    want = seq_logprobs(by_hand.get_base_model(), ids)
    assert seq_logprobs(loaded.eval(), ids) == pytest.approx(want, abs=1e-6)
    assert want != pytest.approx(seq_logprobs(base, ids), abs=1e-6)  # it did learn


def test_the_server_builds_the_trainer_its_policies_name(model_dir, monkeypatch):
    built = {}
    monkeypatch.setattr("servers.trainers.fsdp_lora.FSDPLoraTrainer", lambda *a, **kw: built.update(args=a, kw=kw))
    factory = lora_trainer_factory("cpu")
    fsdp = TrainConfig(trainer="fsdp", fsdp={"ranks": 2, "learning_rate": 1e-4})
    factory(model_dir, {"red": (SPEC, fsdp), "blue": (SPEC, fsdp)})
    assert built["args"][1] == {"red": (SPEC, fsdp.fsdp), "blue": (SPEC, fsdp.fsdp)}  # each its fsdp section
    with pytest.raises(ValueError, match="share one trainer"):
        factory(model_dir, {"red": (SPEC, fsdp), "blue": (SPEC, TrainConfig())})


def test_a_server_of_policies_trains_them_on_fsdp_ranks(local_server):
    """`trainer: fsdp` synced for every policy: the server's shared trainer is this one, a step moves the served
    adapter of its policy only, and writes its checkpoint."""
    config = {"trainer": "fsdp", "fsdp": FSDPConfig(ranks=2, learning_rate=0.04)}  # grpo: says 0.05
    with local_server(policies=SERVED) as srv, admin_http(srv.url) as http:
        start_policies(http, **config)
        shared = srv.server.policies["speaker"].lifecycle.trainer._trainer  # the FSDPLoraTrainer behind the view
        assert shared.config("speaker").learning_rate == 0.04  # the fsdp: section, not grpo:'s defaults
        lease = http.post("/episodes/begin", json={"client_id": "c", "policy": "speaker"}).json()
        untrained = greedy(lease)
        http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "c"})
        for prompt, reward in (("hello", 0.0), ("goodbye", 1.0)):  # two different replies: a gradient on each rank
            lease = http.post("/episodes/begin", json={"client_id": "c", "policy": "speaker"}).json()
            greedy(lease, prompt)
            r = http.post(f"/episodes/{lease['episode_id']}/end", json={"client_id": "c", "task_id": "t",
                                                                         "reward": reward})  # fmt: skip
            assert r.status_code == 200, r.text
        wait_policy(http, "speaker", "ROLLING", version=1)
        lease = http.post("/episodes/begin", json={"client_id": "c", "policy": "speaker"}).json()
        assert greedy(lease) != pytest.approx(untrained, abs=1e-4)  # the adapter moved
        http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "c"})
        assert http.get("/control/status", params={"policy": "listener"}).json()["policy_version"] == 0
        checkpoints = srv.data_dir / "policies" / "speaker" / "checkpoints"
        assert list(checkpoints.glob("*/adapter/adapter_model.safetensors"))
