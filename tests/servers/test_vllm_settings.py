"""vLLM's settings on its command line, their validation, and the sleep-mode weight sync's HTTP calls.

No vLLM runs here: the command line is built and read, and the weight sync's calls go to a small HTTP server on
127.0.0.1 that records them and can fail any route (sleep mode is CUDA-only: the CPU build takes these calls but
skips the sleep itself). tests/servers/test_vllm_engine.py boots the CPU build with settings from `marl serve` flags
and sends it the sleep-mode calls.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from servers.engines import vllm_http
from servers.engines.vllm_engine import _served_context
from servers.engines.vllm_http import (
    VLLMWakeRefused,
    after_transfer,
    sleep_for_training,
    sync_weights,
    sync_weights_waking,
)
from servers.engines.vllm_process import (
    ENTRY_MODULE,
    VLLM_DTYPES,
    VLLM_MANAGED_FLAGS,
    VLLMLaunch,
    VLLMSettings,
    VLLMSettingsError,
)
from servers.engines.wake_memory import wake_problem

PYTHON = Path(sys.executable)  # any existing python: the command line is only built
ALL_SET = VLLMSettings(max_model_len=4096, gpu_memory_utilization=0.3, kv_cache_gb=2.5, tensor_parallel_size=2,
                       data_parallel_size=4, dtype="float16", max_num_seqs=64, sleep_between_steps=True,
                       extra_args=("--swap-space=8", "--enable-chunked-prefill"))


def vllm_argv(launch: VLLMLaunch) -> list[str]:
    """vLLM's own arguments: what follows `-m MODULE` (before it is the parent-death wrapper)."""
    cmd = launch.command(port=8123)
    return cmd[cmd.index("-m") + 2:]


def option(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


# ------------------------------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------------------------------


def test_every_setting_reaches_the_command_line():
    launch = VLLMLaunch(Path("/models/m"), 4096, device="cuda", settings=ALL_SET, python=PYTHON)
    cmd = launch.command(port=8123)
    assert cmd[cmd.index("-m") + 1] == ENTRY_MODULE == "vllm.entrypoints.launchers.api_server.entry"
    argv = vllm_argv(launch)
    expected = {"--model": "/models/m", "--host": "127.0.0.1", "--port": "8123", "--max-model-len": "4096",
                "--gpu-memory-utilization": "0.3", "--kv-cache-memory-bytes": str(int(2.5 * 2**30)),
                "--tensor-parallel-size": "2", "--dtype": "float16",
                "--data-parallel-size": "1",  # data_parallel_size 4 is 4 vLLM processes (servers.engines.vllm_replicas)
                "--max-num-seqs": "64"}
    assert {flag: option(argv, flag) for flag in expected} == expected
    assert "--enable-sleep-mode" in argv
    assert argv[-2:] == ["--swap-space=8", "--enable-chunked-prefill"]  # appended as they are, last
    assert "--enforce-eager" not in argv  # a CPU flag


def test_cuda_defaults_leave_the_trainer_room():
    def defaults(shares_gpu: bool) -> list[str]:
        return vllm_argv(VLLMLaunch(Path("m"), 2048, device="cuda", shares_gpu=shares_gpu, python=PYTHON))

    trainable, static = defaults(shares_gpu=True), defaults(shares_gpu=False)
    assert option(trainable, "--gpu-memory-utilization") == "0.5"  # half the GPU: the trainer's rank 0 shares it
    assert option(static, "--gpu-memory-utilization") == "0.9"
    for argv in (trainable, static):
        assert option(argv, "--dtype") == "bfloat16"
        assert "--kv-cache-memory-bytes" not in argv  # sized by vLLM from the utilization
        assert option(argv, "--max-model-len") == "2048"
    assert "--enable-sleep-mode" in trainable and "--enable-sleep-mode" not in static  # auto


def test_cpu_defaults_and_budgets():
    argv = vllm_argv(VLLMLaunch(Path("m"), 2048, device="cpu", python=PYTHON))
    assert option(argv, "--dtype") == "float32" and "--enforce-eager" in argv and option(argv, "--block-size") == "32"
    assert option(argv, "--kv-cache-memory-bytes") == str(2**30)  # 1 GiB
    assert "--gpu-memory-utilization" not in argv and "--enable-sleep-mode" not in argv
    assert "--enable-sleep-mode" not in vllm_argv(VLLMLaunch(Path("m"), 2048, device="cpu", shares_gpu=True,
                                                             python=PYTHON))
    # a utilization alone: vLLM sizes the KV cache from it (on the CPU build, a share of host memory)
    utilization_only = vllm_argv(VLLMLaunch(Path("m"), 2048, settings=VLLMSettings(gpu_memory_utilization=0.2),
                                            python=PYTHON))
    assert option(utilization_only, "--gpu-memory-utilization") == "0.2"
    assert "--kv-cache-memory-bytes" not in utilization_only
    # both: the KV budget sizes the cache; the utilization is still passed (vLLM's start-up check)
    both = vllm_argv(VLLMLaunch(Path("m"), 2048, device="cuda", python=PYTHON,
                                settings=VLLMSettings(kv_cache_gb=0.25, gpu_memory_utilization=0.2)))
    assert option(both, "--kv-cache-memory-bytes") == str(2**28) and option(both, "--gpu-memory-utilization") == "0.2"


def test_the_cpu_builds_legacy_kv_variable_cannot_override_the_setting(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    env = VLLMLaunch(Path("m"), 2048, python=PYTHON).environment()
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["VLLM_SERVER_DEV_MODE"] == "1"


def test_sleep_mode_is_cuda_only_and_auto_follows_the_trainer():
    with pytest.raises(VLLMSettingsError, match="sleep_between_steps: sleep mode is CUDA-only"):
        VLLMLaunch(Path("m"), 2048, device="cpu", settings=VLLMSettings(sleep_between_steps=True))
    assert not VLLMLaunch(Path("m"), 2048, device="cpu", settings=VLLMSettings(sleep_between_steps=False),
                          shares_gpu=True).sleeps_between_steps
    assert not VLLMLaunch(Path("m"), 2048, device="cuda", settings=VLLMSettings(sleep_between_steps=False),
                          shares_gpu=True).sleeps_between_steps
    assert VLLMLaunch(Path("m"), 2048, device="cuda", settings=VLLMSettings(sleep_between_steps=True),
                      shares_gpu=False).sleeps_between_steps
    assert VLLMLaunch(Path("m"), 2048, device="cuda", shares_gpu=True).sleeps_between_steps


def test_max_model_len_is_capped_to_the_models_context():
    assert _served_context(32768, None) == 32768
    assert _served_context(32768, 8192) == 8192
    assert _served_context(2048, 8192) == 2048


# ------------------------------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("values", "setting", "words"), [
    ({"max_model_len": 0}, "max_model_len", "whole number >= 1"),
    ({"max_model_len": 1.5}, "max_model_len", "whole number >= 1"),
    ({"tensor_parallel_size": -1}, "tensor_parallel_size", "whole number >= 1"),
    ({"data_parallel_size": 0}, "data_parallel_size", "whole number >= 1"),
    ({"max_num_seqs": 0}, "max_num_seqs", "whole number >= 1"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization", "must be in (0, 1]"),
    ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization", "must be in (0, 1]"),
    ({"kv_cache_gb": -1}, "kv_cache_gb", "number of GB > 0"),
    ({"kv_cache_gb": 0}, "kv_cache_gb", "number of GB > 0"),
    ({"dtype": "fp8"}, "dtype", "unknown dtype 'fp8'"),
    ({"extra_args": ["--max_model_len=9"]}, "extra_args", "marl sets --max-model-len itself: set max_model_len"),
    ({"extra_args": ["--port", "9"]}, "extra_args", "marl sets --port itself"),
    ({"extra_args": ["-tp=2"]}, "extra_args", "set tensor_parallel_size instead"),
])
def test_bad_settings_are_refused_naming_the_setting(values, setting, words):
    with pytest.raises(VLLMSettingsError) as info:
        VLLMSettings(**values)
    ((name, message),) = info.value.problems
    assert name == setting and words in message
    assert str(info.value).startswith(f"vllm.{setting}: ")


def test_the_topology_refuses_what_the_server_refuses():
    """The topology's spec and `marl serve` check against the same two tables, defined once in the protocol."""
    from marl.topology import spec
    assert spec.VLLM_DTYPES is VLLM_DTYPES
    assert spec.VLLM_MANAGED_FLAGS is VLLM_MANAGED_FLAGS


# ------------------------------------------------------------------------------------------------------------------
# the weight sync's HTTP calls, against a real HTTP server that records them
# ------------------------------------------------------------------------------------------------------------------




def reload_call(weights: Path) -> tuple[str, list, dict]:
    return "/collective_rpc", [], {"method": "marl_reload_weights", "kwargs": {"weights_path": str(weights)}}


def test_the_awake_weight_sync_pauses_reloads_resets_and_resumes(recording, tmp_path):
    vllm = recording()
    sync_weights(vllm.url, tmp_path)
    assert vllm.paths() == ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    assert vllm.calls[1] == reload_call(tmp_path)


def test_sleep_mode_sleeps_then_wakes_weights_syncs_and_wakes_the_kv_cache(recording, tmp_path):
    vllm = recording()
    sleep_for_training(vllm.url)
    sync_weights_waking(vllm.url, tmp_path)
    assert vllm.paths() == ["/sleep?level=1&mode=wait", "/wake_up?tags=weights", "/collective_rpc",
                            "/collective_rpc", "/wake_up?tags=kv_cache"]
    assert vllm.calls[2] == reload_call(tmp_path)
    assert vllm.calls[3][2] == {"method": "marl_wake_memory"}  # the room for the KV cache, asked before its wake


GIB = 2**30


def reading(gpu: int, free_gib: float, kv_gib: float, holders: list | None = None) -> dict:
    """What `WeightReload.marl_wake_memory` answers for one worker."""
    return {"gpu": gpu, "free_bytes": int(free_gib * GIB), "kv_cache_bytes": int(kv_gib * GIB),
            "holders": holders or []}


def test_the_kv_cache_wakes_only_where_it_fits_and_a_short_gpu_is_named_with_what_holds_it():
    assert wake_problem([reading(0, 41.0, 40.0), reading(1, 50.0, 40.0)], "vllm.gpu_memory_utilization") is None
    assert wake_problem([{"gpu": None, "free_bytes": None, "kv_cache_bytes": 0}], "x") is None  # the CPU build
    problem = wake_problem([reading(0, 41.0, 40.0), reading(3, 30.0, 40.0, [{"pid": 71, "bytes": 31 * GIB},
                                                                             {"pid": 70, "bytes": 16 * GIB}])],
                           "vllm.kv_cache_gb")
    assert problem == ("vLLM's KV cache would not fit when it wakes (GPU 3: 30.00 GiB free, the KV cache needs 40.00"
                       " GiB (+0.25 GiB); held by pid 71 31.00 GiB, pid 70 16.00 GiB): lower vllm.kv_cache_gb (vLLM's"
                       " share of each GPU, sized at start), or what the trainer keeps on those GPUs between steps")
    assert "\n" not in problem and wake_problem([reading(0, 40.1, 40.0)], "x") is not None  # within the margin


@pytest.mark.parametrize("pushed", [False, True])
def test_a_kv_cache_that_would_not_fit_is_not_woken(recording, tmp_path, pushed):
    """Neither the KV cache's wake nor the catch-all wake of a failed sync: either would kill vLLM's engine core."""
    short = {"results": [reading(0, 10.0, 40.0, [{"pid": 9, "bytes": 60 * GIB}])]}
    vllm = recording(answers={"/collective_rpc": [{}, short]} if not pushed else {"/collective_rpc": [short]})
    with pytest.raises(VLLMWakeRefused, match="GPU 0: 10.00 GiB free.*pid 9 60.00 GiB.*lower vllm.kv_cache_gb"):
        if pushed:
            after_transfer(vllm.url, asleep=True, kv_setting="vllm.kv_cache_gb")
        else:
            sync_weights_waking(vllm.url, tmp_path, kv_setting="vllm.kv_cache_gb")
    assert not [path for path in vllm.paths() if path.startswith("/wake_up") and path != "/wake_up?tags=weights"]


def test_a_failed_reload_after_sleep_wakes_everything_and_raises(recording, tmp_path):
    vllm = recording(failing=("/collective_rpc",))
    with pytest.raises(RuntimeError, match="vLLM /collective_rpc answered 500"):
        sync_weights_waking(vllm.url, tmp_path)
    assert vllm.paths() == ["/wake_up?tags=weights", "/collective_rpc", "/wake_up"]


def test_a_refused_sleep_raises(recording):
    vllm = recording(failing=("/sleep",))
    with pytest.raises(RuntimeError, match="vLLM /sleep answered 500"):
        sleep_for_training(vllm.url)


def test_a_prefix_cache_reset_that_did_not_happen_is_tried_again(recording, tmp_path, monkeypatch):
    """vLLM 0.32/0.33 answer 200 `{"success": false}` while blocks are still held: tried again, then done."""
    monkeypatch.setattr(vllm_http, "RESET_WAIT_S", 0.0)
    vllm = recording(answers={"/reset_prefix_cache": [{"success": False}, {"success": False}, {"success": True}]})
    sync_weights(vllm.url, tmp_path)
    assert vllm.paths() == ["/pause?mode=wait", "/collective_rpc", *["/reset_prefix_cache"] * 3, "/resume"]


def test_a_prefix_cache_that_never_empties_fails_the_sync_and_vllm_resumes(recording, tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_http, "RESET_WAIT_S", 0.0)
    monkeypatch.setattr(vllm_http, "RESET_TRIES", 3)
    vllm = recording(answers={"/reset_prefix_cache": [{"success": False}]})
    with pytest.raises(RuntimeError, match="did not empty its prefix cache .* old weights"):
        sync_weights(vllm.url, tmp_path)
    assert vllm.paths() == ["/pause?mode=wait", "/collective_rpc", *["/reset_prefix_cache"] * 3, "/resume"]


def test_the_setting_a_short_wake_names_is_the_one_that_sized_the_kv_cache():
    assert VLLMLaunch(Path("m"), 64, device="cuda", python=PYTHON).kv_setting == "vllm.gpu_memory_utilization"
    sized = VLLMLaunch(Path("m"), 64, device="cuda", python=PYTHON, settings=VLLMSettings(kv_cache_gb=4.0))
    assert sized.kv_setting == "vllm.kv_cache_gb"
