"""The training record of one server: `metrics.jsonl` in its data dir, plus TensorBoard events when available.

One JSON line per training step (`{"step": n, "time": unix, **metrics}`), appended and flushed as each step ends,
so `marl plot`, `marl overwatch` and plain `tail -f` all read the same file. The last lines are read back at start,
so a restarted server shows its history. If the `tensorboard` package is installed, the same scalars also go to
`<data_dir>/tensorboard/` (`tensorboard --logdir runs/`); without it nothing changes.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from pathlib import Path

from marl.protocol import StepRecord

log = logging.getLogger(__name__)


class TrainingRecord:
    def __init__(self, data_dir: Path, keep: int = 100):
        self.path = data_dir / "metrics.jsonl"
        self.recent: collections.deque[StepRecord] = collections.deque(maxlen=keep)
        for line in _last_lines(self.path, keep):
            try:
                row = json.loads(line)
                self.recent.append(StepRecord(step=int(row.pop("step")), time=float(row.pop("time")),
                                              metrics={k: float(v) for k, v in row.items()}))
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line after a crash: skip it
        self._tensorboard_dir = data_dir / "tensorboard"
        self._tensorboard = None  # opened at the first step: a server that never trains leaves no event file

    def append(self, step: int, metrics: dict[str, float]) -> StepRecord:
        record = StepRecord(step=step, time=time.time(), metrics=metrics)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "time": record.time, **metrics}) + "\n")
        self.recent.append(record)
        if self._tensorboard is None and self._tensorboard_dir is not None:
            self._tensorboard = _tensorboard_writer(self._tensorboard_dir)
            self._tensorboard_dir = None  # tried once
        if self._tensorboard is not None:
            for key, value in metrics.items():
                self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()
        return record

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()


def _last_lines(path: Path, n: int) -> list[str]:
    if not path.exists():
        return []
    with open(path) as f:
        return list(collections.deque((line for line in f if line.strip()), maxlen=n))


def _tensorboard_writer(log_dir: Path):
    try:  # needs the optional `tensorboard` package
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    try:
        return SummaryWriter(log_dir=str(log_dir))
    except Exception as exc:  # noqa: BLE001 - a broken optional writer must not stop training
        log.warning("TensorBoard events disabled: %s", exc)
        return None
