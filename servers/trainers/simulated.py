"""A simulated trainer: a GRPO step's duration and metrics, with no model, for benchmarks and tests.

The partner of `servers.engines.simulated` behind `marl serve --engine simulated`. A step sleeps
`step_overhead_s + seconds_per_token * tokens * ppo_epochs` (divided by `speed`), `tokens` being the prompt +
completion tokens of the samples it trains. The defaults APPROXIMATE full-weight GRPO of a 7-8B model with FSDP on 8
H100s (bf16, gradient checkpointing): ~8 x 7e9 FLOPs per trained token at ~40% of an H100's 989 dense bf16 TFLOP/s is
~55k tokens/s on 8 GPUs; RL frameworks report less (padding, logprob passes, communication), so 40k tokens/s
(2.5e-5 s per token), plus ~2 s per step for the optimizer step and FSDP's gathers. Orders of magnitude, not
measurements.

Its metrics are a real step's: rewards, groups, samples, tokens and staleness from `batch_metrics` (the same
advantages as GRPO), the pass metrics of one optimizer step per epoch (losses and the like 0), `policy_version`
and `seconds`. A checkpoint, and an export of "weights", is a small JSON file holding the step count, so checkpoints
and resume go through the real lifecycle.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from marl.protocol import GRPOConfig, TrainConfig
from servers.backends import TrainBatch, Trainer
from servers.trainers.grpo import trainable_items
from servers.trainers.step_metrics import idle_pass_metrics

__all__ = ["SimulatedTrainer", "simulated_trainer_factory"]

STATE_FILE = "simulated_trainer.json"
_PROGRESS_TICKS = 10  # a step sleeps in this many slices, reported as `progress`


class SimulatedTrainer(Trainer):
    """Sleeps as long as a step of the batch would take, then returns its metrics (module docstring)."""

    def __init__(self, model_dir: str | Path, config: GRPOConfig, *, seconds_per_token: float = 2.5e-5,
                 step_overhead_s: float = 2.0, speed: float = 1.0) -> None:  # fmt: skip
        if not speed > 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        self.model_dir = Path(model_dir)
        self.config = config
        self.seconds_per_token, self.step_overhead_s, self.speed = seconds_per_token, step_overhead_s, speed
        self.step_count = 0
        self.exports = 0  # export_weights calls (weights published to an engine)

    def step_seconds(self, tokens: int) -> float:
        """How long a step training `tokens` tokens sleeps."""
        return (self.step_overhead_s + self.seconds_per_token * tokens * self.config.ppo_epochs) / self.speed

    def step(self, batch: TrainBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        items, metrics = trainable_items(batch, self.config, start_version=self.step_count)
        tokens = sum(len(sample.token_ids) for sample, _ in items)
        self._sleep(self.step_seconds(tokens) if items else 0.0)
        metrics.update(idle_pass_metrics(with_ref=self.config.kl_coef > 0))
        if items:
            metrics.update(trained=1.0, optimizer_steps=float(self.config.ppo_epochs),
                           micro_batches=float(math.ceil(tokens / self.config.micro_batch_tokens)))
        self.step_count += 1
        metrics.update(policy_version=float(self.step_count), seconds=time.perf_counter() - t0)
        return metrics

    def _sleep(self, seconds: float) -> None:
        self.progress = (0, _PROGRESS_TICKS)
        for tick in range(_PROGRESS_TICKS):
            time.sleep(seconds / _PROGRESS_TICKS)
            self.progress = (tick + 1, _PROGRESS_TICKS)
        self.progress = None

    def export_weights(self, directory: Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._write(directory)
        self.exports += 1
        return directory

    def save(self, directory: Path) -> None:
        self._write(Path(directory))

    def load(self, directory: Path) -> None:
        state = json.loads((Path(directory) / STATE_FILE).read_text())
        self.step_count = int(state["step_count"])

    def _write(self, directory: Path) -> None:
        (directory / STATE_FILE).write_text(json.dumps({"step_count": self.step_count, "simulated": True}))


def simulated_trainer_factory(speed: float = 1.0):
    """`marl serve --engine simulated`'s trainer, with the synced config's GRPO section (`grpo` or `fsdp`)."""

    def build(model_dir: Path, config: TrainConfig) -> SimulatedTrainer:
        return SimulatedTrainer(model_dir, config.trainer_section, speed=speed)

    return build
