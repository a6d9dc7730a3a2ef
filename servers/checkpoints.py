"""Checkpoint directories: `<data_dir>/checkpoints/step_000042/`, written atomically, newest few kept.

A checkpoint is whatever `Trainer.save` writes (for the torch backend: a `from_pretrained`-loadable model plus the
optimizer, step and RNG state). It appears under its final name only once complete (written to a hidden temporary
directory, then renamed), so a crash mid-save never leaves a checkpoint that looks usable.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from servers.interfaces import Trainer

_NAME = re.compile(r"^step_(\d{6,})$")


class CheckpointDir:
    def __init__(self, root: Path):
        self.root = root

    def all(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
        return sorted(found)

    def latest(self) -> Path | None:
        found = self.all()
        return found[-1][1] if found else None

    def save(self, trainer: Trainer, step: int, keep: int) -> Path:
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".tmp-step_{step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        trainer.save(tmp)
        if final.exists():  # a step redone after a crash: the new one replaces it
            shutil.rmtree(final)
        tmp.rename(final)
        for _, old in self.all()[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final
