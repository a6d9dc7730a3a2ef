"""`marl plan`: the memory arithmetic against hand-computed figures for Qwen2.5-7B/14B shapes (built here, no
download), refusals at the key to change, the shipped GPU topology fitting 80 GB, and the same check in `marl run`.
The model against measured peaks on this CPU: tests/servers/test_plan_measured.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from marl.plan import KNOWN_ARCHITECTURES, Architecture, UnknownModel, architecture_of, plan_topology
from marl.plan.memory import (
    GB,
    NCCL_COMMUNICATOR_BYTES,
    TrainerSetting,
    VLLMSetting,
    checkpoint_host,
    engine_vllm,
    trainer_rank,
)
from marl.topology import Topology, TopologyError

REPO = Path(__file__).resolve().parents[2]
WEREWOLVES = REPO / "topologies" / "werewolves-7b-14b-235b.yaml"
QWEN_7B = KNOWN_ARCHITECTURES["qwen/qwen2.5-7b-instruct"]
QWEN_14B = KNOWN_ARCHITECTURES["qwen/qwen2.5-14b-instruct"]


def _qwen_config(arch: Architecture) -> Qwen2Config:
    return Qwen2Config(hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
                       num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads,
                       num_key_value_heads=arch.num_kv_heads, vocab_size=arch.vocab_size,
                       tie_word_embeddings=arch.tie_word_embeddings, max_position_embeddings=32768)  # fmt: skip


@pytest.mark.parametrize("arch", [QWEN_7B, QWEN_14B], ids=["7b", "14b"])
def test_parameter_count_is_the_built_models(arch):
    config = _qwen_config(arch)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    built = sum(p.numel() for p in model.parameters())
    assert arch.parameter_count() == built
    assert Architecture.from_config(config.to_dict(), name="x").parameter_count() == built


def test_published_sizes_and_kv_per_token():
    assert QWEN_7B.parameter_count() == 7_615_616_512  # "7.61B" on the model card
    assert QWEN_14B.parameter_count() == 14_770_033_664  # "14.7B"
    assert QWEN_7B.kv_bytes_per_token(2) == 2 * 28 * 4 * 128 * 2 == 56 * 1024
    assert QWEN_14B.kv_bytes_per_token(2) == 2 * 48 * 8 * 128 * 2 == 192 * 1024
    assert QWEN_14B.kv_bytes_per_token(2, tensor_parallel=2) == 96 * 1024  # KV heads split over the GPUs
    moe = KNOWN_ARCHITECTURES["qwen/qwen3-235b-a22b-instruct-2507"]
    assert moe.kv_bytes_per_token(2, tensor_parallel=8) == 2 * 94 * 1 * 128 * 2  # 4 KV heads on 8 GPUs: replicated


def test_trainer_rank_of_a_7b_on_8_gpus_by_hand():
    setting = TrainerSetting(ranks=8, compute_bytes=2, micro_batch_tokens=32768, checkpointing=True, sharded=True,
                             on_gpu=True)  # fmt: skip
    resident, peak = trainer_rank(QWEN_7B, setting)
    p = 7_615_616_512
    parts = dict(peak.items)
    assert parts["parameters (fp32 shard)"] == 4 * p / 8
    assert parts["AdamW moments (fp32)"] == 8 * p / 8
    assert parts["gradients (fp32 shard)"] == 4 * p / 8
    # checkpointing: 28 layer inputs of 32768 x 3584 bf16 values, plus one layer's activations:
    # 32768 x (2 x (4 x 18944 + 9 x 3584 + 2 x 512) + 4 x 2 x 3584) bytes
    assert parts["activations"] == 28 * 32768 * 2 * 3584 + 32768 * (2 * (4 * 18944 + 9 * 3584 + 2 * 512) + 8 * 3584)
    assert parts["logits (one chunk)"] == 1024 * 152064 * (2 + 12)
    layer = 3584 * 3584 * 2 + 2 * 3584 * 512 + 3584 + 2 * 512 + 3 * 3584 * 18944 + 2 * 3584
    assert parts["gathered parameters"] == (2 * 152064 * 3584 + 2 * layer) * 2 + layer * (2 + 4)
    # between steps: the shards, the CUDA context, no NCCL communicator (the setting names none) and the allocator's
    # residue after empty_cache: one 20 MiB page per decoder layer
    assert resident.total == pytest.approx(12 * p / 8 + 0.75 * 2**30 + 28 * 20 * 2**20)
    assert parts["head gradient (unsharded)"] == 152064 * 3584 * 2  # V x H in bf16, held through the backward
    unsharded = trainer_rank(QWEN_7B, TrainerSetting(ranks=1, micro_batch_tokens=32768, checkpointing=True))[1]
    assert unsharded.total > 120e9 > 80e9 > peak.total  # the fp32 one-process trainer could never fit one GPU


def test_vllm_on_one_gpu_by_hand():
    awake, kv = engine_vllm(QWEN_7B, VLLMSetting(gpu_bytes=80e9, utilization=0.5))
    parts = dict(awake.items)
    assert parts["weights"] == 7_615_616_512 * 2
    assert kv == pytest.approx(0.5 * 80e9 - (awake.total - parts["KV cache"]))
    fixed, kv_fixed = engine_vllm(QWEN_7B, VLLMSetting(gpu_bytes=80e9, utilization=0.5, kv_cache_bytes=4 * 2**30))
    assert kv_fixed == 4 * 2**30 == dict(fixed.items)["KV cache"]


def test_a_model_directory_is_read_from_its_config(tmp_path, tiny_model):
    arch = architecture_of(str(tiny_model))
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert arch.parameter_count() == sum(p.numel() for p in model.parameters())
    with pytest.raises(UnknownModel, match="Qwen/Qwen2.5-7B-Instruct"):
        architecture_of("acme/unknown-13b")


# ----------------------------------------------------------------------------------------------------------------
# Topologies
# ----------------------------------------------------------------------------------------------------------------


def _plan(*overrides: str):
    return plan_topology(Topology.load(WEREWOLVES, list(overrides), check_env=False).spec)


def test_the_shipped_gpu_topology_fits_80_gb_on_every_gpu():
    plan = _plan()
    assert plan.problems == []
    assert [s.server for s in plan.servers] == ["wolves_7b", "seer_14b", "frozen_235b"]
    for server in plan.servers:
        for device in server.devices:
            assert device.capacity == 80e9
            assert device.peak <= 80e9, (server.server, device.device)
    seer = plan.servers[1].devices[0]
    assert seer.step is not None and any(what == "engine asleep" for what, _ in seer.step.items)


def test_overlap_keeps_the_engine_awake_in_the_step_and_the_plan_counts_it():
    """`overlap`: vLLM generates during the step, so on a GPU it shares with the trainer it is counted awake."""
    asleep = _plan().servers[1].devices[0]
    awake = _plan("servers.seer_14b.train.overlap=true").servers[1].devices[0]
    assert any(what == "engine (awake)" for what, _ in awake.step.items)
    assert awake.step.total > asleep.step.total


@pytest.mark.parametrize(("override", "key"), [
    ("servers.seer_14b.vllm.kv_cache_gb=2", "servers.seer_14b.vllm.max_model_len"),
    ("servers.seer_14b.vllm.gpu_memory_utilization=0.8", "servers.seer_14b.vllm.gpu_memory_utilization"),
    ("servers.wolves_7b.train.fsdp.gradient_checkpointing=false", "servers.wolves_7b.train"),
    ("servers.frozen_235b.placement.gpu_memory_gb=40", "servers.frozen_235b.vllm.tensor_parallel_size"),
])  # fmt: skip
def test_a_plan_that_cannot_fit_is_refused_at_the_key_to_change(override, key):
    problems = _plan(override).problems
    assert problems and {p.key for p in problems} == {key}, problems
    assert "GB" in problems[0].message


def test_cpu_servers_share_this_machines_memory(tiny_model):
    data = {"name": "t", "servers": {"a": {"model": str(tiny_model), "device": "cpu", "trainable": True,
                                           "train": {"batch_size": 1, "num_repeat": 2}}},
            "roles": {"speaker": {"server": "a"}, "listener": {"server": "a"}},
            "env": {"class": "envs.signalling:Signalling"}, "run": {"games": 1}}  # fmt: skip
    spec = Topology.from_dict(data, check_env=False).spec
    assert plan_topology(spec).problems == []
    refused = plan_topology(spec, host_memory=1e6).problems
    assert [p.key for p in refused] == ["servers.a"] and "weights and trainer state" in refused[0].message


def test_marl_plan_prints_the_table_and_exits_1_naming_the_key():
    marl = [sys.executable, "-m", "marl"]
    ok = subprocess.run([*marl, "plan", str(WEREWOLVES)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "GPUs 0-7" in ok.stdout and "fits:" in ok.stdout
    bad = subprocess.run([*marl, "plan", str(WEREWOLVES), "servers.seer_14b.vllm.kv_cache_gb=2"], capture_output=True,
                         text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert bad.returncode == 1 and "servers.seer_14b.vllm.max_model_len" in bad.stdout


def test_marl_run_refuses_before_starting_anything(tmp_path):
    from marl.runner.run import run

    run_dir = tmp_path / "run"
    with pytest.raises(TopologyError, match=r"servers\.seer_14b\.vllm\.max_model_len"):
        run(str(WEREWOLVES), ["servers.seer_14b.vllm.kv_cache_gb=2", f"run.run_dir={run_dir}"])
    assert not run_dir.exists()
    assert GB == 1e9


def test_vllms_share_beside_a_trainer_rank_is_sized_by_the_plan_and_passed_by_marl_run():
    from rich.console import Console

    from marl.plan.topology_plan import utilization_beside
    from marl.runner.run import check_memory_plan

    assert utilization_beside(12.2e9, 80e9) == 0.75  # (80 - 12.2) / 80 - 0.05 = 0.7975, down to a step of 0.05
    assert utilization_beside(1e9, 80e9) == 0.9  # never more than vLLM's own default
    data = {"name": "t", "servers": {"a": {
                "model": "Qwen/Qwen2.5-7B-Instruct", "device": "cuda", "engine": "vllm", "trainable": True,
                "placement": {"gpu_memory_gb": 80, "engine_gpus": [0, 1], "trainer_gpus": [0, 1]},
                "vllm": {"data_parallel_size": 2, "max_model_len": 8192},
                "train": {"batch_size": 1, "num_repeat": 2, "trainer": "fsdp",
                          "fsdp": {"ranks": 2, "gradient_checkpointing": True, "micro_batch_tokens": 8192}}}},
            "roles": {"speaker": {"server": "a"}, "listener": {"server": "a"}},
            "env": {"class": "envs.signalling:Signalling"}, "run": {"games": 1}}  # fmt: skip
    topology = Topology.from_dict(data, check_env=False)
    plan = plan_topology(topology.spec)
    # two ranks' fp32 parameter and AdamW shards, CUDA context, their group's NCCL buffers, the allocator's residue
    resident = 12 * 7_615_616_512 / 2 + 0.75 * 2**30 + NCCL_COMMUNICATOR_BYTES + 28 * 20 * 2**20
    assert plan.problems == [] and plan.servers[0].defaults == {
        "vllm.gpu_memory_utilization": utilization_beside(resident, 80e9)}
    check_memory_plan(topology, "t.yaml", Console(file=None, quiet=True))
    assert topology.spec.servers["a"].vllm.gpu_memory_utilization == utilization_beside(resident, 80e9) == 0.35


def test_under_ray_the_plan_reads_the_placement_group_each_rank_on_a_gpu_of_its_own():
    data = {"name": "t", "servers": {"a": {
                "model": "Qwen/Qwen2.5-7B-Instruct", "device": "cuda", "engine": "vllm", "trainable": True,
                "resources": {"GPU": 1}, "placement": {"gpu_memory_gb": 80, "nodes": 2},
                "vllm": {"data_parallel_size": 2, "max_model_len": 8192},
                "train": {"batch_size": 1, "num_repeat": 2, "trainer": "fsdp",
                          "fsdp": {"ranks": 4, "gradient_checkpointing": True, "micro_batch_tokens": 8192}}}},
            "roles": {"speaker": {"server": "a"}, "listener": {"server": "a"}},
            "env": {"class": "envs.signalling:Signalling"}, "run": {"games": 1, "ray": {"address": "auto"}}}
    plan = plan_topology(Topology.from_dict(data, check_env=False).spec).servers[0]
    assert "vLLM on GPUs 0,1, 4 trainer ranks on GPUs 2-5" in plan.summary  # a rank's GPU is its bundle's
    assert ("Ray placement group (PACK): bundle 0: the server and vLLM's first replica, {CPU: 1, GPU: 1}; bundles"
            " 1-4: trainer ranks 0-3, each {CPU: 1, GPU: 1}; bundle 5: vLLM replica 1, {CPU: 1, GPU: 1}") in plan.notes
    assert "vllm.gpu_memory_utilization" in plan.defaults and plan.defaults["vllm.gpu_memory_utilization"] == 0.9
    assert plan.weights == "disk"  # a rank may run on another machine: vLLM reloads from the shared filesystem
    data["servers"]["a"].update(trainable=False, train=None, placement={"gpu_memory_gb": 80})
    static = plan_topology(Topology.from_dict(data, check_env=False).spec).servers[0]
    assert ("Ray placement group (STRICT_PACK): bundle 0: the server and vLLM's first replica, {CPU: 1, GPU: 1};"
            " bundle 1: vLLM replica 1, {CPU: 1, GPU: 1}") in static.notes


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj")], ids=["qv", "all-linear"])
def test_lora_parameters_are_peft_s(targets):
    from peft import LoraConfig, get_peft_model

    config = _qwen_config(QWEN_7B)
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(config),
                               LoraConfig(r=16, lora_alpha=32, target_modules=list(targets)))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert QWEN_7B.lora_params(16, targets) == trainable


def test_lora_policies_keep_one_frozen_base_and_small_adapters():
    adapter = QWEN_7B.lora_params(16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    full = TrainerSetting(micro_batch_tokens=4096, checkpointing=True, on_gpu=True)
    lora = TrainerSetting(micro_batch_tokens=4096, checkpointing=True, on_gpu=True, adapters=(adapter,) * 3)
    p = QWEN_7B.parameter_count()
    parts = dict(trainer_rank(QWEN_7B, lora)[1].items)
    assert parts["parameters (fp32, frozen)"] == 4 * p
    assert parts["3 adapters + AdamW moments (fp32)"] == 36 * adapter
    assert parts["gradients (one adapter, fp32)"] == 4 * adapter
    assert "AdamW moments (fp32)" not in parts  # the base has no optimizer state
    # 3 LoRA policies in one trainer against one full-weight trainer: about a third of its peak
    assert trainer_rank(QWEN_7B, lora)[1].total < 0.4 * trainer_rank(QWEN_7B, full)[1].total


def test_lora_policies_on_fsdp_ranks_keep_a_shard_each():
    adapter = QWEN_7B.lora_params(16, ("q_proj", "v_proj"))
    one = TrainerSetting(micro_batch_tokens=4096, checkpointing=True, on_gpu=True, adapters=(adapter,) * 2)
    sharded = TrainerSetting(ranks=4, compute_bytes=2, micro_batch_tokens=4096, checkpointing=True, on_gpu=True,
                             sharded=True, adapters=(adapter,) * 2)  # fmt: skip
    parts = dict(trainer_rank(QWEN_7B, sharded)[1].items)
    assert parts["parameters (fp32 shard, frozen)"] == QWEN_7B.parameter_count()  # 4P / 4 ranks
    assert parts["2 adapters + AdamW moments (fp32 shard)"] == 6 * adapter
    assert parts["gathered parameters"] > 0 and "gradients (fp32 shard)" not in parts  # no base gradient
    assert trainer_rank(QWEN_7B, sharded)[1].total < 0.5 * trainer_rank(QWEN_7B, one)[1].total


def test_the_plan_of_a_lora_topology_counts_its_adapters():
    plan = plan_topology(Topology.load(REPO / "topologies" / "signalling-lora.yaml").spec, host_memory=24 * GB)
    team = next(p for p in plan.servers if p.server == "team")
    step = dict(team.devices[0].step.items)
    adapter = KNOWN_ARCHITECTURES["huggingfacetb/smollm2-135m-instruct"].lora_params(16, (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    assert adapter == 4_884_480  # 19.5 MB in fp32: what the trainer exports (bench/lora_publish.py)
    assert step["trainer: 2 adapters + AdamW moments (fp32)"] == 24 * adapter
    assert step["engine: LoRA adapters"] == 2 * adapter * 4
    assert team.disk_per_checkpoint.total == 24 * adapter


def test_the_entropy_bonus_costs_its_backward_over_the_vocabulary():
    """train.grpo.entropy_coef > 0 keeps the probabilities of every kept token's vocabulary for the backward: 8 bytes
    more per logits value (measured: bench/plan_accuracy.py's grpo+entropy case on SmolLM2, 1.07 of the plain step
    as the plain one is)."""
    path = REPO / "topologies" / "signalling-cpu.yaml"

    def logits(*overrides: str) -> float:
        plan = plan_topology(Topology.load(path, overrides).spec, host_memory=24 * GB)
        return dict(plan.servers[0].devices[0].step.items)["trainer: logits (one chunk)"]

    smollm2 = KNOWN_ARCHITECTURES["huggingfacetb/smollm2-135m-instruct"]
    assert logits() == 1024 * smollm2.vocab_size * (4 + 12)
    entropy = "servers.speaker_model.train.grpo.entropy_coef=0.01"
    assert logits(entropy) == 1024 * smollm2.vocab_size * (4 + 12 + 8)


# ----------------------------------------------------------------------------------------------------------------
# What a real box holds beyond the tensors: NCCL, the head's gradient, the allocator, checkpoints, host memory
# ----------------------------------------------------------------------------------------------------------------


def test_nccl_buffers_head_gradient_and_root_reduce_by_hand():
    # 32 channels x 2 ring peers x (Simple 4 MiB + LL128 120 x 640 x 8 x 8 + LL 8 x 512 x 8 x 16 bytes)
    assert NCCL_COMMUNICATOR_BYTES == 32 * 2 * (4 * 2**20 + 4_915_200 + 524_288) == 616_562_688
    setting = TrainerSetting(ranks=8, compute_bytes=2, micro_batch_tokens=32768, checkpointing=True, sharded=True,
                             on_gpu=True, nccl_communicators=2)  # fmt: skip
    resident, peak = trainer_rank(QWEN_7B, setting)
    assert dict(resident.items)["NCCL buffers"] == 2 * 616_562_688 == dict(peak.items)["NCCL buffers"]
    assert dict(resident.items)["allocator residue"] == 28 * 20 * 2**20  # between steps only
    assert "allocator residue" not in dict(peak.items)
    # a short micro-batch: the root's reduce-scatter (its gathered parameters and gradients in bf16, their fp32
    # copy) outweighs the pass: embeddings + untied head, 2 x 152064 x 3584, x (2 + 2 + 4) bytes
    short_batch = TrainerSetting(ranks=8, compute_bytes=2, micro_batch_tokens=256, checkpointing=True, sharded=True,
                                 on_gpu=True)  # fmt: skip
    short = dict(trainer_rank(QWEN_7B, short_batch)[1].items)
    assert short["root reduce-scatter"] == 2 * 152064 * 3584 * 8
    assert "head gradient (unsharded)" not in short


def test_checkpoint_staging_of_a_box_by_hand():
    seven = checkpoint_host(QWEN_7B, ranks_here=8, ranks=8, export_bytes=2)
    parts = dict(seven.items)
    assert parts["async_save staging (8 ranks' shards)"] == 12 * 7_615_616_512  # 91.4 GB: fp32 + AdamW, all ranks
    assert parts["rank 0's export gather"] == 2 * 7_615_616_512  # the bf16 export on rank 0's host
    fourteen = checkpoint_host(QWEN_14B, ranks_here=8, ranks=8, export_bytes=2)
    assert dict(fourteen.items)["async_save staging (8 ranks' shards)"] / GB == pytest.approx(177.24, abs=0.01)
    two_nodes = checkpoint_host(QWEN_14B, ranks_here=8, ranks=16, export_bytes=2)  # half the ranks on this box
    assert dict(two_nodes.items)["async_save staging (8 ranks' shards)"] == 6 * 14_770_033_664


def test_a_checkpoint_is_planned_with_vllm_awake_on_the_shared_gpus():
    wolves = _plan().servers[0]
    gpus = wolves.devices[0]
    assert gpus.save is not None
    assert gpus.save.total == pytest.approx(gpus.rollouts.total + 152064 * 3584 * 2)  # + one full bf16 head
    assert gpus.peak == gpus.save.total
    host = wolves.host
    assert host is not None and host.capacity is None
    assert dict(host.moments["a checkpoint"].items)["async_save staging (8 ranks' shards)"] == 12 * 7_615_616_512
    # the step: 8 sleeping replicas' bf16 weights on the host
    assert dict(host.moments["a training step"].items)["sleeping vLLM's weights"] == 8 * 2 * 7_615_616_512


def test_host_memory_is_checked_only_when_stated_and_refused_at_its_key():
    assert _plan("servers.wolves_7b.placement.host_memory_gb=2000").problems == []
    problems = _plan("servers.wolves_7b.placement.host_memory_gb=100").problems
    assert [p.key for p in problems] == ["servers.wolves_7b.placement.host_memory_gb"]
    assert "GB of host memory at a training step" in problems[0].message


WAYS = [  # (engine GPUs, trainer GPUs, tensor x data parallel, setting) -> the way
    ([0], [0], (1, 1), "auto", "ipc"),
    (list(range(8)), list(range(8)), (1, 8), "auto", "ipc"),  # colocated, any tensor x data parallel size
    ([0, 1, 2, 3], list(range(8)), (2, 2), "auto", "ipc"),
    ([0, 1], [2, 3, 4, 5, 6, 7], (1, 2), "auto", "nccl"),  # disjoint
    ([0, 1], [1, 2], (1, 2), "auto", "disk"),  # a partial overlap
    (list(range(8)), [0, 1, 2, 3], (1, 8), "auto", "disk"),
    ([0], [0], (1, 1), "disk", "disk"),  # an explicit setting wins
    ([0], [1], (1, 1), "disk", "disk"),
]  # fmt: skip


@pytest.mark.parametrize(("engine", "trainer", "parallel", "mode", "way"), WAYS)
def test_the_weights_way_per_placement(engine, trainer, parallel, mode, way):
    from marl.plan.box import weight_sync_way

    assert weight_sync_way(mode, on_cpu=False, engine_gpus=engine, trainer_gpus=trainer) == way
    assert weight_sync_way("auto", on_cpu=True, engine_gpus=engine, trainer_gpus=trainer) == "disk"
    tp, dp = parallel
    data = {"name": "t", "servers": {"a": {
                "model": "Qwen/Qwen2.5-0.5B-Instruct", "device": "cuda", "engine": "vllm", "trainable": True,
                "placement": {"gpu_memory_gb": 80, "engine_gpus": engine, "trainer_gpus": trainer},
                "vllm": {"tensor_parallel_size": tp, "data_parallel_size": dp, "max_model_len": 4096,
                         "weight_sync": mode},
                "train": {"batch_size": 1, "num_repeat": 2, "trainer": "fsdp", "fsdp": {"micro_batch_tokens": 4096}}}},
            "roles": {"speaker": {"server": "a"}, "listener": {"server": "a"}},
            "env": {"class": "envs.signalling:Signalling"}, "run": {"games": 1}}  # fmt: skip
    plan = plan_topology(Topology.from_dict(data, check_env=False).spec).servers[0]
    assert plan.weights == way
    exported = dict(plan.disk_per_step.items).get("weights for the engine", 0)
    assert exported == (2 * 494_032_768 if way == "disk" else 0)  # the bf16 safetensors, only by disk


@pytest.mark.parametrize(("engine", "trainer", "parallel", "mode", "way"), WAYS)
def test_the_plan_chooses_the_way_the_server_does(engine, trainer, parallel, mode, way, monkeypatch):
    """The plan's mirror of the rule against the server's own, built as `marl serve` builds it (with the trainer's
    NCCL library found, as the plan assumes on CUDA)."""
    from types import SimpleNamespace

    from marl.plan.box import weight_sync_way
    from servers.engines.vllm_process import VLLMLaunch, VLLMSettings
    from servers.entrypoint import vllm_placement
    from servers.placement import Placement

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    options = SimpleNamespace(placement=Placement(engine_gpus=engine, trainer_gpus=trainer), device="cuda",
                              static=False)  # fmt: skip
    tp, dp = parallel
    launch = VLLMLaunch(model_dir=Path("model"), max_model_len=4096, device="cuda", **vllm_placement(options),
                        settings=VLLMSettings(tensor_parallel_size=tp, data_parallel_size=dp, weight_sync=mode),
                        nccl_library="libnccl.so.2")  # fmt: skip
    assert launch.weight_sync == weight_sync_way(mode, on_cpu=False, engine_gpus=engine, trainer_gpus=trainer)


def test_marl_plan_says_what_it_assumes_of_reserved_memory_and_how_weights_travel():
    out = subprocess.run([sys.executable, "-m", "marl", "plan", str(WEREWOLVES)], capture_output=True, text=True,
                         cwd=REPO, timeout=120, env={**__import__("os").environ, "COLUMNS": "300"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "rollouts assume each trainer rank empties its CUDA cache" in out.stdout
    assert out.stdout.count("weights: ipc; disk per step: 0.0 GB") == 2
    assert "host memory:" in out.stdout and "placement.host_memory_gb not stated" in out.stdout
    assert "checkpoint (vLLM awake)" in out.stdout
