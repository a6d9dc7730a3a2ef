"""`marl serve`: one swarm server process for one model, trainable (the default) or static (`--static`)."""

from __future__ import annotations

import errno
import functools
import logging
import os
import secrets
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from marl.protocol import ADMIN_TOKEN_ENV, DEFAULT_MAX_BODY_MB, SERVER_KEEP_ALIVE_S, LoraSpec, TrainConfig
from servers import heap
from servers.backends import PolicyTrainer, Trainer, lora_spec_in
from servers.engines.vllm_lora import LoraSlots, lora_slots
from servers.engines.vllm_process import VLLMSettings
from servers.http.routes import create_app
from servers.hub_models import is_hub_id
from servers.placement import Placement, visible_devices
from servers.policies.server import PolicyServer
from servers.policies.views import PolicyTrainerFactory
from servers.static_server import StaticServer
from servers.trainable_server import TrainableServer
from servers.training.lifecycle import EngineFactory, TrainerFactory


@dataclass
class ServeOptions:
    model: str
    port: int
    revision: str | None = None  # a Hugging Face id's branch, tag or commit (None: main)
    host: str = "127.0.0.1"
    admin_token: str | None = None
    data_dir: Path | None = None
    static: bool = False
    served_model_name: str | None = None
    public_url: str | None = None
    device: str | None = None
    prefix_cache_gb: float | None = None  # None: the engine's default
    #: torch: transformers in this process; vllm: vLLM in a subprocess of its own venv; simulated: a latency model
    #: and a sleeping trainer (servers.engines.simulated), for benchmarks and tests only
    engine: str = "torch"
    simulated_speed: float = 1.0  # engine simulated: how many times faster than real time its delays run
    vllm: VLLMSettings | None = None  # engine vllm: how vLLM runs (None: the defaults of the device)
    placement: Placement = field(default_factory=Placement)  # which GPUs the engine and trainer ranks use
    max_body_mb: float = DEFAULT_MAX_BODY_MB  # larger request bodies are refused (413) before they are read
    #: LoRA policies of the base model, each its own learner (`servers.policies.server`); empty: one full-weight policy
    policies: dict[str, LoraSpec] = field(default_factory=dict)
    #: static only: a PEFT adapter directory (a LoRA policy's checkpoint) served on the model on every call
    adapter: Path | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.engine == "simulated" and not self.simulated_speed > 0:
            raise ValueError(f"--simulated-speed must be > 0, got {self.simulated_speed}")
        if self.engine == "simulated" and self.policies and not self.static:
            raise ValueError("--engine simulated simulates one full-weight policy: it takes no --policy")
        if self.adapter is None:
            return
        if not self.static:
            raise ValueError("--adapter serves a LoRA adapter as it is: give --static too (a trainable server"
                             " trains its adapters, --policy)")
        if not (Path(self.adapter) / "adapter_config.json").is_file():
            raise ValueError(f"--adapter {self.adapter}: not a PEFT adapter directory (no adapter_config.json)")

    def served_name(self) -> str:
        """`served_model_name`, else the model's alias, its Hugging Face id (as vLLM serves one) or the last component
        of its path: what clients send as `model`, and all that the open routes (/v1/models, /metrics) show of it,
        never a filesystem path."""
        if self.served_model_name:
            return self.served_model_name
        if is_hub_id(self.model) and not Path(self.model).expanduser().exists():
            return self.model
        return Path(self.model.rstrip("/")).name or self.model

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


def _grpo_trainer(model_dir: Path, section, device: str | None, placement: Placement) -> Trainer:
    from servers.trainers.grpo import GRPOTrainer

    if len(placement.trainer_gpus or ()) > 1:
        raise ValueError("trainer grpo trains in one process on one GPU: give it one --trainer-gpus GPU, or sync"
                         " trainer: fsdp (one rank per GPU)")
    return GRPOTrainer(model_dir, section, device=placement.trainer_device(device))  # in this process: cuda:<gpu>


def _fsdp_trainer(model_dir: Path, section, device: str | None, placement: Placement) -> Trainer:
    from servers.trainers.fsdp import FSDPTrainer

    return FSDPTrainer(model_dir, section, device=device, placement=placement)


#: `TrainConfig.trainer` -> how to build that trainer from the model dir, its config section, the device and the
#: placement.
TRAINERS = {"grpo": _grpo_trainer, "fsdp": _fsdp_trainer}


def default_trainer_factory(device: str | None, placement: Placement | None = None) -> TrainerFactory:
    """Builds the trainer the synced config names (`config.trainer`), with its section (e.g. `config.grpo`)."""
    placement = placement or Placement()

    def build(model_dir: Path, config: TrainConfig) -> Trainer:
        return TRAINERS[config.trainer](model_dir, config.trainer_section, device, placement)

    return build


def lora_trainer_factory(device: str | None, placement: Placement | None = None) -> PolicyTrainerFactory:
    """Builds the trainer of a server's LoRA policies, the kind their configs name (one for all of them: the
    topology checks it), each policy with its config's section of that trainer."""
    placement = placement or Placement()

    def build(model_dir: Path, policies: Mapping[str, tuple[LoraSpec, TrainConfig]]) -> PolicyTrainer:
        kinds = {config.trainer for _, config in policies.values()}
        if len(kinds) > 1:
            raise ValueError(f"the LoRA policies of a server share one trainer, but they name {sorted(kinds)}:"
                             " give every policy the same train.trainer")  # fmt: skip
        sections = {name: (spec, config.trainer_section) for name, (spec, config) in policies.items()}
        if kinds == {"fsdp"}:
            from servers.trainers.fsdp_lora import FSDPLoraTrainer

            return FSDPLoraTrainer(model_dir, sections, device=device, placement=placement)
        from servers.trainers.lora_grpo import LoraGRPOTrainer

        return LoraGRPOTrainer(model_dir, sections, device=placement.trainer_device(device))

    return build


def resolve(name: str, revision: str | None = None) -> Path:
    from servers.model_files import resolve_model

    return resolve_model(name, revision)


def resolver(revision: str | None) -> Callable[[str], Path]:
    """What a server resolves its model with: `resolve`, at the revision `marl serve --revision` names."""
    return resolve if revision is None else functools.partial(resolve, revision=revision)


def admin_token(options: ServeOptions) -> str:
    """`--admin-token`, else $MARL_ADMIN_TOKEN, else a random one, printed for the operator."""
    token = options.admin_token or os.environ.get(ADMIN_TOKEN_ENV)
    if not token:
        token = secrets.token_urlsafe(24)
        print(f"marl serve: no admin token given; generated one for this run:\n  {ADMIN_TOKEN_ENV}={token}",
              file=sys.stderr, flush=True)
    return token


def engine_factory_for(options: ServeOptions) -> EngineFactory:
    """The engine `options.engine` names: the torch engine, vLLM in a subprocess (`make vllm`), or the simulated
    one (benchmarks and tests)."""
    if options.engine == "simulated":
        from servers.engines.simulated import simulated_engine_factory

        return simulated_engine_factory(options.simulated_speed)
    if options.engine == "vllm":
        from servers.engines.vllm_engine import vllm_engine_factory

        return vllm_engine_factory(options.device, settings=options.vllm, work_dir=options.resolved_data_dir() / "vllm",
                                   lora=vllm_lora_slots(options), **vllm_placement(options))
    return torch_engine_factory(options.placement.engine_device(options.device), options.prefix_cache_gb)


def vllm_lora_slots(options: ServeOptions) -> LoraSlots | None:
    """The LoRA slots vLLM starts with: one per policy (or the static server's adapter); None: no adapters."""
    specs = list(options.policies.values())
    if options.adapter is not None:
        specs.append(lora_spec_in(Path(options.adapter)))
    return lora_slots(specs)


def vllm_placement(options: ServeOptions) -> dict:
    """What vLLM's launch takes from the placement: `shares_gpu`, whether a trainer uses one of its GPUs (sleep mode
    and the default memory share follow from it), `cuda_visible_devices`, its GPUs, and `engine_gpus` and
    `trainer_gpus` (this machine's; none on a static server), from which the weight sync follows; under Ray the
    server's placement group, in whose last bundles replicas after the first run (servers.engines.vllm_ray)."""
    placement = options.placement
    gpus = None if placement.engine_gpus is None or options.device == "cpu" else placement.engine_gpus
    return {"shares_gpu": not options.static and placement.shares_gpu(),
            "cuda_visible_devices": None if gpus is None else visible_devices(gpus),
            "engine_gpus": placement.engine_gpus,
            "trainer_gpus": () if options.static else placement.node_trainer_gpus(),
            "ranks_elsewhere": not options.static and placement.ranks_on_ray,
            "ray_group": placement.ray_group, "ray_address": placement.ray_address}


def build_server(options: ServeOptions, *, engine_factory: EngineFactory | None = None,
                 trainer_factory: TrainerFactory | None = None,
                 policy_trainer_factory: PolicyTrainerFactory | None = None,
                 ) -> tuple[TrainableServer | PolicyServer | StaticServer, str]:  # fmt: skip
    """The server `options` describe, and its admin token. The factories default to the torch engine and the
    trainer the config names (the LoRA trainer for `policies`); tests and benches pass their own."""
    served_name = options.served_name()
    token = admin_token(options)
    resolve_at = resolver(options.revision)
    engine_factory = engine_factory or engine_factory_for(options)
    if trainer_factory is None and options.engine == "simulated":
        from servers.trainers.simulated import simulated_trainer_factory

        trainer_factory = simulated_trainer_factory(options.simulated_speed)
    if options.policies and not options.static:
        server = PolicyServer(model=options.model, served_name=served_name, policies=options.policies,
                              data_dir=options.resolved_data_dir(), resolve_model=resolve_at,
                              engine_factory=engine_factory, public_url=options.public_url,
                              trainer_factory=policy_trainer_factory or lora_trainer_factory(
                                  options.device, options.placement))
    elif options.static:
        server = StaticServer(model=options.model, served_name=served_name, resolve_model=resolve_at,
                              engine_factory=engine_factory, adapter=options.adapter and Path(options.adapter))
    else:
        server = TrainableServer(model=options.model, served_name=served_name, data_dir=options.resolved_data_dir(),
                                 resolve_model=resolve_at, engine_factory=engine_factory,
                                 trainer_factory=trainer_factory or default_trainer_factory(
                                     options.device, options.placement),
                                 public_url=options.public_url)
    return server, token


def build_app(options: ServeOptions, *, engine_factory=None, trainer_factory=None,
              policy_trainer_factory=None) -> FastAPI:  # fmt: skip
    """The ASGI app of the server `options` describe: what `marl serve` runs, and what tests run in-process."""
    server, token = build_server(options, engine_factory=engine_factory, trainer_factory=trainer_factory,
                                 policy_trainer_factory=policy_trainer_factory)
    return create_app(server, token, max_body_mb=options.max_body_mb)


def serve(options: ServeOptions, sock: socket.socket | None = None) -> None:
    """Run the server `options` describe until it is stopped, on `sock` (a `listen_socket`; None: bound here)."""
    sock = sock or listen_socket(options.host, options.port)
    heap.own_process()  # this process is the server's alone: its boots freeze the boot-time heap
    logging.basicConfig(level=options.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from servers.model_files import preload_libraries

    # before any worker thread imports them; a server whose model runs elsewhere needs only its tokenizer
    preload_libraries(tokenizer_only=options.engine == "simulated" or (options.engine == "vllm" and options.static))
    server, token = build_server(options)
    where = "static" if options.static else f"trainable (data: {options.resolved_data_dir()})"
    print(f"marl serve: {where} server for '{server.served_name}' on http://{options.host}:{options.port}",
          file=sys.stderr, flush=True)
    http_server(create_app(server, token, max_body_mb=options.max_body_mb), options.host, options.port,
                options.log_level).run(sockets=[sock])


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound to `host`:`port` (as uvicorn binds it); ValueError saying what to do when it cannot
    be: checked before anything loads, so a taken port ends `marl serve` at once, in one line."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is taken (address already in use): stop what listens there,"
                             " or pass another --port") from None
        raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): pass another --host or"
                         " --port") from None
    return sock


def http_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> uvicorn.Server:
    """The uvicorn server `marl serve` runs `app` on (its access log at debug only; idle connections kept longer
    than clients keep theirs: `SERVER_KEEP_ALIVE_S`)."""
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                                         timeout_keep_alive=SERVER_KEEP_ALIVE_S, access_log=log_level == "debug"))
