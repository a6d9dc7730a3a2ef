"""Shared fixtures: tiny models built on the fly, and real swarm servers on 127.0.0.1 on free ports."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import huggingface_hub.constants
import pytest
import torch
from tiny_model import build_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from marl.protocol import TrainConfig
from marl.runner.launch import ServerProcess, free_port
from marl.testing import server_process as testing_server_process
from servers.entrypoint import ServeOptions, build_server, http_server
from servers.http.routes import create_app
from servers.training.lifecycle import TrainerFactory
from tests.servers.recording_vllm import RecordingVLLM

#: Test files that boot vLLM or run marl's own processes (`marl run`, `marl serve` and other `marl` commands as
#: subprocesses, FSDP ranks, Ray, the benches): marked `heavy`, which `make test-fast` (the inner loop) leaves out.
#: `make test` runs everything.
HEAVY_FILES = frozenset({
    "test_backends_run", "test_check_env", "test_cli_mistakes", "test_coordinator", "test_coordinator_shutdown",
    "test_durability", "test_eval", "test_eval_policies", "test_exploitability", "test_first_contact",
    "test_fsdp_lora", "test_fsdp_scale", "test_fsdp_trainer", "test_hub_models", "test_league", "test_learning",
    "test_placement", "test_plan_measured", "test_proxy_cli", "test_ray", "test_ray_placement",
    "test_recompute_logprobs", "test_resume", "test_run", "test_run_policies", "test_benches", "test_soak",
    "test_static_adapter", "test_two_phase", "test_vllm_ray", "test_weight_replicas",
})


#: The longest test files (CI's durations, longest first): they start first. pytest-xdist hands a worker the next
#: file when it is free (--dist loadfile), so a long file left for the end would keep one worker busy while the other
#: idles; longest first leaves short files to even out the end.
LONGEST_FILES = ("test_benches", "test_agent_apis", "test_ray", "test_plan_measured", "test_backends_run", "test_run",
                 "test_vllm_weight_transfer", "test_fsdp_scale", "test_vllm_lora", "test_vllm_engine")


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread per process, for this process and every server and script a test starts (they inherit
    OMP_NUM_THREADS). Two test processes share CI's 2 cores and most tests start servers of their own: with torch's
    default of a thread per core in each process, the threads spin waiting on each other, and a tiny model trains five
    times slower (`build_tool_model` beside a busy process: 190 s on two threads, 37 s on one)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # No test reaches the Hugging Face Hub (tests build their models; tests/fake_hub.py stands in for the Hub): a
    # model id not on this machine fails at once, here and in every process a test starts, rather than after the
    # Hub client's retries (20 s without a network). huggingface_hub read the variable when it was imported.
    os.environ["HF_HUB_OFFLINE"] = "1"
    huggingface_hub.constants.HF_HUB_OFFLINE = True


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if heavy_file(item.path.stem):
            item.add_marker(pytest.mark.heavy)
        # `make test` runs the serial tests of the files that say `mark.serial` (its SERIAL_FILES): a mark given any
        # other way would drop out of CI unseen
        if item.get_closest_marker("serial") and "mark.serial" not in item.path.read_text():
            raise pytest.UsageError(f"{item.nodeid} is serial, but its file never says mark.serial: the Makefile's"
                                    " SERIAL_FILES would leave it out")
    first = {stem: rank for rank, stem in enumerate(LONGEST_FILES)}
    # a stable sort: each file's tests stay together and in their order; then the other heavy files, then the rest
    items.sort(key=lambda item: first.get(item.path.stem, len(first) + (not heavy_file(item.path.stem))))


def heavy_file(stem: str) -> bool:
    return stem in HEAVY_FILES or "vllm" in stem

ADMIN = "-test-admin-token"  # a leading dash: a token must never be read as a command-line option


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny model of the test module's own (a module that needs another one, e.g. vLLM's head size, defines its
    own `model_dir`, which takes precedence)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def base(model_dir):
    """The plain model in fp32: a LoRA policy's logprobs before its first step (PEFT starts B at 0)."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class LocalServer:
    """A swarm server running in this process (uvicorn in a thread), for tests that look inside it.

    Built like `marl serve` builds it (`servers.entrypoint.build_server`), serving "tiny" on the CPU. `.server` is the
    server object (`TrainableServer`, or `StaticServer` with `static=True`), `.data_dir` its data dir.
    `trainer_factory` replaces the default trainer factory (`(model_dir, TrainConfig) -> Trainer`), e.g. to wrap
    the real trainer with `servers.entrypoint.default_trainer_factory("cpu")`.
    """

    def __init__(self, model: Path, data_dir: Path, *, static: bool = False, port: int | None = None,
                 trainer_factory: TrainerFactory | None = None, policies: dict | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = data_dir
        options = ServeOptions(model=str(model), port=self.port, admin_token=ADMIN, data_dir=data_dir, static=static,
                               served_model_name="tiny", device="cpu", policies=policies or {})
        self.server, token = build_server(options, trainer_factory=trainer_factory)
        self._uvicorn = http_server(create_app(self.server, token), "127.0.0.1", self.port, "warning")
        self._thread = threading.Thread(target=self._uvicorn.run, daemon=True)

    def __enter__(self) -> LocalServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=15)


@pytest.fixture
def local_server(tiny_model, tmp_path):
    """Factory: `with local_server() as srv:` starts a fresh server on its own data dir."""

    def make(static: bool = False, data_dir: Path | None = None, port: int | None = None,
             trainer_factory: TrainerFactory | None = None, policies: dict | None = None) -> LocalServer:
        return LocalServer(tiny_model, data_dir or tmp_path / "server", static=static, port=port,
                           trainer_factory=trainer_factory, policies=policies)

    return make


def admin_http(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)


def start_rolling(http: httpx.Client, **config) -> None:
    """Sync a config and start the engine; return once ROLLING."""
    r = http.post("/control/config", json=TrainConfig(**config).model_dump(mode="json"))
    assert r.status_code == 200, r.text
    r = http.post("/control/start")
    assert r.status_code == 200, r.text
    wait_state(http, "ROLLING")


@pytest.fixture(scope="module")
def rolling(tiny_model, tmp_path_factory):
    """One trainable server for the module, ROLLING, with a batch too big to fill (no training interferes):
    (server, admin client)."""
    with LocalServer(tiny_model, tmp_path_factory.mktemp("rolling") / "server") as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=1000, num_repeat=4, lease_patience_s=120)
        yield srv, http


def wait_state(http: httpx.Client, *states: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = http.get("/control/status").json()
        if status["state"] in states:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"server stayed {status['state']} (wanted {states}): {status.get('last_error')}")
        time.sleep(0.05)


def begin_lease(http: httpx.Client, client_id: str = "c", timeout: float = 60) -> dict:
    """A new lease; a 503 (every slot taken, e.g. by a lease that another client is still ending) is waited out, as
    `SwarmClient` does, until `timeout`."""
    deadline = time.monotonic() + timeout
    while (r := http.post("/episodes/begin", json={"client_id": client_id})).status_code == 503:
        assert time.monotonic() < deadline, f"no free slot for {timeout} s: {r.text}"
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    return r.json()


def play_episode(http: httpx.Client, task_id: str, reward: float, client_id: str = "c") -> str:
    """One leased episode with one chat call, ended with `reward`; returns its id."""
    import openai

    lease = begin_lease(http, client_id)
    client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"])
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"task {task_id}"}],
                                   max_tokens=4)
    r = http.post(f"/episodes/{lease['episode_id']}/end",
                  json={"client_id": client_id, "task_id": task_id, "reward": reward})
    assert r.status_code == 200, r.text
    return lease["episode_id"]


def wait_version(http: httpx.Client, version: int, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = wait_state(http, "ROLLING", timeout=timeout)
        if status["policy_version"] >= version:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"policy version stayed {status['policy_version']} (wanted {version})")
        time.sleep(0.05)


@contextlib.contextmanager
def server_process(model: Path, data_dir: Path, *, static: bool = False) -> Iterator[tuple[ServerProcess, str]]:
    """`marl serve` as a real subprocess (for crash tests), on `marl.testing.server_process`; yields (process, url).
    `process.kill()` is SIGKILL, and what is still running at the end is killed too (no graceful stop)."""
    with testing_server_process(model, data_dir, static=static, admin_token=ADMIN, timeout=60,
                                log_path=data_dir.parent / f"server-{data_dir.name}.log") as proc:
        try:
            yield proc, proc.url
        finally:
            proc.kill()


def trainable(name: str, url: str, **config):
    """A coordinator `Endpoint` for the trainable server at `url`, its config synced and its engine started."""
    from marl import SwarmClient
    from marl.protocol import TrainConfig
    from marl.runner.endpoints import TrainableEndpoint

    train = TrainConfig.model_validate({"batch_size": 2, "num_repeat": 2, "save_freq": 0, **config})
    client = SwarmClient(url, admin_token=ADMIN)
    client.auto_sync_train_config_and_start_engine(train)
    return TrainableEndpoint(name, client=client, train_config=train)


def ledger_samples(data_dir: Path, columns: str = "e.episode_id, e.task_id, s.agent, s.reward") -> list[tuple]:
    """`columns` of every sample in a server's ledger, joined with its episode (`e.`) row."""
    import sqlite3

    db = sqlite3.connect(data_dir / "ledger.sqlite")
    try:
        return db.execute(f"SELECT {columns} FROM episodes e JOIN samples s USING (episode_id)").fetchall()
    finally:
        db.close()


@pytest.fixture
def recording() -> Iterator[Callable[..., RecordingVLLM]]:
    """`recording(failing=(path, ...), answers={path: [json, ...]})` starts a stand-in for vLLM's HTTP server
    (tests/servers/recording_vllm.py)."""
    servers = []

    def start(failing: tuple[str, ...] = (), answers: dict[str, list[object]] | None = None) -> RecordingVLLM:
        server = RecordingVLLM(failing, answers)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
