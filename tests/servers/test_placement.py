"""Placement on the server's side: every process a server starts sees only its GPUs. Real processes throughout; the
GPUs are CUDA_VISIBLE_DEVICES values (this machine has none: what is checked is what each child process sees). Ranks
on other machines are Ray actors: tests/marl/test_ray.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from marl.protocol import TrainConfig
from servers.engines.vllm_process import VLLMLaunch, VLLMSettings
from servers.entrypoint import ServeOptions, default_trainer_factory, vllm_placement
from servers.placement import Placement, visible_devices
from servers.trainers.fsdp import FSDPConfig, FSDPTrainer
from servers.trainers.fsdp_worker import RankPlace
from tests.servers.test_fsdp_trainer import KNOBS

TOKEN = "placement-test-token"


@pytest.fixture(scope="module")
def one_node(model_dir):
    """Two ranks on this node, on trainer GPUs 1 and 3 of a server that sees physical GPUs 4-7."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
        env.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        trainer = FSDPTrainer(model_dir, FSDPConfig(ranks=2, **KNOBS), device="cpu", threads_per_rank=1,
                              placement=Placement(trainer_gpus=(1, 3)))  # fmt: skip
    yield trainer
    trainer.close()


def place_of(trainer: FSDPTrainer, rank: int) -> dict[str, str | None]:
    """The torchrun variables and CUDA_VISIBLE_DEVICES that rank's process reported from its own environment."""
    return trainer.ranks.started[rank]["env"]


def test_gpu_indices_count_the_gpus_the_server_sees():
    assert visible_devices([0, 2], {}) == "0,2"
    assert visible_devices([1], {"CUDA_VISIBLE_DEVICES": "4,5"}) == "5"  # e.g. the GPUs Ray gave the actor
    with pytest.raises(ValueError, match="sees only 2"):
        visible_devices([2], {"CUDA_VISIBLE_DEVICES": "4,5"})
    assert Placement(engine_gpus=(2,)).engine_device(None) == "cuda:2"  # the in-process torch engine
    assert Placement(engine_gpus=(2,)).engine_device("cpu") == "cpu"
    assert Placement().engine_device(None) is None  # no placement: as before


def test_ranks_of_a_node_see_its_trainer_gpus_and_pick_theirs_by_local_rank(one_node):
    for rank in (0, 1):
        assert place_of(one_node, rank) == {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": place_of(one_node, 0)["MASTER_PORT"],
            "CUDA_VISIBLE_DEVICES": "5,7",  # trainer GPUs 1 and 3 of 4,5,6,7: both, so NCCL sees its peer
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",  # the rank's default (the plan assumes it)
        }  # fmt: skip


def test_a_users_allocator_setting_reaches_the_ranks(monkeypatch):
    place = RankPlace(rank=0, local_rank=0, local_world_size=1, master_addr="127.0.0.1", master_port=1)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert place.environment(1)["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def launch_for(options: ServeOptions, model_dir: Path) -> VLLMLaunch:
    return VLLMLaunch(model_dir, 64, device="cuda", python=Path(sys.executable), **vllm_placement(options))


def test_vllm_sees_only_its_engine_gpus_and_sleeps_only_beside_its_trainer(model_dir, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    serve = dict(model="m", port=1, engine="vllm", device="cuda")
    apart = launch_for(ServeOptions(**serve, placement=Placement(engine_gpus=(0,), trainer_gpus=(1, 2))), model_dir)
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"],
                           env=apart.environment(), capture_output=True, text=True, check=True)  # fmt: skip
    assert child.stdout.strip() == "4"  # engine GPU 0 of what the server sees
    assert not apart.sleeps_between_steps and "--enable-sleep-mode" not in apart.command(8000)
    assert apart.command(8000)[apart.command(8000).index("--gpu-memory-utilization") + 1] == "0.9"  # its own GPU

    beside = launch_for(ServeOptions(**serve, placement=Placement(engine_gpus=(1,), trainer_gpus=(1, 2))), model_dir)
    assert beside.environment()["CUDA_VISIBLE_DEVICES"] == "5"
    assert beside.sleeps_between_steps and "--enable-sleep-mode" in beside.command(8000)

    default = launch_for(ServeOptions(**serve), model_dir)  # no placement: as before (GPU 0 shared, all seen)
    assert default.sleeps_between_steps and default.environment()["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    static = launch_for(ServeOptions(**serve, static=True, placement=Placement(engine_gpus=(1,))), model_dir)
    assert not static.sleeps_between_steps


def test_under_ray_vllm_has_its_gpus_to_itself_and_the_weights_go_through_the_disk(model_dir, monkeypatch):
    """--ray-group: the FSDP ranks are Ray actors with GPUs of their own bundles, maybe on other machines: vLLM does
    not sleep for them, and `auto` sends the weights through the shared filesystem (a push meets ranks here)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    options = ServeOptions(model="m", port=1, engine="vllm", device="cuda",
                           placement=Placement(engine_gpus=(0, 1), ray_group="run.team"))
    launch = VLLMLaunch(model_dir, 64, device="cuda", python=Path(sys.executable), nccl_library="libnccl.so.2",
                        settings=VLLMSettings(data_parallel_size=2), **vllm_placement(options))  # fmt: skip
    assert not launch.sleeps_between_steps and launch.gpu_layout == ((0, 1), ())
    assert launch.weight_sync == "disk" and "Ray actors" in launch.disk_reason
    alone = VLLMLaunch(model_dir, 64, device="cuda", python=Path(sys.executable), nccl_library="libnccl.so.2",
                       settings=VLLMSettings(data_parallel_size=2),
                       **vllm_placement(ServeOptions(model="m", port=1, engine="vllm", device="cuda",
                                                     placement=Placement(engine_gpus=(0, 1), trainer_gpus=(2,)))))
    assert alone.weight_sync == "nccl"  # the same GPUs without Ray: ranks on this machine, pushed over NCCL


def test_a_grpo_trainer_on_several_gpus_is_refused_naming_the_fix(model_dir):
    with pytest.raises(ValueError, match="trainer grpo trains in one process on one GPU"):
        default_trainer_factory("cpu", Placement(trainer_gpus=(0, 1)))(model_dir, TrainConfig())
    with pytest.raises(ValueError, match="fsdp.ranks=2, but the server's placement gives 1 trainer GPUs"):
        FSDPTrainer(model_dir, FSDPConfig(ranks=2), device="cpu", placement=Placement(trainer_gpus=(1,)))
