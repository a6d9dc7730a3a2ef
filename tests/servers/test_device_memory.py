"""A trainer's cached device memory goes back to the driver before vLLM wakes on the same GPU: every FSDP rank empties
its allocator's cache at the end of every command, before it answers, and the server's train loop asks the trainer to
release its memory after the step and before it wakes the engine's weights, then its KV cache. CUDA's allocator is
not here: the order is checked on recording stand-ins (the rank's free, vLLM's HTTP routes)."""

from __future__ import annotations

import json
import threading
import time
from multiprocessing import Pipe
from pathlib import Path

import pytest
from conftest import ADMIN
from stubs import StubBackends, StubEngine, StubTrainer, load_tokenizer, stub_server

from marl import SwarmClient
from servers.engines.vllm_http import sleep_for_training, sync_weights_waking
from servers.trainers import fsdp_worker
from servers.trainers.device_memory import DeviceMemory, MemoryRelease, free_cached_memory, memory_metrics

pytestmark = pytest.mark.timeout(120)


class _Commands:
    """A rank's policy that records its commands into `events` (as the free does)."""

    device = "cpu"

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def commands(self):
        return {"train": lambda *args: self.events.append("train") or "trained",
                "export": lambda path: self.events.append("export") or None}


def test_a_rank_frees_its_cache_after_every_command_before_it_answers(monkeypatch):
    events: list[str] = []
    release = MemoryRelease(DeviceMemory(allocated=3, reserved=9), DeviceMemory(allocated=3, reserved=4))

    def free(device):
        events.append("free")
        return release

    monkeypatch.setattr(fsdp_worker, "free_cached_memory", free)
    server, rank = Pipe()
    serving = threading.Thread(target=fsdp_worker._serve, args=(_Commands(events), rank), daemon=True)
    serving.start()
    for command, args in [("train", ("plan",)), ("export", ("dir",)), ("memory", ())]:
        server.send((command, args))
        answer = server.recv()
        events.append(f"answered {command}")
        assert answer[0] == "ok"
    server.send(("close", ()))
    serving.join(10)
    assert events == ["free", "train", "free", "answered train", "export", "free", "answered export",
                      "answered memory"]
    assert answer[1] == release  # "memory": the last command's reading, before and after the release


def test_the_memory_metrics_are_the_largest_rank_in_gigabytes_and_none_on_the_cpu():
    ranks = [MemoryRelease(DeviceMemory(2e9, 8e9), DeviceMemory(2e9, 2.5e9)),
             MemoryRelease(DeviceMemory(3e9, 6e9), DeviceMemory(3e9, 3.5e9))]
    assert memory_metrics(ranks) == pytest.approx(
        {"device_allocated_gb": 3.0, "device_reserved_gb": 8.0, "device_reserved_freed_gb": 3.5})
    assert memory_metrics([free_cached_memory("cpu")]) == {}  # no CUDA: nothing to report, nothing collected


class _SleepingEngine(StubEngine):
    """The stub engine with the vLLM engine's sleep-mode calls, made to a recording stand-in of vLLM."""

    takes_tensors = False

    def __init__(self, tokenizer, url: str) -> None:
        super().__init__(tokenizer)
        self.url = url

    def before_training_step(self) -> None:
        sleep_for_training(self.url)

    def load_weights_from(self, directory: Path) -> None:
        sync_weights_waking(self.url, directory)


class _ReleasingTrainer(StubTrainer):
    def __init__(self, config, gate, calls: list) -> None:
        super().__init__(config, gate)
        self.calls = calls

    def release_memory(self) -> dict[str, float]:
        self.calls.append(("release", [], None))  # in the stand-in's record, between its requests
        return {"device_reserved_gb": 1.5}


def test_the_step_releases_memory_before_the_weights_then_the_kv_cache_wake(tiny_model, tmp_path, recording,
                                                                            monkeypatch):
    vllm = recording()
    monkeypatch.setattr(StubBackends, "engine", lambda self, model_dir: _SleepingEngine(load_tokenizer(model_dir),
                                                                                        vllm.url))
    monkeypatch.setattr(StubBackends, "trainer",
                        lambda self, model_dir, config: _ReleasingTrainer(config, self.step_gate, vllm.calls))
    with stub_server(tiny_model, tmp_path / "server") as srv, SwarmClient(srv.url, ADMIN, timeout=30) as client:
        client.auto_sync_train_config_and_start_engine({"batch_size": 1, "num_repeat": 1, "save_freq": 0},
                                                        timeout=60)
        with client.episode("task") as episode:
            episode.openai().chat.completions.create(model=episode.model, max_tokens=2,
                                                     messages=[{"role": "user", "content": "hi"}])
            episode.reward = 1.0
        deadline = time.monotonic() + 60
        while client.status().policy_version < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    # the weights reload, then the workers' free memory is asked (marl_wake_memory) before the KV cache wakes
    assert vllm.paths() == ["/sleep?level=1&mode=wait", "release", "/wake_up?tags=weights", "/collective_rpc",
                            "/collective_rpc", "/wake_up?tags=kv_cache"]
    assert vllm.bodies()[4]["method"] == "marl_wake_memory"
    (record,) = [json.loads(line) for line in (tmp_path / "server" / "metrics.jsonl").read_text().splitlines()]
    assert record["device_reserved_gb"] == 1.5  # the trainer's release, in the step's metrics
