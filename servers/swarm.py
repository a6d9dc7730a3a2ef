"""The swarm server's core: engine states, leases, recording, batch assembly and the train/sync cycle.

Everything here runs on the server's asyncio event loop, so state changes need no locks; blocking work goes to
threads: the ledger on one dedicated thread (one SQLite connection, writes serialised), model loading and training
steps on their own. HTTP lives in `servers.app`; this module raises `Refusal` for every request it turns down.

    OFFLINE ──start──► BOOTING ──► ROLLING ──batch complete──► ROLLING_POST ──leases drained──► WEIGHT_SYNCING
       ▲                              ▲                                                             │
       └──────────stop (any state)    └──────────────── trainer step, version + 1, new weights ─────┘
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import json
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from marl.protocol import (
    ConfigResponse,
    EndEpisodeRequest,
    EndEpisodeResponse,
    EngineState,
    EpisodeLease,
    EpisodeState,
    ErrorEvent,
    GroupProgress,
    LeaseInfo,
    MonitorSnapshot,
    PoolInfo,
    ServerStatus,
    TrainConfig,
    TrainingProgress,
)
from servers.chat import ChatFormatter
from servers.checkpoints import CheckpointDir
from servers.interfaces import Group, InferenceEngine, TrainBatch, Trainer
from servers.leases import Lease, LeaseTable, NoFreeSlot
from servers.ledger import GroupKey, Ledger
from servers.records import TrainingRecord
from servers.samples import CallRecord, merge_calls

log = logging.getLogger("marl.server")
T = TypeVar("T")

EngineFactory = Callable[[Path], InferenceEngine]
TrainerFactory = Callable[[Path, TrainConfig], Trainer]

_RUNNING = (EngineState.ROLLING, EngineState.ROLLING_POST, EngineState.WEIGHT_SYNCING)
_REAP_INTERVAL_S = 0.25
RATE_WINDOW_S = 10.0  # tokens/s is measured over this window


def release_freed_memory() -> None:
    """Hand the memory a training step freed back to the OS (glibc keeps freed heap pages otherwise).

    A step's activations are gigabytes of short-lived tensors; without this, a CPU server's resident memory ratchets
    up step after step until the kernel's out-of-memory killer stops it. A no-op where glibc is not the allocator.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


@dataclass
class Refusal(Exception):
    """A request the server turns down: becomes an `ErrorResponse` with this HTTP status."""

    status: int
    message: str
    code: str
    retry_after_s: float | None = None
    state: EngineState | None = None
    type: str = "invalid_request_error"
    param: str | None = None

    def __str__(self) -> str:
        return self.message


class SwarmServer:
    def __init__(
        self,
        *,
        model: str,
        served_name: str,
        data_dir: Path,
        engine_factory: EngineFactory,
        trainer_factory: TrainerFactory | None,
        resolve_model: Callable[[str], Path],
        static: bool = False,
        public_url: str | None = None,
    ):
        self.model = model
        self.public_url = public_url  # base of the URLs handed to agents; default: the URL the client used
        self.served_name = served_name
        self.data_dir = data_dir
        self.static = static
        self._engine_factory = engine_factory
        self._trainer_factory = trainer_factory
        self._resolve_model = resolve_model

        self.state = EngineState.OFFLINE
        self.generation = 0
        self.step = 0  # = policy version: training steps taken by the served model
        self.engine: InferenceEngine | None = None
        self.trainer: Trainer | None = None
        self._training: tuple[int, int, float] | None = None  # (step, samples, monotonic start) while one runs
        self.formatter: ChatFormatter | None = None
        self.leases = LeaseTable()
        self.counters: collections.Counter[str] = collections.Counter()
        self.last_metrics: dict[str, float] = {}
        self.instance_id = uuid.uuid4().hex  # a monitor sees a restart as a new id
        self.started_at = time.time()
        self.errors: collections.deque[ErrorEvent] = collections.deque(maxlen=20)
        self._last_error: str | None = None
        self._generated: collections.deque[tuple[float, int]] = collections.deque()  # (monotonic, tokens) per call
        self.record = TrainingRecord(data_dir) if not static else None
        self.checkpoints = CheckpointDir(data_dir / "checkpoints")

        self._db_thread = ThreadPoolExecutor(1, thread_name_prefix="ledger")
        self.ledger = Ledger(data_dir / "ledger.sqlite") if not static else None
        if self.ledger and self.ledger.get_meta("model") != model:
            self.ledger.set_meta("model", model)  # what `marl episode show` decodes tokens with
        saved = self.ledger.get_meta("train_config") if self.ledger else None
        self.config = TrainConfig.model_validate_json(saved) if saved else TrainConfig()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._boot_task: asyncio.Task | None = None

    @property
    def last_error(self) -> str | None:
        return self._last_error

    @last_error.setter
    def last_error(self, message: str | None) -> None:
        """Setting an error also keeps it, timestamped, in `errors` (what a monitor shows); None clears it."""
        self._last_error = message
        if message is not None:
            self.errors.append(ErrorEvent(time=time.time(), message=message))

    # --- lifecycle -----------------------------------------------------------------------------------------------

    async def startup(self) -> None:
        if self.static:
            self.state = EngineState.BOOTING
            self._boot_task = asyncio.create_task(self._boot(self.generation))
            return
        self._tasks = [asyncio.create_task(self._reaper()), asyncio.create_task(self._stepper())]

    async def shutdown(self) -> None:
        for task in [*self._tasks, self._boot_task]:
            if task:
                task.cancel()
        self._close_engine()
        if self.record:
            self.record.close()
        if self.ledger:
            await self._db(self.ledger.close)
        self._db_thread.shutdown(wait=True)

    async def _db(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._db_thread, fn, *args)

    # --- control plane -------------------------------------------------------------------------------------------

    async def sync_config(self, config: TrainConfig) -> ConfigResponse:
        self.refuse_if_static()
        changed = config != self.config
        if changed and self.state != EngineState.OFFLINE:
            raise Refusal(
                409,
                f"the engine is {self.state.value} with a different training config; stop the engine first"
                " (SwarmClient.stop_engine), then sync the new config",
                "engine_not_offline",
                state=self.state,
            )
        if changed:
            self.config = config
            await self._db(self.ledger.set_meta, "train_config", config.model_dump_json())
        return ConfigResponse(config=self.config, changed=changed)

    async def start_engine(self) -> ServerStatus:
        self.refuse_if_static()
        if self.state != EngineState.OFFLINE:
            raise Refusal(
                409,
                f"the engine is already {self.state.value}; start_engine is only valid when OFFLINE"
                " (stop it first to restart)",
                "engine_not_offline",
                state=self.state,
            )
        self.generation += 1
        self.last_error = None
        self.state = EngineState.BOOTING
        self._boot_task = asyncio.create_task(self._boot(self.generation))
        return await self.status()

    async def stop_engine(self) -> ServerStatus:
        self.refuse_if_static()
        if self._boot_task and not self._boot_task.done():
            self._boot_task.cancel()
        for lease in list(self.leases.by_episode.values()):
            self.leases.close(lease, "the engine was stopped")
            self.counters["leases_discarded"] += 1
        self.generation += 1  # anything still running for the old generation is ignored when it finishes
        self._close_engine()
        self.state = EngineState.OFFLINE
        return await self.status()

    async def _boot(self, generation: int) -> None:
        try:
            model_dir = await asyncio.to_thread(self._resolve_model, self.model)
            engine = await asyncio.to_thread(self._engine_factory, model_dir)
            trainer = None
            step = 0
            if not self.static:
                trainer = await asyncio.to_thread(self._trainer_factory, model_dir, self.config)
                latest = self.checkpoints.latest()
                if latest is not None:
                    await asyncio.to_thread(trainer.load, latest)
                    await asyncio.to_thread(engine.load_weights, trainer.named_weights())
                    log.info("resumed from checkpoint %s (step %d)", latest, trainer.step_count)
                step = trainer.step_count
                released = await self._db(self.ledger.recover, step)
                if released:
                    log.info("returned %d samples claimed by steps after %d to the pool", released, step)
            if generation != self.generation:  # stopped while booting
                engine.close()
                return
            self.engine, self.trainer, self.step = engine, trainer, step
            self.formatter = ChatFormatter(engine.tokenizer, engine.eos_token_ids)
            self.state = EngineState.STATIC if self.static else EngineState.ROLLING
            log.info("engine %s: serving %s at policy version %d", self.state.value, self.served_name, step)
            self._wake.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("engine failed to boot")
            if generation == self.generation:
                self.last_error = f"boot failed: {exc}"
                self.state = EngineState.OFFLINE

    def _close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine = self.trainer = self.formatter = None

    def refuse_if_static(self) -> None:
        if self.static:
            raise Refusal(
                409,
                "this is a static server (marl serve --static): it serves the model without leases or training",
                "static_server",
                state=self.state,
            )

    async def status(self) -> ServerStatus:
        return ServerStatus(
            state=self.state,
            model=self.served_name,
            policy_version=self.step,
            generation=self.generation,
            step=self.step,
            static=self.static,
            pool=None if self.static else await self.pool_info(),
            last_error=self.last_error,
            metrics={**{k: float(v) for k, v in self.counters.items()}, **self.last_metrics},
        )

    async def monitor(self) -> MonitorSnapshot:
        return MonitorSnapshot(
            instance_id=self.instance_id,
            started_at=self.started_at,
            status=await self.status(),
            pool=None if self.static else await self.pool_info(detailed=True),
            recent_steps=list(self.record.recent) if self.record else [],
            tokens_per_s=self.tokens_per_s(),
            rate_window_s=RATE_WINDOW_S,
            errors=list(self.errors),
            training=self._training_progress(),
        )

    def _training_progress(self) -> TrainingProgress | None:
        started = self._training
        if started is None or self.state != EngineState.WEIGHT_SYNCING:
            return None
        step, samples, since = started
        progress = getattr(self.trainer, "progress", None)
        done, total = progress if progress is not None else (None, None)
        return TrainingProgress(step=step, seconds=time.monotonic() - since, samples=samples, done=done, total=total)

    def tokens_per_s(self) -> float:
        """Generated tokens per second over the last RATE_WINDOW_S (calls that finished in the window)."""
        horizon = time.monotonic() - RATE_WINDOW_S
        while self._generated and self._generated[0][0] < horizon:
            self._generated.popleft()
        return sum(n for _, n in self._generated) / RATE_WINDOW_S

    async def pool_info(self, *, detailed: bool = False) -> PoolInfo:
        groups = await self._db(self.ledger.pool_groups)
        pending = await self._db(self.ledger.pending_episodes)
        now = time.monotonic()
        return PoolInfo(
            batch_size=self.config.batch_size,
            num_repeat=self.config.num_repeat,
            complete_groups=sum(n >= self.config.num_repeat for n in groups.values()),
            pending_episodes=pending,
            groups=[GroupProgress(job=k.job, task_id=k.task_id, agent=k.agent, episodes=n) for k, n in groups.items()]
            if detailed
            else [],
            running_leases=len(self.leases),
            free_slots=max(0, self.config.max_leases - len(self.leases)) if self.state == EngineState.ROLLING else 0,
            leases=[
                LeaseInfo(
                    episode_id=lease.episode_id,
                    client_id=lease.client_id,
                    idle_s=lease.idle_s(now),
                    patience_s=lease.patience_s,
                    calls=len(lease.calls),
                    age_s=now - lease.created_at,
                )
                for lease in self.leases.by_episode.values()
            ]
            if detailed
            else [],
            requeued=self.counters["leases_requeued"],
            discarded=self.counters["leases_discarded"],
            expired=self.counters["leases_expired"],
        )

    # --- leases --------------------------------------------------------------------------------------------------

    def begin(self, client_id: str, base_url: str) -> EpisodeLease:
        self.refuse_if_static()
        if self.state != EngineState.ROLLING:
            waiting = self.state in (EngineState.BOOTING, EngineState.ROLLING_POST, EngineState.WEIGHT_SYNCING)
            what = (
                "wait: leases resume when the engine is ROLLING"
                if waiting
                else "start the engine first (SwarmClient.auto_sync_train_config_and_start_engine)"
            )
            raise Refusal(
                503 if waiting else 409,
                f"no new leases while the engine is {self.state.value}; {what}",
                "engine_not_rolling",
                retry_after_s=1.0 if waiting else None,
                state=self.state,
            )
        try:
            lease = self.leases.open(
                client_id=client_id,
                generation=self.generation,
                patience_s=self.config.lease_patience_s,
                max_leases=self.config.max_leases,
            )
        except NoFreeSlot:
            raise Refusal(
                503,
                f"all {self.config.max_leases} lease slots are taken; wait for one to end (train.max_leases)",
                "no_free_slot",
                retry_after_s=0.5,
                state=self.state,
            ) from None
        self.counters["leases_begun"] += 1
        return EpisodeLease(
            episode_id=lease.episode_id,
            base_url=base_url.rstrip("/") + "/v1",
            api_key=lease.key,
            model=self.served_name,
            generation=lease.generation,
            patience_s=lease.patience_s,
            policy_version=self.step,
        )

    def _held_lease(self, episode_id: str, client_id: str) -> Lease:
        lease = self.leases.get(episode_id)
        if lease is None:
            raise Refusal(
                404,
                f"episode {episode_id} is not running here: it ended, was aborted, expired after"
                f" {self.config.lease_patience_s:g}s idle, or never existed; begin a new episode",
                "episode_not_found",
                state=self.state,
                param="episode_id",
            )
        if lease.client_id != client_id:
            raise Refusal(
                403,
                f"episode {episode_id} is held by another client; only its holder may end or abort it",
                "not_lease_holder",
                type="permission_error",
                state=self.state,
            )
        return lease

    async def end(self, episode_id: str, request: EndEpisodeRequest) -> EndEpisodeResponse:
        lease = self._held_lease(episode_id, request.client_id)
        self.leases.close(lease, "the episode ended")  # the key is dead from here: no call can add to it
        samples = merge_calls(episode_id, lease.calls, request.reward, request.agent_rewards)
        await self._db(
            lambda: self.ledger.record_episode(
                episode_id=episode_id,
                job=self.config.job,
                task_id=request.task_id,
                client_id=request.client_id,
                reward=request.reward,
                agent_rewards=request.agent_rewards,
                metadata=request.metadata,
                num_calls=len(lease.calls),
                samples=samples,
            )
        )
        self.counters["episodes_ended"] += 1
        self.counters["samples_recorded"] += len(samples)
        self._wake.set()
        return EndEpisodeResponse(
            episode_id=episode_id,
            samples=len(samples),
            trainable_tokens=sum(sum(s.loss_mask) for s in samples),
            pool=await self.pool_info(),
        )

    def abort(self, episode_id: str, client_id: str) -> str:
        lease = self._held_lease(episode_id, client_id)
        disposition = self._release(lease, "the episode was aborted")
        self.counters["leases_aborted"] += 1
        return disposition

    def _release(self, lease: Lease, reason: str) -> str:
        """Drop a lease without recording it: its slot is re-queued while ROLLING, discarded after the batch filled."""
        self.leases.close(lease, reason)
        disposition = "requeued" if self.state == EngineState.ROLLING else "discarded"
        self.counters[f"leases_{disposition}"] += 1
        self._wake.set()
        return disposition

    def renew(self, episode_id: str, client_id: str) -> EpisodeState:
        self._held_lease(episode_id, client_id).touch()
        return self.episode_state(episode_id)

    def episode_state(self, episode_id: str) -> EpisodeState:
        lease = self.leases.get(episode_id)
        if lease is None:
            return EpisodeState(
                episode_id=episode_id,
                can_continue=False,
                reason="the episode is not running: it ended, was aborted or expired",
                state=self.state,
            )
        return EpisodeState(
            episode_id=episode_id,
            can_continue=True,
            reason="running",
            state=self.state,
            idle_s=lease.idle_s(),
            patience_s=lease.patience_s,
        )

    # --- data plane ----------------------------------------------------------------------------------------------

    def lease_for_key(self, key: str | None) -> Lease | None:
        """The lease a data-plane key belongs to (None on a static server, which needs no lease)."""
        if self.static:
            if self.engine is None:
                raise Refusal(503, "the model is still loading; retry shortly", "engine_booting", 2.0, self.state)
            return None
        lease = self.leases.by_key(key) if key else None
        if lease is None:
            reason = self.leases.why_dead(key) if key else None
            raise Refusal(
                401,
                (f"this episode key is no longer valid: {reason}; begin a new episode" if reason else
                 "missing or unknown episode key: use the api_key that begin_episode returned"),
                "invalid_api_key",
                type="authentication_error",
                state=self.state,
            )
        return lease

    def record_call(self, lease: Lease | None, record: CallRecord) -> bool:
        """Attach a finished call to its lease; False (and nothing recorded) if the lease died meanwhile."""
        self.counters["calls"] += 1
        self.counters["tokens_generated"] += len(record.completion_ids)
        self._generated.append((time.monotonic(), len(record.completion_ids)))
        self.counters["tokens_prompt"] += len(record.prompt_ids)
        if lease is None:
            return True
        if not self.leases.is_live(lease):
            self.counters["calls_discarded"] += 1
            return False
        lease.calls.append(record)
        lease.touch()
        return True

    # --- background: expiry and the train/sync cycle --------------------------------------------------------------

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(_REAP_INTERVAL_S)
            for lease in self.leases.expired():
                self._release(lease, f"the lease expired after {lease.patience_s:g}s without activity")
                self.counters["leases_expired"] += 1
                log.info("lease %s expired", lease.episode_id)

    async def _stepper(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                if self.state == EngineState.ROLLING and len(await self._ready_groups()) >= self.config.batch_size:
                    self.state = EngineState.ROLLING_POST
                    log.info("batch complete: draining %d running leases", len(self.leases))
                if self.state == EngineState.ROLLING_POST and not len(self.leases):
                    await self._train_step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("training step failed")
                self.last_error = f"training step {self.step + 1} failed: {exc}"
                await self._db(self.ledger.recover, self.step)  # the step never happened: its samples go back
                if self.state != EngineState.OFFLINE:
                    await self.stop_engine()
                    self.last_error = f"training step {self.step + 1} failed: {exc}; fix it and start the engine again"

    async def _ready_groups(self) -> list[GroupKey]:
        groups = await self._db(self.ledger.pool_groups)
        return [key for key, n in groups.items() if n >= self.config.num_repeat]

    async def _train_step(self) -> None:
        self.state = EngineState.WEIGHT_SYNCING
        generation, step, config = self.generation, self.step + 1, self.config
        engine, trainer = self.engine, self.trainer
        dropped = await self._db(self.ledger.drop_stale, self.step - config.max_staleness)
        ready = (await self._ready_groups())[: config.batch_size]
        if len(ready) < config.batch_size:  # stale samples were dropped: roll on until the batch refills
            self.counters["samples_dropped_stale"] += dropped
            self.state = EngineState.ROLLING
            return
        claimed = await self._db(self.ledger.claim_batch, step, ready)
        batch = TrainBatch(
            step=step,
            groups=[Group(job=k.job, task_id=k.task_id, agent=k.agent, samples=s) for k, s in claimed.items()],
            dropped_stale=dropped,
        )
        log.info("step %d: training on %d groups", step, len(batch.groups))
        self._training = (step, sum(len(g.samples) for g in batch.groups), time.monotonic())
        try:
            metrics = await asyncio.to_thread(trainer.step, batch)
        finally:
            self._training = None
        await asyncio.to_thread(engine.load_weights, trainer.named_weights())
        release_freed_memory()
        if config.save_freq and step % config.save_freq == 0:
            await asyncio.to_thread(self.checkpoints.save, trainer, step, config.keep_checkpoints)
        await self._db(self.ledger.commit_step, step, metrics)
        if generation != self.generation:
            return  # stopped meanwhile; recovery at the next boot sorts out the claim
        self.counters["samples_dropped_stale"] += dropped
        self.counters["train_steps"] += 1
        self.last_metrics = {k: float(v) for k, v in metrics.items()}
        self.record.append(step, self.last_metrics)
        self.step = step
        self.state = EngineState.ROLLING
        log.info("step %d done: %s", step, json.dumps({k: round(v, 4) for k, v in self.last_metrics.items()}))
        self._wake.set()
