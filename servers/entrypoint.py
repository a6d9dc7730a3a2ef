"""`marl serve`: one swarm server process for one model, trainable (the default) or static (`--static`)."""

from __future__ import annotations

import logging
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from marl.protocol import ADMIN_TOKEN_ENV, DEFAULT_MAX_BODY_MB, TrainConfig
from servers.engines.vllm_process import VLLMSettings
from servers.http_routes import create_app
from servers.interfaces import Trainer
from servers.lifecycle import EngineFactory, TrainerFactory
from servers.static_server import StaticServer
from servers.trainable_server import TrainableServer


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
    engine: str = "torch"  # torch: transformers in this process; vllm: vLLM in a subprocess of its own venv
    vllm: VLLMSettings | None = None  # engine vllm: how vLLM runs (None: the defaults of the device)
    max_body_mb: float = DEFAULT_MAX_BODY_MB  # larger request bodies are refused (413) before they are read
    log_level: str = "info"

    def served_name(self) -> str:
        """`served_model_name`, else the model's alias or the last component of its path: what clients send as
        `model`, and all that the open routes (/v1/models, /metrics) show of it, never a filesystem path."""
        return self.served_model_name or Path(self.model.rstrip("/")).name or self.model

    def resolved_data_dir(self) -> Path:
        """`data_dir`, else runs/servers/<model>-<port>."""
        safe_name = self.model.strip("/").replace("/", "_") or "model"
        return Path(self.data_dir or Path("runs") / "servers" / f"{safe_name}-{self.port}")


def torch_engine_factory(device: str | None, prefix_cache_gb: float | None = None) -> EngineFactory:
    def build(model_dir: Path):
        from servers.engines.torch_engine import TorchEngine

        sizing = {} if prefix_cache_gb is None else {"prefix_cache_bytes": int(prefix_cache_gb * 2**30)}
        return TorchEngine(model_dir, device=device, **sizing)

    return build


def _grpo_trainer(model_dir: Path, section, device: str | None) -> Trainer:
    from servers.trainers.grpo import GRPOTrainer

    return GRPOTrainer(model_dir, section, device=device)


#: `TrainConfig.trainer` -> how to build that trainer from the model dir, its config section and the device.
def _fsdp_trainer(model_dir: Path, section, device: str | None) -> Trainer:
    from servers.trainers.fsdp import FSDPTrainer

    return FSDPTrainer(model_dir, section, device=device)


TRAINERS = {"grpo": _grpo_trainer, "fsdp": _fsdp_trainer}


def default_trainer_factory(device: str | None) -> TrainerFactory:
    """Builds the trainer the synced config names (`config.trainer`), with its section (e.g. `config.grpo`)."""

    def build(model_dir: Path, config: TrainConfig) -> Trainer:
        return TRAINERS[config.trainer](model_dir, config.trainer_section, device)

    return build


def resolve(name: str) -> Path:
    from servers.models import resolve_model

    return resolve_model(name)


def admin_token(options: ServeOptions) -> str:
    """`--admin-token`, else $MARL_ADMIN_TOKEN, else a random one, printed for the operator."""
    token = options.admin_token or os.environ.get(ADMIN_TOKEN_ENV)
    if not token:
        token = secrets.token_urlsafe(24)
        print(f"marl serve: no admin token given; generated one for this run:\n  {ADMIN_TOKEN_ENV}={token}",
              file=sys.stderr, flush=True)
    return token


def engine_factory_for(options: ServeOptions) -> EngineFactory:
    """The engine `options.engine` names: the torch engine, or vLLM in a subprocess (`make vllm`)."""
    if options.engine == "vllm":
        from servers.engines.vllm_engine import vllm_engine_factory

        # a trainable server's trainer shares vLLM's GPU (rank 0 and vLLM both take GPU 0)
        return vllm_engine_factory(options.device, settings=options.vllm, shares_gpu=not options.static,
                                   work_dir=options.resolved_data_dir() / "vllm")
    return torch_engine_factory(options.device, options.prefix_cache_gb)


def build_server(options: ServeOptions, *, engine_factory: EngineFactory | None = None,
                 trainer_factory: TrainerFactory | None = None) -> tuple[TrainableServer | StaticServer, str]:
    """The server `options` describe, and its admin token. The factories default to the torch engine and the
    trainer the config names; tests and benches pass their own (a stub engine, a slow trainer)."""
    served_name = options.served_name()
    engine_factory = engine_factory or engine_factory_for(options)
    if options.static:
        server = StaticServer(model=options.model, served_name=served_name, resolve_model=resolve,
                              engine_factory=engine_factory)
    else:
        server = TrainableServer(model=options.model, served_name=served_name, data_dir=options.resolved_data_dir(),
                                 resolve_model=resolve, engine_factory=engine_factory,
                                 trainer_factory=trainer_factory or default_trainer_factory(options.device),
                                 public_url=options.public_url)
    return server, admin_token(options)


def build_app(options: ServeOptions, *, engine_factory=None, trainer_factory=None) -> FastAPI:
    """The ASGI app of the server `options` describe: what `marl serve` runs, and what tests run in-process."""
    server, token = build_server(options, engine_factory=engine_factory, trainer_factory=trainer_factory)
    return create_app(server, token, max_body_mb=options.max_body_mb)


def serve(options: ServeOptions) -> None:
    logging.basicConfig(level=options.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server, token = build_server(options)
    where = "static" if options.static else f"trainable (data: {options.resolved_data_dir()})"
    print(f"marl serve: {where} server for '{server.served_name}' on http://{options.host}:{options.port}",
          file=sys.stderr, flush=True)
    uvicorn.run(create_app(server, token, max_body_mb=options.max_body_mb), host=options.host, port=options.port,
                log_level=options.log_level, timeout_graceful_shutdown=5, access_log=options.log_level == "debug")
