"""The trainable engine's lifecycle: its states, booting and stopping it, and publishing new weights to it.

    OFFLINE ──start──► BOOTING ──► ROLLING ──batch complete──► ROLLING_POST ──leases drained──► WEIGHT_SYNCING
       ▲                              ▲                                                             │
       └──────────stop (any state)    └──────────────── trainer step, version + 1, new weights ─────┘

`EngineLifecycle` owns the state, the engine and trainer it booted, the policy version they serve, the generation
(bumped on every start and stop, so work still running for an older generation is ignored when it finishes) and
the synced `TrainConfig`. The train loop (`servers.training.loop`) drives it around the ROLLING → WEIGHT_SYNCING cycle;
the rollout pool and the data plane read it. Engine and trainer calls run in worker threads, never on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

from marl.protocol import ConfigResponse, EngineState, ErrorCode, GRPOConfig, TrainConfig
from servers import heap
from servers.backends import InferenceEngine, Trainer
from servers.calls.chat_format import ChatFormatter
from servers.episodes.ledger import LedgerThread
from servers.errors import Refusal
from servers.metrics.telemetry import ErrorLog
from servers.training.batch_wakeup import BatchWakeup
from servers.training.checkpoint_dirs import CheckpointDir

log = logging.getLogger("marl.server")

EngineFactory = Callable[[Path], InferenceEngine]
TrainerFactory = Callable[[Path, TrainConfig], Trainer]

#: The moves of the cycle; any state may also go to OFFLINE (a stop, a failed boot or step).
_NEXT_STATES = {
    EngineState.OFFLINE: {EngineState.BOOTING},
    EngineState.BOOTING: {EngineState.ROLLING},
    EngineState.ROLLING: {EngineState.ROLLING_POST},
    EngineState.ROLLING_POST: {EngineState.WEIGHT_SYNCING},
    EngineState.WEIGHT_SYNCING: {EngineState.ROLLING},  # trained, or the batch shrank below batch_size (stale)
}


class EngineLifecycle:
    def __init__(self, *, model: str, served_name: str, data_dir: Path, config: TrainConfig,
                 resolve_model: Callable[[str], Path], engine_factory: EngineFactory, trainer_factory: TrainerFactory,
                 ledger: LedgerThread, errors: ErrorLog, wakeup: BatchWakeup):
        self.model = model
        self.served_name = served_name
        self.config = config
        # How the model name becomes an engine and a trainer at each boot (tests swap a factory between boots).
        self.resolve_model = resolve_model
        self.engine_factory = engine_factory
        self.trainer_factory = trainer_factory
        self.checkpoints = CheckpointDir(data_dir / "checkpoints")
        self.data_dir = data_dir  # exported weights pass through it on their way to an engine in another process
        self._ledger = ledger
        self._errors = errors
        self._wakeup = wakeup  # woken once ROLLING: the pool may already hold a full batch

        self.state = EngineState.OFFLINE
        self.generation = 0
        self.policy_version = 0  # training steps taken by the served weights
        self.engine: InferenceEngine | None = None
        self.trainer: Trainer | None = None
        self.formatter: ChatFormatter | None = None
        self._boot_task: asyncio.Task | None = None

    def move_to(self, state: EngineState) -> None:
        if state is not EngineState.OFFLINE and state not in _NEXT_STATES[self.state]:
            raise RuntimeError(f"engine state {self.state.value} cannot move to {state.value}")
        self.state = state

    def serve_version(self, policy_version: int) -> None:
        """The trained weights serve now: back to ROLLING at the new policy version."""
        self.policy_version = policy_version
        self.move_to(EngineState.ROLLING)

    async def sync_config(self, config: TrainConfig) -> ConfigResponse:
        changed = config != self.config
        if changed and self.state != EngineState.OFFLINE:
            raise Refusal(409, ErrorCode.ENGINE_NOT_OFFLINE,
                          f"the engine is {self.state.value} with a different training config; stop the engine first"
                          " (SwarmClient.stop_engine), then sync the new config", state=self.state)
        if changed:
            self.config = config
            await self._ledger.set_meta("train_config", config.model_dump_json())
        return ConfigResponse(config=self.config, changed=changed)

    def start(self) -> None:
        if self.state != EngineState.OFFLINE:
            raise Refusal(409, ErrorCode.ENGINE_NOT_OFFLINE,
                          f"the engine is already {self.state.value}; start_engine is only valid when OFFLINE"
                          " (stop it first to restart)", state=self.state)
        self.generation += 1
        self._errors.clear()
        self.move_to(EngineState.BOOTING)
        self._boot_task = asyncio.create_task(self._boot(self.generation))

    async def stop(self) -> None:
        """OFFLINE from any state; the engine is released. The caller closes the leases first."""
        if self._boot_task and not self._boot_task.done():
            self._boot_task.cancel()
        self.generation += 1  # anything still running for the old generation is ignored when it finishes
        engine, trainer = self.engine, self.trainer
        self.engine = self.trainer = self.formatter = None
        self.move_to(EngineState.OFFLINE)
        await _close(engine, trainer)

    async def _boot(self, generation: int) -> None:
        try:
            engine, trainer, formatter = await self._build()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("engine failed to boot")
            if generation == self.generation:
                self._errors.report(f"boot failed: {exc}")
                self.move_to(EngineState.OFFLINE)
            return
        if generation != self.generation:  # stopped while booting
            _close_soon(engine, trainer)
            return
        self.engine, self.trainer, self.policy_version = engine, trainer, trainer.step_count
        self.formatter = formatter
        heap.settle()  # before the first call: its one collection holds the loop
        self.move_to(EngineState.ROLLING)
        log.info("engine ROLLING: serving %s at policy version %d", self.served_name, self.policy_version)
        self._wakeup.wake()

    async def _build(self) -> tuple[InferenceEngine, Trainer, ChatFormatter]:
        """Resolve the model, build the engine, its chat formatter and the trainer, resume both from the latest
        checkpoint, and return to the pool the samples claimed by steps that checkpoint does not hold."""
        model_dir = await asyncio.to_thread(self.resolve_model, self.model)
        engine = await asyncio.to_thread(self.engine_factory, model_dir)
        trainer = None
        try:
            formatter = await asyncio.to_thread(ChatFormatter, engine.tokenizer, engine.eos_token_ids)
            trainer = await asyncio.to_thread(self.trainer_factory, model_dir, self.config)
            resolve_recompute_logprobs(engine, trainer)
            latest = self.checkpoints.latest()
            if latest is not None:
                await asyncio.to_thread(trainer.load, latest)
                await self.publish_weights(engine, trainer)
                log.info("resumed from checkpoint %s (step %d)", latest, trainer.step_count)
            elif engine.needs_first_publish:  # a LoRA policy: its adapter, even untrained
                await self.publish_weights(engine, trainer)
            released = await self._ledger.recover(trainer.step_count)
            if released:
                log.info("returned %d samples claimed by steps after %d to the pool", released, trainer.step_count)
        except BaseException:
            _close_soon(engine, trainer)
            raise
        return engine, trainer, formatter

    async def publish_weights(self, engine: InferenceEngine, trainer: Trainer) -> None:
        """Make `engine` serve `trainer`'s current weights: tensors straight across when both live in this process,
        else through a directory of safetensors (an engine or trainer in another process)."""

        def load_tensors() -> bool:
            named = trainer.named_weights()
            if named is None:
                return False
            engine.load_weights(named)
            return True

        if engine.takes_tensors and await asyncio.to_thread(load_tensors):
            return
        with tempfile.TemporaryDirectory(prefix=".weights-", dir=self.data_dir) as scratch:
            exported = await asyncio.to_thread(trainer.export_weights, Path(scratch))
            await asyncio.to_thread(engine.load_weights_from, exported)

    async def close(self) -> None:
        """Server shutdown: stop booting, release the engine."""
        if self._boot_task:
            self._boot_task.cancel()
        engine, trainer = self.engine, self.trainer
        self.engine = self.trainer = self.formatter = None
        await _close(engine, trainer)


#: The one `numerics` (an engine's and a trainer's: what their logprobs are computed in) under which the engine's
#: recorded logprobs are the trainer's up to ~1e-6: the same torch forward in fp32 (docs/backends.md).
SAME_FP32_NUMERICS = "torch.float32"


def recompute_wanted(engine_numerics: str | None, trainer_numerics: str | None) -> bool:
    """What `recompute_logprobs: auto` means for this engine and trainer: on unless both compute in fp32 torch. An
    engine that says nothing (vLLM: kernels of its own) may differ; two dtypes differ; and in bf16 the engine's
    decode with a KV cache rounds otherwise than the trainer's whole-sequence forward, even in one dtype."""
    return not (engine_numerics == trainer_numerics == SAME_FP32_NUMERICS)


def resolve_recompute_logprobs(engine: InferenceEngine, trainer: Trainer) -> None:
    """Give the trainer its GRPO section (`trainer.config`, read at every step) with `recompute_logprobs: auto` made a
    bool, once per boot, where both backends are known (`numerics` of each). An explicit true or false stays as it
    is; a trainer with no GRPO section (a stand-in) is left alone."""
    config = getattr(trainer, "config", None)
    if not isinstance(config, GRPOConfig) or config.recompute_logprobs != "auto":
        return
    engine_numerics, trainer_numerics = getattr(engine, "numerics", None), getattr(trainer, "numerics", None)
    on = recompute_wanted(engine_numerics, trainer_numerics)
    trainer.config = config.model_copy(update={"recompute_logprobs": on})
    log.info("recompute_logprobs auto: %s (engine %s, trainer %s)", "on" if on else "off",
             engine_numerics or "unknown", trainer_numerics or "unknown")


async def _close(engine: InferenceEngine | None, trainer: Trainer | None) -> None:
    """Release an engine and a trainer (a trainer may own processes: an FSDP trainer's ranks)."""
    for backend in (engine, trainer):
        if backend is not None:
            await asyncio.to_thread(backend.close)


def _close_soon(engine: InferenceEngine, trainer: Trainer | None = None) -> None:
    """Release an engine (and trainer) nobody will use, in a thread, without waiting (error and cancellation paths)."""
    loop = asyncio.get_running_loop()
    for backend in (engine, trainer):
        if backend is not None:
            loop.run_in_executor(None, backend.close)
