"""A real swarm server for a test: `marl serve` as a subprocess on a free 127.0.0.1 port, stopped on the way out."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path

from marl.runner.launch import ServerProcess


@contextlib.contextmanager
def server_process(model: str | Path, data_dir: str | Path, *, static: bool = False, admin_token: str | None = None,
                   served_name: str | None = "tiny", device: str | None = "cpu", log_path: str | Path | None = None,
                   timeout: float = 120) -> Iterator[ServerProcess]:
    """Start `marl serve --model MODEL` (trainable unless `static`) with its ledger and checkpoints in `data_dir`,
    wait until it answers /health, yield the `ServerProcess` (`.url`, `.admin_token`, `.log_path`; `.kill()` is
    SIGKILL, for crash tests), and stop it at the end (SIGTERM, then SIGKILL after 20 s).

    `admin_token`: default a fresh random one. `log_path`: the server's output, default `server.log` beside
    `data_dir`. A trainable server starts OFFLINE: sync a config and start its engine first
    (`SwarmClient(proc.url, admin_token=proc.admin_token).auto_sync_train_config_and_start_engine(config)`).
    """
    data_dir = Path(data_dir)
    log = Path(log_path) if log_path is not None else data_dir.parent / f"{data_dir.name}.log"
    proc = ServerProcess(model=str(model), admin_token=admin_token or secrets.token_urlsafe(24), data_dir=data_dir,
                         log_path=log, static=static, device=device, served_name=served_name)
    proc.start()
    try:
        proc.wait_healthy(timeout=timeout)
        yield proc
    finally:
        proc.stop()
