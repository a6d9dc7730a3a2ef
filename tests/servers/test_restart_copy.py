"""After a push through vLLM's weight-transfer engine the train loop exports the pushed weights for the engine to
restart with, and the next step waits for that copy before it changes the trainer's weights (issue 53). Stand-ins
for the engine and the trainer; the engine's side against a real vLLM is in test_vllm_weight_transfer.py."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

from servers.backends import TrainBatch
from servers.training.loop import TrainLoop


class PushedEngine:
    def __init__(self):
        self.kept: list[str | None] = []

    def push_weights(self, push) -> bool:
        push(None)
        return True

    def keep_restart_copy(self, directory: Path | None) -> None:
        self.kept.append(None if directory is None else (directory / "weights.txt").read_text())


class Trainer:
    def __init__(self, export_gate: threading.Event | None = None, fails: bool = False):
        self.weights, self.events = "v1", []
        self.export_gate, self.fails = export_gate, fails

    def push_weights(self, target) -> None:
        self.events.append(f"push {self.weights}")

    def export_weights(self, directory: Path) -> Path:
        if self.export_gate is not None:
            self.export_gate.wait(10)
        if self.fails:
            raise OSError("disk full")
        (directory / "weights.txt").write_text(self.weights)
        self.events.append(f"export {self.weights}")
        return directory

    def step(self, batch) -> dict[str, float]:
        self.events.append("step")
        self.weights = "v2"
        return {}


def loop_in(tmp_path: Path) -> TrainLoop:
    return TrainLoop(lifecycle=SimpleNamespace(data_dir=tmp_path), pool=None, ledger=None, record=None,
                     telemetry=None, wakeup=None, stop_engine=None)


def test_a_push_is_followed_by_its_copy_before_the_next_step_changes_the_weights(tmp_path):
    engine, gate = PushedEngine(), threading.Event()
    trainer = Trainer(export_gate=gate)

    async def scenario():
        loop = loop_in(tmp_path)
        await loop._publish(engine, trainer)  # returns at once: the export runs beside the rollouts
        assert engine.kept == [] and trainer.events == ["push v1"]
        threading.Timer(0.2, gate.set).start()
        await loop._train(TrainBatch(step=2, dropped_stale=0, groups=[]), trainer)

    asyncio.run(scenario())
    assert trainer.events == ["push v1", "export v1", "step"]  # the copy is of the pushed weights, taken before
    assert engine.kept == ["v1"]
    assert not list(tmp_path.iterdir())  # the export's scratch directory is gone (the engine keeps its own copy)


def test_a_failed_export_is_handed_over_as_none_and_training_goes_on(tmp_path):
    engine, trainer = PushedEngine(), Trainer(fails=True)

    async def scenario():
        loop = loop_in(tmp_path)
        await loop._publish(engine, trainer)
        await loop._train(TrainBatch(step=2, dropped_stale=0, groups=[]), trainer)

    asyncio.run(scenario())
    assert engine.kept == [None] and trainer.events == ["push v1", "step"]
