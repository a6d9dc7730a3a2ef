"""`marl serve`: one swarm server process for one model."""

from __future__ import annotations

import logging
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from marl.protocol import ADMIN_TOKEN_ENV, TrainConfig
from servers.app import create_app
from servers.swarm import SwarmServer


@dataclass
class ServeOptions:
    model: str
    port: int
    host: str = "127.0.0.1"
    admin_token: str | None = None
    data_dir: Path | None = None
    static: bool = False
    served_model_name: str | None = None
    public_url: str | None = None
    device: str | None = None
    prefix_cache_gb: float | None = None  # None: the engine's default
    log_level: str = "info"


def torch_engine_factory(device: str | None, prefix_cache_gb: float | None = None):
    def build(model_dir: Path):
        from servers.engines.torch_engine import TorchEngine

        sizing = {} if prefix_cache_gb is None else {"prefix_cache_bytes": int(prefix_cache_gb * 2**30)}
        return TorchEngine(model_dir, device=device, **sizing)

    return build


def grpo_trainer_factory(device: str | None):
    def build(model_dir: Path, config: TrainConfig):
        from servers.trainers.grpo import GRPOTrainer

        return GRPOTrainer(model_dir, config.grpo, device=device)

    return build


def resolve(name: str) -> Path:
    from servers.models import resolve_model

    return resolve_model(name)


def build_server(options: ServeOptions, *, engine_factory=None, trainer_factory=None) -> tuple[SwarmServer, str]:
    """The server `options` describe, and its admin token. The factories default to the torch engine and GRPO
    trainer; tests and benches pass their own (a stub engine, a slow trainer)."""
    token = options.admin_token or os.environ.get(ADMIN_TOKEN_ENV)
    if not token:
        token = secrets.token_urlsafe(24)
        print(f"marl serve: no admin token given; generated one for this run:\n  {ADMIN_TOKEN_ENV}={token}",
              file=sys.stderr, flush=True)
    safe_name = options.model.strip("/").replace("/", "_") or "model"
    data_dir = options.data_dir or Path("runs") / "servers" / f"{safe_name}-{options.port}"
    server = SwarmServer(
        model=options.model,
        served_name=options.served_model_name or options.model,
        data_dir=Path(data_dir),
        engine_factory=engine_factory or torch_engine_factory(options.device, options.prefix_cache_gb),
        trainer_factory=None if options.static else (trainer_factory or grpo_trainer_factory(options.device)),
        resolve_model=resolve,
        static=options.static,
        public_url=options.public_url,
    )
    return server, token


def build_app(options: ServeOptions, *, engine_factory=None, trainer_factory=None) -> FastAPI:
    """The ASGI app of the server `options` describe: what `marl serve` runs, and what tests run in-process."""
    server, token = build_server(options, engine_factory=engine_factory, trainer_factory=trainer_factory)
    return create_app(server, token)


def serve(options: ServeOptions) -> None:
    logging.basicConfig(level=options.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server, token = build_server(options)
    mode = "static" if options.static else "trainable"
    print(f"marl serve: {mode} server for '{server.served_name}' on http://{options.host}:{options.port}"
          f" (data: {server.data_dir})", file=sys.stderr, flush=True)
    uvicorn.run(create_app(server, token), host=options.host, port=options.port, log_level=options.log_level,
                timeout_graceful_shutdown=5, access_log=options.log_level == "debug")
