"""The real swarm server app over stub backends, in this process: client tests that run the real protocol in
milliseconds.

`stub_server(model_dir, data_dir)` serves `servers.entrypoint.build_app(...)` (the app `marl serve` runs) on 127.0.0.1
on a free port, with a `StubEngine` (a real tokenizer and chat template, fixed reply tokens with logprobs, no model) and
a `StubTrainer` (returns metrics at once, checkpoints a small file). `StubBackends` holds the knobs a test turns:
hold the boot in BOOTING, make it fail, hold a training step in WEIGHT_SYNCING, slow generation down. `RequestLog`
records what the server received; `recorded_episodes` reads what it stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from conftest import ADMIN

from marl.protocol import TrainConfig
from marl.runner.launch import free_port
from servers.backends import GenerationChunk, InferenceEngine, SamplingParams, TrainBatch, Trainer
from servers.entrypoint import ServeOptions, build_app

SERVED_NAME = "tiny"
REPLY_TEXT = "yes"  # what every generation says (then the end-of-sequence token)
REPLY_LOGPROB = -0.5
GATE_LIMIT_S = 60.0  # a gate left closed fails the boot or the step instead of hanging the test run


@functools.cache
def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class StubEngine(InferenceEngine):
    """Generates `REPLY_TEXT` then end-of-sequence for every prompt (cut at max_tokens); `token_delay_s` slows it."""

    def __init__(self, tokenizer: Any, *, token_delay_s: float = 0.0, generate_gate: threading.Event | None = None,
                 generating: threading.Event | None = None) -> None:
        self.tokenizer = tokenizer
        self.generate_gate = generate_gate  # cleared: every generation waits (in flight) after its first token
        self.generating = generating or threading.Event()  # set once a generation has started
        self.context_length = int(tokenizer.model_max_length)
        self.eos_token_ids = frozenset({tokenizer.eos_token_id})
        self.reply_ids = [*tokenizer.encode(REPLY_TEXT, add_special_tokens=False), tokenizer.eos_token_id]
        self.token_delay_s = token_delay_s
        self.weight_loads = 0
        self.closed = False

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        ids = self.reply_ids[: params.max_tokens]
        for i, token in enumerate(ids):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            if i == 1:
                self.generating.set()
                await _passed(self.generate_gate)
            last = i == len(ids) - 1
            finish = ("stop" if token in self.eos_token_ids else "length") if last else None
            yield GenerationChunk(token_ids=[token], logprobs=[REPLY_LOGPROB], finish_reason=finish)

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        list(named_tensors)
        self.weight_loads += 1

    def load_weights_from(self, directory: Path) -> None:
        self.weight_loads += 1

    def close(self) -> None:
        self.closed = True


class StubTrainer(Trainer):
    """Takes a step at once (or when `step_gate` opens); checkpoints (and exports) its step count in one small file."""

    CHECKPOINT_FILE = "stub_trainer.json"

    def __init__(self, config: TrainConfig, step_gate: threading.Event) -> None:
        self.config = config
        self.step_count = 0
        self.progress = None
        self.batches: list[TrainBatch] = []
        self._step_gate = step_gate

    def step(self, batch: TrainBatch) -> dict[str, float]:
        _pass(self._step_gate, "training step")
        self.batches.append(batch)
        self.step_count = batch.step
        samples = sum(len(group.samples) for group in batch.groups)
        return {"loss": 0.0, "groups": float(len(batch.groups)), "samples": float(samples)}

    def named_weights(self) -> Iterable[tuple[str, Any]]:
        return []

    def export_weights(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / self.CHECKPOINT_FILE).write_text(json.dumps({"step_count": self.step_count}))
        return directory

    def save(self, directory: Path) -> None:
        (directory / self.CHECKPOINT_FILE).write_text(json.dumps({"step_count": self.step_count}))

    def load(self, directory: Path) -> None:
        self.step_count = json.loads((directory / self.CHECKPOINT_FILE).read_text())["step_count"]


async def _passed(gate: threading.Event | None) -> None:
    """Wait (without holding the event loop) until `gate` opens; no gate: at once."""
    while gate is not None and not gate.is_set():
        await asyncio.sleep(0.01)


def _pass(gate: threading.Event, what: str) -> None:
    if not gate.wait(GATE_LIMIT_S):
        raise RuntimeError(f"stub {what}: its gate stayed closed for {GATE_LIMIT_S}s")


class StubBackends:
    """The engine and trainer factories handed to `build_app`, with the knobs tests turn and what was built.

    `boot_gate.clear()` holds the next boot in BOOTING until `boot_gate.set()`; `boot_error` makes boots fail with
    that message (after the gate); `step_gate.clear()` holds training steps in WEIGHT_SYNCING; `generate_gate.clear()`
    holds every generation in flight after its first token (`generating` is set once one is there).
    """

    def __init__(self) -> None:
        self.boot_gate = threading.Event()
        self.step_gate = threading.Event()
        self.generate_gate = threading.Event()
        self.generating = threading.Event()
        self.boot_gate.set()
        self.step_gate.set()
        self.generate_gate.set()
        self.boot_error: str | None = None
        self.engines: list[StubEngine] = []
        self.trainers: list[StubTrainer] = []

    def engine(self, model_dir: Path) -> StubEngine:
        _pass(self.boot_gate, "boot")
        if self.boot_error:
            raise RuntimeError(self.boot_error)
        engine = StubEngine(load_tokenizer(Path(model_dir)), generate_gate=self.generate_gate,
                            generating=self.generating)
        self.engines.append(engine)
        return engine

    def trainer(self, model_dir: Path, config: TrainConfig) -> StubTrainer:
        trainer = StubTrainer(config, self.step_gate)
        self.trainers.append(trainer)
        return trainer

    def release(self) -> None:
        """Open every gate (a server cannot shut down while a boot or a step waits on one)."""
        self.boot_gate.set()
        self.step_gate.set()
        self.generate_gate.set()


class RequestLog:
    """ASGI wrapper: hands every request to `app` unchanged and remembers its method and path."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.requests: list[tuple[str, str]] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.requests.append((scope["method"], scope["path"]))
        await self.app(scope, receive, send)

    def count(self, route: str, method: str | None = None) -> int:
        """Requests to `route` (a protocol route; `{episode_id}` matches any id), of `method` if given."""
        pattern = re.compile(re.escape(route).replace(re.escape("{episode_id}"), "[^/]+") + "$")
        return sum(1 for m, path in list(self.requests) if pattern.match(path) and method in (None, m))


class AppServer:
    """An ASGI app served by uvicorn on 127.0.0.1 in a thread, with its lifespan."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, name=f"app-server-{self.port}", daemon=True)

    def __enter__(self) -> AppServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the app server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=15)


@dataclass
class StubServer:
    url: str
    data_dir: Path
    backends: StubBackends
    log: RequestLog


@contextlib.contextmanager
def stub_server(model_dir: Path, data_dir: Path, *, static: bool = False,
                port: int | None = None) -> Iterator[StubServer]:
    """The real server app (admin token `ADMIN`, serving "tiny") over stub backends, on `port` (default: a free
    one; a restarted server passes its old port)."""
    backends = StubBackends()
    port = port or free_port()
    options = ServeOptions(model=str(model_dir), port=port, data_dir=data_dir, admin_token=ADMIN,
                           served_model_name=SERVED_NAME, static=static)
    log = RequestLog(build_app(options, engine_factory=backends.engine, trainer_factory=backends.trainer))
    with AppServer(log, port) as app_server:
        try:
            yield StubServer(app_server.url, data_dir, backends, log)
        finally:
            backends.release()


def recorded_episodes(data_dir: Path) -> list[dict[str, Any]]:
    """The episodes a server stored durably (its ledger), oldest first."""
    db = sqlite3.connect(f"file:{data_dir / 'ledger.sqlite'}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT episode_id, task_id, client_id, reward, agent_rewards, metadata FROM episodes ORDER BY rowid"
        ).fetchall()
        agents = db.execute("SELECT episode_id, agent FROM samples ORDER BY id").fetchall()
    finally:
        db.close()
    return [
        {"episode_id": eid, "task_id": task, "client_id": client, "reward": reward,
         "agent_rewards": json.loads(rewards) if rewards else None, "metadata": json.loads(meta),
         "agents": [agent for sample_eid, agent in agents if sample_eid == eid]}
        for eid, task, client, reward, rewards, meta in rows
    ]
