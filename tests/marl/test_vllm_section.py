"""A local server's `vllm:` section: validated at its key and line, and carried by `marl run` to the `marl serve` it
starts as `--vllm-*` flags, which `marl serve` turns back into the same settings (tests/servers/test_vllm_settings.py
follows them onto vLLM's command line)."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import pytest

from marl.cli import _serve_options, parse
from marl.runner.launch import ServerProcess, vllm_flags
from marl.topology import Topology, TopologyError
from servers.engines.vllm_process import VLLMSettings

REPO = Path(__file__).resolve().parents[2]
FULL_SECTION = {"max_model_len": 8192, "gpu_memory_utilization": 0.45, "kv_cache_gb": 6.5,
                "tensor_parallel_size": 2, "data_parallel_size": 3, "dtype": "float16", "max_num_seqs": 96,
                "extra_args": ["--swap-space=8", "--enable-chunked-prefill"], "sleep_between_steps": False}


def topology(vllm: dict | None = None, **server) -> dict:
    """Two local vLLM servers playing the signalling game; `server` changes the speaker's server."""
    speaker = {"model": "smollm2-135m", "trainable": True, "engine": "vllm", "device": "cuda",
               "train": {"job": "s", "batch_size": 2, "num_repeat": 4}, **server}
    if vllm is not None:
        speaker["vllm"] = vllm
    return {"name": "vllm-section",
            "servers": {"speaker_model": speaker,
                        "listener_model": {"model": "smollm2-135m", "engine": "vllm", "device": "cpu"}},
            "roles": {"speaker": {"server": "speaker_model"}, "listener": {"server": "listener_model"}},
            "env": {"class": "envs.signalling:SignallingGame"},
            "run": {"max_steps": 2}}


def serve_options(name: str, data: dict):
    """What `marl serve` makes of the command line `marl run` builds for local server `name`."""
    spec = Topology.from_dict(data, check_env=False).spec.servers[name]
    process = ServerProcess(model=spec.model, admin_token="t", data_dir=Path("d"), log_path=Path("l"),
                            static=not spec.trainable, device=spec.device, engine=spec.engine or "torch",
                            vllm=spec.vllm)  # as marl.runner.run does
    argv = process.args[process.args.index("serve"):]
    return argv, _serve_options(parse(argv))


def problem_at(data: dict, key: str):
    with pytest.raises(TopologyError) as info:
        Topology.from_dict(data, check_env=False)
    problems = {p.key: p.message for p in info.value.problems}
    assert key in problems, str(info.value)
    return problems[key]


def test_every_key_of_the_section_reaches_marl_serve():
    argv, options = serve_options("speaker_model", topology(FULL_SECTION))
    assert options.engine == "vllm"
    assert options.vllm == VLLMSettings(**{**FULL_SECTION, "extra_args": tuple(FULL_SECTION["extra_args"])})
    assert "--vllm-arg=--swap-space=8" in argv and "--vllm-arg=--enable-chunked-prefill" in argv


def test_defaults_are_left_to_marl_serve():
    argv, options = serve_options("listener_model", topology())
    assert options.vllm is None and not [arg for arg in argv if arg.startswith("--vllm")]
    _, options = serve_options("speaker_model", topology({"max_model_len": 4096}))
    assert options.vllm == VLLMSettings(max_model_len=4096)
    assert vllm_flags(Topology.from_dict(topology({"sleep_between_steps": True}), check_env=False)
                      .spec.servers["speaker_model"].vllm) == ["--vllm-sleep-between-steps", "true"]


@pytest.mark.parametrize(("section", "key", "words"), [
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization", "less than or equal to 1"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization", "greater than 0"),
    ({"kv_cache_gb": -2}, "kv_cache_gb", "greater than 0"),
    ({"max_model_len": 0}, "max_model_len", "greater than or equal to 1"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size", "greater than or equal to 1"),
    ({"max_num_seqs": -1}, "max_num_seqs", "greater than or equal to 1"),
    ({"dtype": "fp8"}, "dtype", "'auto', 'bfloat16'"),
    ({"extra_args": ["--max-model-len=9"]}, "extra_args", "marl sets --max-model-len itself: set"
                                                          " vllm.max_model_len instead"),
    ({"extra_args": ["--port", "1"]}, "extra_args", "marl sets --port itself"),
    ({"sleep_between_steps": "sometimes"}, "sleep_between_steps", "'auto'"),
    ({"max_model_lenght": 9}, "max_model_lenght", "did you mean 'max_model_len'"),
])
def test_bad_values_are_refused_at_their_key(section, key, words):
    assert words in problem_at(topology(section), f"servers.speaker_model.vllm.{key}")


def test_the_section_needs_a_local_vllm_server():
    assert "applies to engine: vllm" in problem_at(topology({}, engine="torch"), "servers.speaker_model.vllm")
    assert "engine is torch (the default)" in problem_at(topology({}, engine=None), "servers.speaker_model.vllm")
    # on a remote swarm server, vllm: describes the vLLM there for marl plan (tests/marl/test_placement_spec.py)
    remote = topology({"tensor_parallel_size": 2}, engine=None, device=None, model=None, swarm_url="http://gpu:1")
    assert Topology.from_dict(remote, check_env=False).spec.servers["speaker_model"].vllm.tensor_parallel_size == 2
    past = copy.deepcopy(topology())
    past["servers"]["past"] = {"past_of": {"server": "speaker_model"}, "engine": "vllm", "vllm": {}}
    past["roles"]["listener"]["server"] = "past"
    del past["servers"]["listener_model"]
    assert "served by the torch engine" in problem_at(past, "servers.past.vllm")
    on_cpu = topology({"sleep_between_steps": True}, device="cpu")
    assert "sleep mode needs CUDA" in problem_at(on_cpu, "servers.speaker_model.vllm.sleep_between_steps")
    overlapped = topology({"sleep_between_steps": True}, train={"job": "s", "overlap": True})
    assert "cannot sleep" in problem_at(overlapped, "servers.speaker_model.vllm.sleep_between_steps")


def test_a_bad_value_in_a_file_names_its_line(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(textwrap.dedent("""\
        name: t
        servers:
          a:
            model: smollm2-135m
            engine: vllm
            vllm:
              max_model_len: 4096
              gpu_memory_utilization: 1.5
        roles:
          r: {server: a}
        env: {class: "envs.signalling:SignallingGame"}
        run: {games: 1}
        """))
    with pytest.raises(TopologyError) as info:
        Topology.load(path, check_env=False)
    assert f"{path}:8: servers.a.vllm.gpu_memory_utilization: Input should be less than or equal to 1" \
        in str(info.value)


def test_marl_serve_refuses_bad_flags_naming_them():
    def refused(*flags: str) -> str:
        with pytest.raises(ValueError) as info:
            _serve_options(parse(["serve", "--model", "m", *flags]))
        return str(info.value)

    assert refused("--engine", "vllm", "--vllm-gpu-memory-utilization", "0") \
        .startswith("--vllm-gpu-memory-utilization: must be in (0, 1]")
    assert refused("--engine", "vllm", "--vllm-dtype", "fp8").startswith("--vllm-dtype: unknown dtype 'fp8'")
    assert refused("--engine", "vllm", "--vllm-kv-cache-gb", "-1").startswith("--vllm-kv-cache-gb: must be")
    assert refused("--engine", "vllm", "--vllm-arg=--host=0.0.0.0").startswith("--vllm-arg: '--host=0.0.0.0': marl")
    assert refused("--vllm-max-model-len", "512") == "--vllm-max-model-len: only with --engine vllm (add it, or" \
                                                     " drop them)"
    with pytest.raises(SystemExit):  # not a number: argparse's own message names the flag
        parse(["serve", "--model", "m", "--engine", "vllm", "--vllm-max-num-seqs", "many"])


def test_the_shipped_gpu_topology_sets_vllm():
    spec = Topology.load(REPO / "topologies" / "signalling-gpu.yaml", check_env=False).spec
    for server in spec.servers.values():
        assert server.engine == "vllm" and server.vllm is not None and server.vllm.max_model_len
        # each vLLM replica beside its own trainer rank on the same GPUs (sleep mode frees them for the step)
        assert server.vllm.data_parallel_size == len(server.placement.engine_gpus) == server.train.fsdp.ranks
        assert server.placement.engine_gpus == server.placement.trainer_gpus
    speaker, listener = (set(s.placement.engine_gpus) for s in spec.servers.values())
    assert speaker.isdisjoint(listener) and speaker | listener == set(range(8))  # the whole box
