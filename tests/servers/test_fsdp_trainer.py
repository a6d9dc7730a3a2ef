"""The FSDP2 trainer: 2 ranks make the one-process GRPO step, resume exactly, export what the engine serves, and fail
loudly when a rank dies. Tiny model, real gloo ranks on the CPU; two rank groups for the whole module."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM

from marl.protocol import GRPOConfig
from servers.backends import Group, SamplingParams, TrainBatch
from servers.engines.torch_engine import TorchEngine
from servers.trainers.fsdp import FSDPConfig, FSDPTrainer, RankFailure, cpu_threads_per_rank, plan_micro_batches
from servers.trainers.grpo import GRPOTrainer, token_logprobs
from servers.trainers.trainer_state import SHARDED_DIR, TRAINER_STATE_FILE
from tests.servers.test_grpo_trainer import encode, make_batch, make_sample

#: Micro-batches of at most 40 tokens (each rank runs several, some ranks padding passes), recomputed activations,
#: a KL reference (sharded too), two passes per step: every sharded code path at once.
KNOBS = dict(learning_rate=1e-3, micro_batch_tokens=40, gradient_checkpointing=True, kl_coef=0.05, ppo_epochs=2)




@pytest.fixture(scope="module")
def step0(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("step0")


@pytest.fixture(scope="module")
def ranks(model_dir, step0):
    """Two ranks for the module; their untrained state is checkpointed in `step0` first."""
    trainer = FSDPTrainer(model_dir, FSDPConfig(ranks=2, **KNOBS), threads_per_rank=1)
    trainer.save(step0)
    yield trainer
    trainer.close()


@pytest.fixture
def sharded(ranks, step0) -> FSDPTrainer:
    """The module's ranks back at step 0 (`load` of the untrained checkpoint: weights, optimizer, step)."""
    ranks.load(step0)
    assert ranks.step_count == 0
    return ranks


@pytest.fixture(scope="module")
def spare_ranks(model_dir):
    """A second group: resumes the first one's checkpoint, then has a rank killed (the last test using it)."""
    trainer = FSDPTrainer(model_dir, FSDPConfig(ranks=2, **KNOBS), threads_per_rank=1)
    yield trainer
    trainer.close()


def two_group_batch(reference: GRPOTrainer, tokenizer, *, step: int = 1) -> TrainBatch:
    """Groups of four and three samples (7 over 2 ranks: one rank runs a padding pass); one sample's behaviour
    logprobs are off-policy, so the PPO clip acts too."""
    batch = make_batch(reference, tokenizer, step=step, agent="wolf")
    batch.groups += make_batch(reference, tokenizer, step=step, agent="seer", prompt="Red green blue?").groups
    del batch.groups[1].samples[2]
    batch.groups[0].samples[1] = make_sample(tokenizer, reference.policy, "What is 2 + 3?", "No.", reward=0.0,
                                             episode="wolf1", agent="wolf", logprobs_from_model=False)  # fmt: skip
    return batch


def exported(trainer, directory: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(trainer.export_weights(directory)).state_dict()


def assert_weights_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rel: float) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        err = float((got[name] - tensor).norm() / tensor.norm())
        assert err <= rel, (name, err)


def rng_draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_plan_gives_every_rank_as_many_micro_batches():
    lengths = [30, 5, 12, 12, 40, 3, 9]
    for ranks in (1, 2, 3, 8):
        plans = plan_micro_batches(lengths, ranks, budget=24)
        assert len(plans) == ranks and len({len(plan) for plan in plans}) == 1
        placed = [i for plan in plans for mb in plan if mb is not None for i in mb]
        assert sorted(placed) == list(range(len(lengths)))
        for mb in (mb for plan in plans for mb in plan if mb is not None):
            assert len(mb) == 1 or len(mb) * max(lengths[i] for i in mb) <= 24
    assert plan_micro_batches([10, 10], 3, budget=100)[2] == [None]  # more ranks than samples: padding only
    two = plan_micro_batches([8, 7, 6, 5], 2, budget=100)
    assert [sorted(mb) for plan in two for mb in plan] == [[0, 3], [1, 2]]  # 13 tokens each


def test_cpu_ranks_split_the_servers_threads_not_the_machines():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)  # as OMP_NUM_THREADS=4 from `marl run` leaves a server
        assert [cpu_threads_per_rank(ranks) for ranks in (1, 2, 3, 8)] == [4, 2, 1, 1]
    finally:
        torch.set_num_threads(before)


def test_two_ranks_make_the_one_process_step(sharded, model_dir, tokenizer, tmp_path):
    one = GRPOTrainer(model_dir, GRPOConfig(**KNOBS))
    batch = two_group_batch(one, tokenizer)
    lengths = [len(s.token_ids) for g in batch.groups for s in g.samples]
    plans = plan_micro_batches(lengths, 2, KNOBS["micro_batch_tokens"])
    assert any(mb is None for plan in plans for mb in plan)  # padding passes are exercised
    m_sharded, m_one = sharded.step(batch), one.step(batch)
    assert sharded.step_count == 1 and sharded.progress is None
    assert_weights_close(exported(sharded, tmp_path / "w"), one.policy.state_dict(), rel=1e-4)
    assert m_sharded.keys() == m_one.keys()
    assert m_sharded["micro_batches"] > 2 and m_sharded["pg_clipfrac"] > 0
    for key in ("loss", "pg_loss", "pg_clipfrac", "kl", "kl_ref", "entropy", "grad_norm", "logprob_diff_mean",
                "tokens_trained", "samples", "optimizer_steps", "reward_mean/wolf", "policy_version"):  # fmt: skip
        assert m_sharded[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-7), key


def test_two_ranks_make_the_one_process_off_policy_step(sharded, model_dir, tokenizer, tmp_path, monkeypatch):
    """Samples two versions behind the step's start (overlap): the ranks weigh them as the one-process trainer does
    (pi_start kept across the two passes, importance weights capped)."""
    from tests.servers.test_off_policy import behind

    one = GRPOTrainer(model_dir, GRPOConfig(**KNOBS, importance_cap=1.3))
    batch = two_group_batch(one, tokenizer, step=3)
    for group in batch.groups:
        group.samples = [behind(s, version=0, shift=0.1 * (i + 1)) for i, s in enumerate(group.samples)]
    sharded.step_count = one.step_count = 2
    monkeypatch.setattr(sharded, "config", sharded.config.model_copy(update={"importance_cap": 1.3}))
    m_sharded, m_one = sharded.step(batch), one.step(batch)
    assert m_one["offpolicy_frac"] == 1.0 and 0 < m_one["importance_capfrac"] < 1
    for key in ("loss", "importance_weight_mean", "importance_weight_max", "importance_capfrac", "offpolicy_frac",
                "staleness_mean", "pg_clipfrac", "kl"):
        assert m_sharded[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-6), key
    assert_weights_close(exported(sharded, tmp_path / "w"), one.policy.state_dict(), rel=1e-4)


def test_a_step_of_zero_variance_groups_trains_only_the_kl_term(sharded, tokenizer, model_dir):
    """kl_coef > 0: a group of equal rewards has no policy gradient but is trained for the KL term (grpo.py,
    step 1), on the ranks as in one process; the weights start at the reference, so the KL and its gradient are 0."""
    one = GRPOTrainer(model_dir, GRPOConfig(**KNOBS))
    flat = [make_sample(tokenizer, one.policy, "Hi", c, reward=0.5, episode=f"e{i}") for i, c in enumerate("ab")]
    m = sharded.step(TrainBatch(step=1, groups=[Group("j", "t", "a", flat)]))
    alone = one.step(TrainBatch(step=1, groups=[Group("j", "t", "a", flat)]))
    assert sharded.step_count == 1 and m["trained"] == 1.0 and m["groups_zero_variance"] == 1
    assert m["pg_loss"] == 0.0 and m["kl_ref"] == pytest.approx(alone["kl_ref"], abs=1e-6)


def test_foreign_token_ids_are_refused_before_the_ranks_start(sharded, model_dir, tokenizer):
    one = GRPOTrainer(model_dir, GRPOConfig(**KNOBS))
    batch = make_batch(one, tokenizer)
    bad = batch.groups[0].samples[0]
    batch.groups[0].samples[0] = bad.model_copy(update={"token_ids": [*bad.token_ids[:-1], 10**6]})
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        sharded.step(batch)
    assert sharded.step(make_batch(one, tokenizer))["trained"] == 1.0  # the group still works


def test_exported_weights_serve_in_the_engine(sharded, model_dir, tokenizer, tmp_path):
    """The route `servers.training.lifecycle.publish_weights` takes for this trainer: no tensors in this process, a
    directory the engine loads; the engine then gives the exported model's logprobs."""
    one = GRPOTrainer(model_dir, GRPOConfig(**KNOBS))
    sharded.step(two_group_batch(one, tokenizer))
    assert sharded.named_weights() is None
    directory = sharded.export_weights(tmp_path / "weights")
    assert list(directory.glob("*.safetensors")) and (directory / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(directory)
    prompt = encode(tokenizer, "What is 2 + 3?", "")[0]
    with TorchEngine(model_dir, device="cpu") as engine:
        engine.load_weights_from(directory)

        async def generate():
            ids, logprobs = [], []
            async for chunk in engine.generate(prompt, SamplingParams(max_tokens=8, seed=3)):
                ids, logprobs = ids + chunk.token_ids, logprobs + chunk.logprobs
            return ids, logprobs

        ids, logprobs = asyncio.run(generate())
    full = torch.tensor([prompt + ids])
    with torch.no_grad():
        want = token_logprobs(model, full, torch.ones_like(full))[0, len(prompt) :].tolist()
    assert logprobs == pytest.approx(want, abs=1e-4)


def test_save_then_a_fresh_group_resumes_exactly(sharded, spare_ranks, model_dir, tokenizer, tmp_path):
    one = GRPOTrainer(model_dir, GRPOConfig(**KNOBS))
    sharded.step(two_group_batch(one, tokenizer, step=1))
    batch2 = two_group_batch(one, tokenizer, step=2)
    sharded.save(tmp_path / "ckpt")
    draws_after_save = rng_draws()
    m_a = sharded.step(batch2)
    w_a = exported(sharded, tmp_path / "a")

    random.seed(1), np.random.seed(1), torch.manual_seed(1)  # scrambled: load must restore the saved RNG states
    spare_ranks.load(tmp_path / "ckpt")
    assert spare_ranks.step_count == 1 and rng_draws() == draws_after_save
    spare_ranks.save(tmp_path / "again")  # the loaded state, written back: the same model and optimizer state
    assert_same_checkpoint(tmp_path / "ckpt", tmp_path / "again")
    m_b = spare_ranks.step(batch2)
    w_b = exported(spare_ranks, tmp_path / "b")
    for name, tensor in w_a.items():
        torch.testing.assert_close(w_b[name], tensor, rtol=0, atol=1e-6)
    assert m_b["loss"] == pytest.approx(m_a["loss"], abs=1e-6) and spare_ranks.step_count == sharded.step_count == 2


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """Same weights (the export and the fp32 shards), the same optimizer state, step and number of rank RNGs."""
    weights_a, weights_b = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    state_a = torch.load(a / TRAINER_STATE_FILE, weights_only=False)
    state_b = torch.load(b / TRAINER_STATE_FILE, weights_only=False)
    assert state_a["step_count"] == state_b["step_count"] and len(state_a["rank_rngs"]) == 2
    assert state_a["sharded_optimizer"] and state_b["sharded_optimizer"]
    sharded_a, sharded_b = read_sharded(a), read_sharded(b)
    assert sharded_a["model"].keys() == sharded_b["model"].keys()
    assert all(torch.equal(sharded_a["model"][k], sharded_b["model"][k]) for k in sharded_a["model"])
    opt_a, opt_b = sharded_a["optimizer"], sharded_b["optimizer"]
    assert opt_a["param_groups"] == opt_b["param_groups"]
    assert opt_a["state"].keys() == opt_b["state"].keys() and opt_a["state"]
    for name, st in opt_a["state"].items():
        for key, value in st.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_b["state"][name][key])), (name, key)


def read_sharded(checkpoint: Path) -> dict:
    """A checkpoint's `sharded/` (every rank's shards) as one plain state dict."""
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(checkpoint / SHARDED_DIR, Path(scratch) / "full.pt")
        return torch.load(Path(scratch) / "full.pt", weights_only=False)


def test_checkpoints_cross_between_one_process_and_ranks(ranks, model_dir, tokenizer, tmp_path):
    """Switching `trainer: grpo` <-> `fsdp` keeps a run: each loads the other's checkpoint, optimizer included."""
    one = GRPOTrainer(model_dir, GRPOConfig(**KNOBS))
    one.step(two_group_batch(one, tokenizer, step=1))
    one.save(tmp_path / "one")
    ranks.load(tmp_path / "one")
    batch2 = two_group_batch(one, tokenizer, step=2)
    ranks.step(batch2), one.step(batch2)
    assert_weights_close(exported(ranks, tmp_path / "w"), one.policy.state_dict(), rel=1e-4)
    ranks.save(tmp_path / "ranks")
    back = GRPOTrainer(model_dir, GRPOConfig(**KNOBS))
    back.load(tmp_path / "ranks")
    assert back.step_count == 2 and back.optimizer.state
    batch3 = two_group_batch(one, tokenizer, step=3)
    back.step(batch3), one.step(batch3)
    assert_weights_close(back.policy.state_dict(), one.policy.state_dict(), rel=1e-4)


def test_a_killed_rank_fails_the_step_and_stops_the_group(spare_ranks, model_dir, tokenizer):
    one = GRPOTrainer(model_dir, GRPOConfig(**KNOBS))
    config = FSDPConfig(ranks=2, **{**KNOBS, "micro_batch_tokens": 16, "ppo_epochs": 4})  # many micro-batches
    spare_ranks.config = config
    with ThreadPoolExecutor(1) as pool:
        step = pool.submit(spare_ranks.step, two_group_batch(one, tokenizer))
        deadline = time.monotonic() + 120
        while (spare_ranks.progress or (0, 0))[0] < 1:  # rank 0 reported its first micro-batch
            assert time.monotonic() < deadline and not step.done(), "the step never started"
            time.sleep(0.01)
        os.kill(spare_ranks.ranks.pids[1], signal.SIGKILL)
        with pytest.raises(RankFailure, match="rank 1 died"):
            step.result(timeout=60)
    deadline = time.monotonic() + 30
    while any(process_alive(pid) for pid in spare_ranks.ranks.pids):
        assert time.monotonic() < deadline, "a rank outlived its group"
        time.sleep(0.05)
    with pytest.raises(RankFailure, match="gone"):
        spare_ranks.export_weights(Path("/nonexistent"))


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_server_trains_publishes_checkpoints_and_resumes_with_ranks(local_server):
    """`trainer: fsdp` in the synced config: the swarm server drives the sharded trainer like any other (a step,
    weights to the engine through a directory, a checkpoint), stops its ranks with the engine, and a restart resumes
    from the checkpoint on a new group."""
    from tests.conftest import admin_http, play_episode, start_rolling, wait_state, wait_version

    with local_server() as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=1, num_repeat=2, save_freq=1, trainer="fsdp",
                      fsdp={"ranks": 2, "learning_rate": 1e-3})
        first = srv.server.lifecycle.trainer
        assert isinstance(first, FSDPTrainer) and first.ranks.world_size == 2
        play_episode(http, "t0", 1.0), play_episode(http, "t0", 0.0)
        wait_version(http, 1, timeout=120)
        assert (srv.data_dir / "checkpoints" / "step_000001" / TRAINER_STATE_FILE).is_file()
        assert srv.server.lifecycle.engine.stats.weight_loads == 1  # exported, then loaded from the directory
        pids = first.ranks.pids
        assert http.post("/control/stop").status_code == 200
        wait_state(http, "OFFLINE")
        assert not any(_alive(pid) for pid in pids)  # the ranks stop with the engine
        assert http.post("/control/start").status_code == 200
        assert wait_state(http, "ROLLING", timeout=120)["policy_version"] == 1  # resumed on a new group
        assert srv.server.lifecycle.trainer is not first and srv.server.lifecycle.trainer.step_count == 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # the ranks were joined when they stopped, so a stopped rank's pid is gone
    except ProcessLookupError:
        return False
    return True
