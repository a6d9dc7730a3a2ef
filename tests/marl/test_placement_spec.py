"""A server's `placement:` (marl/topology/spec.py): its rules, each reported at its key; `train.fsdp.ranks` following
it; remote machines described for `marl plan`; the flags `marl run` gives `marl serve` and what `marl serve` makes of
them; the environment a server process starts with; and what `run.ray` requires of GPU placement."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marl.cli import _serve_options, parse
from marl.runner.launch import ServerProcess
from marl.topology import Topology, TopologyError
from servers.placement import Placement

TRAIN = {"job": "s", "batch_size": 2, "num_repeat": 4, "trainer": "fsdp"}


def topology(placement: dict | None = None, **server) -> dict:
    """The signalling game; the speaker's server is a local trainable one with `placement` and `server`'s keys."""
    speaker = {"model": "smollm2-135m", "trainable": True, "train": copy.deepcopy(TRAIN), **server}
    if placement is not None:
        speaker["placement"] = placement
    return {"name": "placement",
            "servers": {"speaker_model": speaker, "listener_model": {"model": "smollm2-135m"}},
            "roles": {"speaker": {"server": "speaker_model"}, "listener": {"server": "listener_model"}},
            "env": {"class": "envs.signalling:SignallingGame"},
            "run": {"max_steps": 2}}


def load(data: dict):
    return Topology.from_dict(data, check_env=False).spec


def problems(data: dict) -> dict[str, str]:
    with pytest.raises(TopologyError) as info:
        load(data)
    return {p.key: p.message for p in info.value.problems}


AT = "servers.speaker_model.placement"


@pytest.mark.parametrize("placement, server, key, words", [
    ({"engine_gpus": [0, 0]}, {}, "engine_gpus", "GPU 0 is listed twice"),
    ({"trainer_gpus": [-1]}, {}, "trainer_gpus.0", "greater than or equal to 0"),
    ({"engine_gpus": []}, {}, "engine_gpus", "at least 1 item"),
    ({"nodes": 0}, {}, "nodes", "greater than or equal to 1"),
    ({"gpu_memory_gb": 0}, {}, "gpu_memory_gb", "greater than 0"),
    ({"trainer_gpus": [0]}, {"device": "cpu"}, "trainer_gpus", "device: cpu uses no GPU"),
    ({"engine_gpus": [0]}, {"engine": "vllm", "vllm": {"tensor_parallel_size": 2, "data_parallel_size": 2}},
     "engine_gpus", "tensor_parallel_size x data_parallel_size = 4 GPUs, but engine_gpus lists 1"),
    ({"engine_gpus": [0, 1]}, {}, "engine_gpus", "the torch engine runs on one GPU"),
    ({"trainer_gpus": [0, 1]}, {"train": {**TRAIN, "fsdp": {"ranks": 4}}}, "trainer_gpus",
     "train.fsdp.ranks is 4, but nodes x len(trainer_gpus) = 1 x 2 = 2"),
    ({"trainer_gpus": [0, 1]}, {"train": {**TRAIN, "trainer": "grpo"}}, "trainer_gpus", "trainer: grpo trains in"
                                                                                        " one process on one GPU"),
    ({"nodes": 2}, {"train": {**TRAIN, "trainer": "grpo"}}, "nodes", "trainer: grpo trains on one machine"),
    ({"nodes": 3}, {}, "nodes", "3 machines need run.ray: the trainer's ranks and vLLM's replicas on other machines"),
    ({"trainer_gpus": [1]}, {"trainable": False, "train": None}, "trainer_gpus", "a static server does not train"),
    ({"engine_gpu": [1]}, {}, "engine_gpu", "did you mean 'engine_gpus'?"),
])  # fmt: skip
def test_a_bad_placement_is_refused_at_its_key(placement, server, key, words):
    data = topology(placement, **server)
    if server.get("train", "") is None:
        del data["servers"]["speaker_model"]["train"]
    found = problems(data)
    assert f"{AT}.{key}" in found, found
    assert words in found[f"{AT}.{key}"]


def test_a_past_of_server_takes_no_placement():
    data = topology()
    data["servers"]["past"] = {"past_of": {"server": "speaker_model"}, "placement": {"engine_gpus": [1]}}
    data["roles"]["listener"]["server"] = "past"
    del data["servers"]["listener_model"]
    assert "remove placement" in problems(data)["servers.past.placement"]


def test_fsdp_ranks_default_to_one_per_trainer_gpu_on_each_node():
    remote = topology()
    remote["servers"]["speaker_model"] = {"swarm_url": "http://box-a:10086", "trainable": True, "train": TRAIN,
                                          "placement": {"trainer_gpus": [4, 5, 6, 7], "nodes": 2, "engine_gpus": [0]}}
    assert load(remote).servers["speaker_model"].train.fsdp.ranks == 8  # its machines, for `marl plan`
    spec = load(topology({"trainer_gpus": [4, 5, 6, 7], "engine_gpus": [0]}))
    assert spec.servers["speaker_model"].train.fsdp.ranks == 4
    given = load(topology({"trainer_gpus": [1, 2]}, train={**TRAIN, "fsdp": {"ranks": 2}}))
    assert given.servers["speaker_model"].train.fsdp.ranks == 2
    assert load(topology()).servers["speaker_model"].train.fsdp.ranks == 2  # no placement: the default, as before


def test_remote_and_external_servers_describe_their_machine_for_marl_plan():
    data = topology()
    data["servers"]["speaker_model"] = {"swarm_url": "http://box-a:10086", "trainable": True, "train": TRAIN,
                                        "vllm": {"tensor_parallel_size": 2},
                                        "placement": {"gpu_memory_gb": 80, "engine_gpus": [0, 1],
                                                      "trainer_gpus": [2, 3, 4, 5, 6, 7]}}  # fmt: skip
    data["servers"]["listener_model"] = {"url": "http://box-c:8000/v1", "model": "Qwen/Qwen3-235B-A22B",
                                         "vllm": {"tensor_parallel_size": 8},
                                         "placement": {"gpu_memory_gb": 80, "engine_gpus": list(range(8))}}
    spec = load(data)
    remote, external = spec.servers["speaker_model"], spec.servers["listener_model"]
    assert remote.placement.engine_gpus == [0, 1] and remote.train.fsdp.ranks == 6
    assert external.placement.gpu_memory_gb == 80 and external.vllm.tensor_parallel_size == 8
    data["servers"]["listener_model"]["placement"]["trainer_gpus"] = [0]  # an external endpoint trains nothing
    assert "a static server does not train" in problems(data)["servers.listener_model.placement.trainer_gpus"]


def serve_options_of(data: dict, name: str = "speaker_model"):
    """The command line `marl run` builds for local server `name`, and what `marl serve` makes of it."""
    spec = load(data).servers[name]
    process = ServerProcess(model=spec.model, admin_token="t", data_dir=Path("d"), log_path=Path("l"),
                            static=not spec.trainable, device=spec.device, engine=spec.engine or "torch",
                            vllm=spec.vllm, placement=spec.placement)  # as marl.runner.run does
    argv = process.args[3:]  # after `python -m marl.cli`
    return argv, _serve_options(parse(argv))


def test_marl_run_passes_the_placement_to_marl_serve():
    argv, options = serve_options_of(topology({"gpu_memory_gb": 80, "engine_gpus": [0], "trainer_gpus": [1, 2, 3]}))
    assert argv[argv.index("--engine-gpus"):] == ["--engine-gpus", "0", "--trainer-gpus", "1,2,3"]
    assert options.placement == Placement(engine_gpus=(0,), trainer_gpus=(1, 2, 3))
    argv, options = serve_options_of(topology())
    assert not any("gpus" in arg or "nodes" in arg for arg in argv) and options.placement == Placement()


def test_the_ray_group_flags_reach_the_placement_and_the_old_node_flags_are_deprecated(capsys):
    options = _serve_options(parse(["serve", "--model", "m", "--ray-group", "run-1.team", "--ray-address", "h:6379"]))
    assert options.placement == Placement(ray_group="run-1.team", ray_address="h:6379")
    assert _serve_options(parse(["serve", "--model", "m", "--rendezvous-port", "29511"])).placement == Placement()
    assert "--rendezvous-port is deprecated and not used" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--trainer-nodes: deprecated; ranks on other machines are Ray actors"):
        _serve_options(parse(["serve", "--model", "m", "--trainer-nodes", "2"]))


def test_marl_serve_refuses_bad_gpu_flags_naming_them():
    assert _serve_options(parse(["serve", "--model", "m", "--trainer-gpus", "0-3,6"])).placement.trainer_gpus == (
        0, 1, 2, 3, 6)
    with pytest.raises(ValueError, match="--engine-gpus: --device cpu uses no GPU"):
        _serve_options(parse(["serve", "--model", "m", "--device", "cpu", "--engine-gpus", "0"]))
    with pytest.raises(SystemExit):  # argparse: "'1,1': GPU indices must be given once each"
        parse(["serve", "--model", "m", "--engine-gpus", "1,1"])


def test_a_server_process_starts_with_the_environment_it_is_given(tmp_path):
    process = ServerProcess(model="m", admin_token="t", data_dir=tmp_path, log_path=tmp_path / "log",
                            environment={"CUDA_VISIBLE_DEVICES": ""})  # a Ray actor without GPUs gives this
    child = subprocess.run([sys.executable, "-c", "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')),"
                            " os.environ['MARL_ADMIN_TOKEN'])"], env=process.environment(), capture_output=True,
                           text=True, check=True)  # fmt: skip
    assert child.stdout.split() == ["''", "t"]
    default = ServerProcess(model="m", admin_token="t", data_dir=tmp_path, log_path=tmp_path / "log")
    assert default.environment().get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_under_ray_a_server_places_only_the_gpus_its_actor_asks_for():
    data = topology({"engine_gpus": [0], "trainer_gpus": [1]}, resources={"GPU": 1}, device="cuda",
                    train={**TRAIN, "trainer": "grpo"})
    data["run"]["ray"] = {"address": "local"}
    found = problems(data)
    assert "ask for resources: {GPU: 2} or more" in found[AT]
    data["servers"]["speaker_model"]["resources"] = {"GPU": 2}
    load(data)
    fsdp = topology({"engine_gpus": [0], "trainer_gpus": [1, 2]}, resources={"GPU": 3}, device="cuda")
    fsdp["run"]["ray"] = {"address": "local"}  # an FSDP trainer's ranks have GPUs of their own bundles
    assert "each trainer rank is a Ray actor with its own GPU" in problems(fsdp)[f"{AT}.trainer_gpus"]
    del data["servers"]["speaker_model"]["resources"]
    assert "add resources: {GPU: n}" in problems(data)["servers.speaker_model.device"]
