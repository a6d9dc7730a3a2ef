"""A static server (`marl serve --static`): serves a model as it is. No leases, no training, no ledger.

It loads the model when the process starts (BOOTING, then STATIC). Any key may call the data plane; calls are
counted, never recorded. The control and episode routes answer 409 STATIC_SERVER (`refuse_training`).

With an adapter (`marl serve --static --adapter DIR`, a PEFT adapter directory: a LoRA policy's checkpoint, as
`marl eval` plays it) every call generates with that adapter on the base model.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from marl.protocol import EngineState, ErrorCode, MonitorSnapshot, ServerStatus
from servers import heap
from servers.backends import InferenceEngine, lora_spec_in
from servers.calls.chat import ChatService, Unleased
from servers.calls.chat_format import ChatFormatter
from servers.errors import Refusal
from servers.metrics.prometheus import MetricsReading, render
from servers.metrics.telemetry import Telemetry
from servers.policies.views import AdapterEngine, Shared
from servers.training.lifecycle import EngineFactory

log = logging.getLogger("marl.server")

#: The name the static server's one adapter is loaded under in its engine.
ADAPTER_NAME = "static"


def adapted_engine(engine_factory: EngineFactory, adapter: Path) -> EngineFactory:
    """`engine_factory`'s engine with the PEFT adapter in `adapter` on every generation: the view a LoRA policy's
    server generates through (`AdapterEngine`), on an engine of its own, the adapter loaded at boot."""

    def build(model_dir: Path) -> InferenceEngine:
        spec = lora_spec_in(adapter)
        engine = AdapterEngine(Shared(engine_factory), model_dir, ADAPTER_NAME, spec)
        try:
            engine.load_weights_from(adapter)
        except BaseException:
            engine.close()
            raise
        return engine

    return build


class StaticServer:
    def __init__(self, *, model: str, served_name: str, resolve_model: Callable[[str], Path],
                 engine_factory: EngineFactory, adapter: Path | None = None):
        """`adapter`: a PEFT adapter directory that every call generates with (None: the model as it is)."""
        self.model = model
        self.adapter = adapter
        self.served_name = served_name
        self.resolve_model = resolve_model
        self.engine_factory = engine_factory if adapter is None else adapted_engine(engine_factory, adapter)
        self.state = EngineState.OFFLINE  # BOOTING from startup, STATIC once the model is loaded
        self.policy_version = 0
        self.engine: InferenceEngine | None = None
        self.formatter: ChatFormatter | None = None
        self.telemetry = Telemetry()
        self.chat = ChatService(self, lambda api_key: Unleased(), self.telemetry)
        self._boot_task: asyncio.Task | None = None

    async def startup(self) -> None:
        self.state = EngineState.BOOTING
        self._boot_task = asyncio.create_task(self._boot())

    async def _boot(self) -> None:
        try:
            model_dir = await asyncio.to_thread(self.resolve_model, self.model)
            engine = await asyncio.to_thread(self.engine_factory, model_dir)
            formatter = await asyncio.to_thread(ChatFormatter, engine.tokenizer, engine.eos_token_ids)
        except Exception as exc:
            log.exception("engine failed to boot")
            self.telemetry.errors.report(f"boot failed: {exc}")
            self.state = EngineState.OFFLINE
            return
        self.engine, self.formatter = engine, formatter
        heap.settle()  # before the first call: its one collection holds the loop
        self.state = EngineState.STATIC
        log.info("engine STATIC: serving %s", self.served_name)

    async def shutdown(self) -> None:
        if self._boot_task:
            self._boot_task.cancel()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)

    def refuse_training(self) -> NoReturn:
        raise Refusal(409, ErrorCode.STATIC_SERVER, "this is a static server (marl serve --static): it serves the"
                      " model without leases or training", state=self.state)

    async def status(self) -> ServerStatus:
        return ServerStatus(state=self.state, model=self.served_name, policy_version=0, generation=0, step=0,
                            static=True, last_error=self.telemetry.errors.last_error,
                            metrics=self.telemetry.counters.as_metrics())

    async def monitor(self) -> MonitorSnapshot:
        return self.telemetry.snapshot(await self.status())

    async def metrics_text(self) -> bytes:
        return render(MetricsReading(model=self.served_name, state=self.state, policy_version=0, running_leases=0,
                                     tokens_per_s=self.telemetry.generated.per_s(), counters=self.telemetry.counters,
                                     engine_stats=getattr(self.engine, "stats", None),
                                     generation_busy_s=self.telemetry.generation.busy_s()))
