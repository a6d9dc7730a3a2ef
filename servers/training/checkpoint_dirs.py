"""Checkpoint directories: `<data_dir>/checkpoints/step_000042/`, written atomically, newest few kept.

A checkpoint is whatever `Trainer.save` writes into an empty directory (for the torch backend: a
`from_pretrained`-loadable model plus optimizer, step and RNG state). It is written into a hidden temporary
directory, fsynced, and only then renamed to its final name, so a crash mid-save never leaves a checkpoint that looks
usable; overwriting a step (redone after a crash) keeps the old one until the new one is complete.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

from servers.backends import Trainer

_NAME = re.compile(r"^step_(\d+)$")
_LEFTOVER = re.compile(r"^\.step_\d+\.(tmp|old)-[0-9a-f]+$")


class CheckpointDir:
    def __init__(self, root: Path):
        self.root = Path(root)

    def all(self) -> list[tuple[int, Path]]:
        """Complete checkpoints (step, path), oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
        return sorted(found)

    def latest(self) -> Path | None:
        found = self.all()
        return found[-1][1] if found else None

    def save(self, trainer: Trainer, step: int, keep: int) -> Path:
        """Save `trainer` as step `step`, then keep only the newest `keep` checkpoints."""
        final = self.root / f"step_{step:06d}"
        tag = uuid.uuid4().hex[:12]
        tmp, old = self.root / f".{final.name}.tmp-{tag}", self.root / f".{final.name}.old-{tag}"
        tmp.mkdir(parents=True)
        try:
            trainer.save(tmp)
            _fsync_tree(tmp)
            if final.exists():
                final.rename(old)
            tmp.rename(final)  # the checkpoint appears complete, or not at all
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if old.exists() and not final.exists():
                old.rename(final)
            raise
        shutil.rmtree(old, ignore_errors=True)
        self.prune(keep)
        return final

    def prune(self, keep: int) -> None:
        """Delete all but the newest `keep` checkpoints, and leftovers of interrupted saves."""
        for _, path in self.all()[: max(0, len(self.all()) - keep)]:
            shutil.rmtree(path, ignore_errors=True)
        for child in self.root.iterdir():
            if _LEFTOVER.match(child.name):
                shutil.rmtree(child, ignore_errors=True)


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
