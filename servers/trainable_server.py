"""A trainable swarm server: its rooms, composed, and the few operations that span them.

    EngineLifecycle  servers.training.lifecycle     engine states, boot and stop, weight publishing, the synced config
    RolloutPool      servers.episodes.rollout_pool  leases, pool progress
    EpisodeRecorder  servers.episodes.recorder     end, prepare, commit, abort: each episode recorded exactly once
    OverdueResolver  servers.episodes.overdue       prepared episodes past their deadline: the decision log, or abort
    TrainLoop        servers.training.loop    full batch -> drain -> train -> publish -> checkpoint
    ChatService      servers.calls.chat       the OpenAI data plane
    Telemetry        servers.metrics.telemetry        counters, errors, tokens/s

Everything runs on the server's asyncio event loop, so state changes need no locks; blocking work runs in threads
(the ledger on one of its own, `servers.episodes.ledger.LedgerThread`). HTTP lives in `servers.http.routes`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

from marl.protocol import (
    DEFAULT_POLICY,
    POLICY_SEPARATOR,
    EngineState,
    ErrorCode,
    MonitorSnapshot,
    ServerStatus,
    TrainConfig,
)
from servers.calls.chat import ChatService
from servers.episodes.ledger import Ledger, LedgerThread
from servers.episodes.overdue import OverdueResolver
from servers.episodes.prepared import PreparedEpisodes
from servers.episodes.recorder import EpisodeRecorder
from servers.episodes.rollout_pool import RolloutPool
from servers.errors import Refusal
from servers.metrics.prometheus import MetricsReading, render
from servers.metrics.telemetry import Telemetry
from servers.metrics.training_record import TrainingRecord
from servers.training.batch_wakeup import BatchWakeup
from servers.training.lifecycle import EngineFactory, EngineLifecycle, TrainerFactory
from servers.training.loop import TrainLoop


class TrainableServer:
    def __init__(self, *, model: str, served_name: str, data_dir: Path, resolve_model: Callable[[str], Path],
                 engine_factory: EngineFactory, trainer_factory: TrainerFactory, public_url: str | None = None,
                 policy: str | None = None):
        #: A LoRA policy's name on a server of several (`servers.policies.server`); None: the one full-weight policy.
        self.policy = policy
        self.data_dir = data_dir
        self.telemetry = Telemetry()
        self.record = TrainingRecord(data_dir)
        self.ledger = Ledger(data_dir / "ledger.sqlite")  # used from the ledger thread once the server runs
        if self.ledger.get_meta("model") != model:
            self.ledger.set_meta("model", model)  # what `marl episode show` decodes tokens with
        saved = self.ledger.get_meta("train_config")
        self._ledger_thread = LedgerThread(self.ledger)
        wakeup = BatchWakeup()  # when the train loop looks at the pool again: see its docstring
        self.lifecycle = EngineLifecycle(
            model=model, served_name=served_name, data_dir=data_dir,
            config=TrainConfig.model_validate_json(saved) if saved else TrainConfig(),
            resolve_model=resolve_model, engine_factory=engine_factory, trainer_factory=trainer_factory,
            ledger=self._ledger_thread, errors=self.telemetry.errors, wakeup=wakeup)
        prepared = PreparedEpisodes(self.ledger)
        counters = self.telemetry.counters
        self.pool = RolloutPool(self.lifecycle, self._ledger_thread, prepared, counters, wakeup, public_url,
                                id_prefix=policy + POLICY_SEPARATOR if policy else "")
        self.recorder = EpisodeRecorder(pool=self.pool, lifecycle=self.lifecycle, ledger=self._ledger_thread,
                                        prepared=prepared, counters=counters, wakeup=wakeup)
        self._overdue = OverdueResolver(ledger=self._ledger_thread, prepared=prepared, recorder=self.recorder,
                                        counters=counters)
        self.train_loop = TrainLoop(lifecycle=self.lifecycle, pool=self.pool, ledger=self._ledger_thread,
                                    record=self.record, telemetry=self.telemetry, wakeup=wakeup,
                                    stop_engine=self.stop_engine)
        self.chat = ChatService(self.lifecycle, self.pool.admit, self.telemetry)
        self._tasks: list[asyncio.Task] = []

    @property
    def served_name(self) -> str:
        return self.lifecycle.served_name

    @property
    def state(self) -> EngineState:
        return self.lifecycle.state

    def for_policy(self, policy: str | None) -> TrainableServer:
        """The learner of `policy`: this server's one policy (named DEFAULT_POLICY or its served name)."""
        if policy in (None, DEFAULT_POLICY, self.served_name):
            return self
        raise Refusal(404, ErrorCode.POLICY_NOT_FOUND, f"policy '{policy}' is not trained here: this server trains"
                      f" one full-weight policy ('{DEFAULT_POLICY}')", param="policy")

    def for_episode(self, episode_id: str) -> TrainableServer:
        """The learner an episode belongs to: this server's one."""
        return self

    async def startup(self) -> None:
        self._tasks = [asyncio.create_task(self.pool.expire_idle_leases()), asyncio.create_task(self.train_loop.run()),
                       asyncio.create_task(self._overdue.run())]

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.lifecycle.close()
        self.record.close()
        await self._ledger_thread.close()

    async def start_engine(self) -> ServerStatus:
        self.lifecycle.start()
        return await self.status()

    async def stop_engine(self) -> ServerStatus:
        self.pool.close_all("the engine was stopped")
        await self.lifecycle.stop()
        return await self.status()

    def _last_step_metrics(self) -> dict[str, float]:
        return self.record.recent[-1].metrics if self.record.recent else {}

    async def status(self) -> ServerStatus:
        lifecycle = self.lifecycle
        return ServerStatus(state=lifecycle.state, model=lifecycle.served_name, policy_version=lifecycle.policy_version,
                            generation=lifecycle.generation, step=lifecycle.policy_version, static=False,
                            pool=await self.pool.info(), last_error=self.telemetry.errors.last_error,
                            metrics={**self.telemetry.counters.as_metrics(), **self._last_step_metrics()})

    async def monitor(self) -> MonitorSnapshot:
        return self.telemetry.snapshot(await self.status(), pool=await self.pool.info(detailed=True),
                                       recent_steps=self.record.recent, training=self.train_loop.progress())

    async def metrics_text(self) -> bytes:
        return render(await self.metrics_reading())

    async def metrics_reading(self) -> MetricsReading:
        lifecycle, telemetry = self.lifecycle, self.telemetry
        return MetricsReading(policy=self.policy or DEFAULT_POLICY,
            model=lifecycle.served_name, state=lifecycle.state, policy_version=lifecycle.policy_version,
            running_leases=len(self.pool.leases), tokens_per_s=telemetry.generated.per_s(),
            counters=telemetry.counters, engine_stats=getattr(lifecycle.engine, "stats", None),
            pool=await self.pool.info(), last_step=self._last_step_metrics(),
            generation_busy_s=telemetry.generation.busy_s())
