"""Local `marl serve` processes: start them on free local ports, restart those that die (`Supervisor`), stop them.

Used by `marl run` and the tests.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from marl.protocol import LoraSpec, gpu_list_text
from marl.topology.spec import PlacementSpec, VLLMSpec

#: glibc malloc settings for server processes (the environment overrides them): few arenas, so the tensors that the
#: engine, trainer and HTTP threads free go back to one pool instead of staying resident per thread.
_ALLOCATOR_ENV = {"MALLOC_ARENA_MAX": "2"}

#: written by `marl run` into its run directory: where its local servers listen (and their admin token)
SERVERS_FILE = "servers.json"
#: deaths of one local server that `Supervisor` repairs before it gives up
MAX_RESTARTS = 3

log = logging.getLogger("marl.runner.launch")


class ServerStartError(RuntimeError):
    """A local server that did not come up: the message says which, why (its log's last error line) and where its
    log is. `marl run` prints it as one line and exits 1."""


#: a log line that says what went wrong: `marl serve: error: ...` (a bad flag, model or port), a traceback's last
#: line, "[Errno 98] ...", an ERROR record
_ERROR_LINE = re.compile(r"^(marl serve: error: |\w+(\.\w+)*(Error|Exception)\b|.*\[Errno \d+\]|.* (ERROR|CRITICAL) )")


def last_error_line(log_path: Path, since: int = 0, tail_bytes: int = 64_000) -> str | None:
    """The last line of the log at `log_path`, after its first `since` bytes (what earlier processes wrote to it),
    that says what went wrong; None: no such line, or no log."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(since, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    found = next((line.strip() for line in reversed(lines) if _ERROR_LINE.match(line.strip())), None)
    return None if found is None else found[:400]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def threads_per_server(servers: int) -> dict[str, str]:
    """The environment that splits this machine's cores between `servers` local server processes, as torchrun and Ray
    do: torch gives every process a CPU thread per core, and processes computing at once on shared cores then spin
    waiting for each other's threads (`bench/cpu_threads.py` compares the two on a topology). Empty for one server, or
    when the user set OMP_NUM_THREADS: theirs holds."""
    if servers < 2 or "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, usable_cores() // servers))}


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS has one (Linux), else every core (macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on `host`:`port` already (binding it as `marl serve` would fails so)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


# Looked up before any fork: the child of a threaded process must not load libraries.
_PRCTL = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None) if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Run in the child before exec (Linux): SIGKILL it when the thread that started it dies, however it dies."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(frozen=True)
class RayGroup:
    """A server's Ray placement group as its `marl serve` joins it (--ray-group, --ray-address, --no-ray-ranks): the
    group's name, the cluster's GCS address, and whether the trainer's ranks are in it (else only vLLM replicas)."""

    name: str
    address: str
    ranks: bool = True

    def flags(self) -> list[str]:
        return ["--ray-group", self.name, "--ray-address", self.address] + ([] if self.ranks else ["--no-ray-ranks"])


class ServerProcess:
    """One `marl serve` subprocess; its output goes to `log_path`.

    `host`: the interface it listens on (default: loopback only). `vllm`: a topology server's `vllm:` section, passed
    as `--vllm-*` flags; `placement` as --engine-gpus, --trainer-gpus; `ray_group`: the server's Ray placement
    group, where its trainer's ranks and vLLM's replicas after the first go (`RayGroup`);
    `adapter` (with `static`): a PEFT adapter directory served on `model`; `revision`: the branch, tag or commit of a
    `model` given by its Hugging Face id. `engine`: torch, vllm or simulated
    (benchmarks; `simulated_speed` then runs its delays that many times faster). `environment`: more variables for it
    (a Ray actor's CUDA_VISIBLE_DEVICES). `die_with_parent`: on Linux, the server is killed when the thread that
    started it dies (a Ray actor's, marl/runner/ray_cluster.py: a restarted actor must never find the
    old server still on its data dir); that thread must live as long as the server.
    """

    def __init__(self, *, model: str, admin_token: str, data_dir: Path, log_path: Path, static: bool = False,
                 device: str | None = None, served_name: str | None = None, port: int | None = None,
                 prefix_cache_gb: float | None = None, engine: str = "torch", vllm: VLLMSpec | None = None,
                 placement: PlacementSpec | None = None, host: str = "127.0.0.1", die_with_parent: bool = False,
                 environment: Mapping[str, str] | None = None, policies: Mapping[str, LoraSpec] | None = None,
                 adapter: Path | None = None, simulated_speed: float | None = None,
                 ray_group: RayGroup | None = None, revision: str | None = None):
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path
        # The token goes by environment, not argv: argv is readable by every user (`ps`), and a token that
        # starts with "-" would read as an option.
        self.admin_token = admin_token
        self.args = [sys.executable, "-m", "marl.cli", "serve", "--model", model, "--port", str(self.port),
                     "--data-dir", str(data_dir), "--log-level", "warning"]
        if revision is not None:  # a Hugging Face id's branch, tag or commit
            self.args += ["--revision", revision]
        if static:
            self.args.append("--static")
        if adapter is not None:  # a LoRA policy's snapshot: `model` is its base model
            self.args += ["--adapter", str(adapter)]
        if device:
            self.args += ["--device", device]
        if served_name:
            self.args += ["--served-model-name", served_name]
        if prefix_cache_gb is not None:
            self.args += ["--prefix-cache-gb", str(prefix_cache_gb)]
        if engine != "torch":
            self.args += ["--engine", engine]
        if simulated_speed is not None:  # engine "simulated" (benchmarks): its delays this many times faster
            self.args += ["--simulated-speed", str(simulated_speed)]
        if vllm is not None:
            self.args += vllm_flags(vllm)
        if placement is not None:
            self.args += placement_flags(placement)
        if ray_group is not None:  # its trainer's ranks and vLLM's replicas after the first are Ray actors there
            self.args += ray_group.flags()
        for name, lora in (policies or {}).items():
            self.args += ["--policy", f"{name}={lora.model_dump_json()}"]
        self.extra_environment = dict(environment or {})
        if host != "127.0.0.1":
            self.args += ["--host", host]
        self.die_with_parent = die_with_parent and _PRCTL is not None
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.log_start = 0  # the log's size when this server last started

    def exit_code(self) -> int | None:
        """None while the process runs (or was never started); its exit code once it has exited."""
        return None if self.proc is None else self.proc.poll()

    def describe_exit(self) -> str:
        code = self.exit_code()
        if code is None:
            return "running"
        if code < 0:
            name = signal.Signals(-code).name
            why = " (the kernel's out-of-memory killer sends this; see dmesg)" if code == -signal.SIGKILL else ""
            return f"killed by {name}{why}"
        return f"exited with code {code}"

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.log_start = log.tell()  # this start's lines begin here (a restart appends to the same log)
            # Own process group: Ctrl-C in the terminal reaches `marl run`, which then stops servers in order.
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=self.environment(),
                                         preexec_fn=_die_with_parent if self.die_with_parent else None)
        return self

    def environment(self) -> dict[str, str]:
        """The server's environment: ours, with its admin token and `environment`."""
        return {**_ALLOCATOR_ENV, **os.environ, "PYTHONUNBUFFERED": "1", "MARL_ADMIN_TOKEN": self.admin_token,
                **self.extra_environment}

    def wait_healthy(self, timeout: float = 120) -> None:
        """Return once the server answers /health; `ServerStartError` naming the cause if it exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                why = last_error_line(self.log_path, since=self.log_start)
                raise ServerStartError(f"the server on port {self.port} {self.describe_exit()} while starting"
                                       + (f": {why}" if why else "") + f" (log: {self.log_path})")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise ServerStartError(f"the server on port {self.port} did not answer /health within {timeout:g}s"
                               f" (log: {self.log_path})")

    def kill(self) -> None:
        """SIGKILL (crash tests)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 20) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def vllm_flags(vllm: VLLMSpec) -> list[str]:
    """A topology server's `vllm:` section as `marl serve` flags: `--vllm-KEY VALUE` for each key set to other than
    its default, `--vllm-arg=ARG` for each extra argument (with `=`: an argument may start with '-')."""
    flags = []
    for key, value in vllm.model_dump(exclude_defaults=True, exclude={"extra_args"}).items():
        flags += [f"--vllm-{key.replace('_', '-')}", str(value).lower() if isinstance(value, bool) else str(value)]
    return flags + [f"--vllm-arg={arg}" for arg in vllm.extra_args]


def placement_flags(placement: PlacementSpec) -> list[str]:
    """A topology server's `placement:` as `marl serve` flags (gpu_memory_gb is `marl plan`'s alone)."""
    flags = []
    if placement.engine_gpus is not None:
        flags += ["--engine-gpus", gpu_list_text(placement.engine_gpus)]
    if placement.trainer_gpus is not None:
        flags += ["--trainer-gpus", gpu_list_text(placement.trainer_gpus)]
    return flags  # placement.nodes: Ray places the ranks (run.ray: marl/topology/bundles.py), not the server


class ServerWatch:
    """A thread that calls `check()` every `poll_s` seconds until `close()`; `fatal` is set by a subclass once the
    servers it watches can no longer be kept running. `Supervisor` (local processes) and
    `marl.runner.ray_cluster.RaySupervisor` (Ray actors) share it: `marl run` treats both alike."""

    def __init__(self, *, name: str, poll_s: float):
        self.poll_s = poll_s
        self.fatal: str | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)

    def start(self) -> ServerWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.poll_s)

    def check(self) -> None:
        raise NotImplementedError

    def _watch(self) -> None:
        while not self._closed.wait(self.poll_s):
            self.check()


class Supervisor(ServerWatch):
    """Restarts a local server that died, on its port and data dir: it resumes from its ledger and checkpoints (and
    whoever watches its status, the run's `ServerMonitor`, then syncs its config and starts its engine again).

    After `MAX_RESTARTS` deaths of one server it gives up: `fatal` says which server, how it died and where its log is.
    `report(message)` tells the user about every death.
    """

    def __init__(self, processes: Mapping[str, ServerProcess], *, report: Callable[[str], None],
                 poll_s: float = 1.0):
        super().__init__(name="supervisor", poll_s=poll_s)
        self.processes, self.report = processes, report

    def check(self) -> None:
        """Restart every server that died since the last check (one pass)."""
        for name, proc in self.processes.items():
            if proc.exit_code() is None or self.fatal:
                continue
            what = proc.describe_exit()
            if proc.restarts >= MAX_RESTARTS:
                self.fatal = f"local server {name} {what}, {proc.restarts + 1} times; see {proc.log_path}"
                continue
            proc.restarts += 1
            self.report(f"local server {name} {what}; restarting it ({proc.restarts}/{MAX_RESTARTS}),"
                        f" log: {proc.log_path}")
            log.warning("local server %s %s; restarting it (%d/%d)", name, what, proc.restarts, MAX_RESTARTS)
            proc.start()
