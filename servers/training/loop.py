"""The train loop: from a full pool to new weights being served.

Woken whenever its next move may have become possible (`BatchWakeup`, servers.training.batch_wakeup: the one rule), it
moves the engine ROLLING → ROLLING_POST once `batch_size` groups hold `num_repeat` episodes each, waits for the running
leases to drain, then in WEIGHT_SYNCING drops samples too stale to train on, claims the batch in the ledger, trains
(in a thread), publishes the new weights to the engine, checkpoints every `save_freq` steps, and rolls on at policy
version + 1.

With `overlap` (TrainConfig.overlap) there is no drain: once the pool holds a full batch the step runs in a task of
its own while the engine stays ROLLING (leases begin, call and end on the current weights), and the new weights
replace the old between two generations (the engines let running generations finish first). One step at a time.

If a step fails, its claims return to the pool, the engine stops, and `last_error` says why.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from marl.protocol import RUNNING_STATES, EngineState, TrainingProgress
from servers.backends import Group, InferenceEngine, TrainBatch, Trainer
from servers.episodes.ledger import GroupKey, LedgerThread
from servers.episodes.rollout_pool import RolloutPool
from servers.metrics.telemetry import Telemetry
from servers.metrics.training_record import TrainingRecord
from servers.training.batch_wakeup import BatchWakeup  # re-exported: it was defined here
from servers.training.lifecycle import EngineLifecycle

log = logging.getLogger("marl.server")


class TrainLoop:
    def __init__(self, *, lifecycle: EngineLifecycle, pool: RolloutPool, ledger: LedgerThread, record: TrainingRecord,
                 telemetry: Telemetry, wakeup: BatchWakeup, stop_engine: Callable[[], Awaitable[object]]):
        self._lifecycle = lifecycle
        self._pool = pool
        self._ledger = ledger
        self._record = record
        self._telemetry = telemetry
        self._wakeup = wakeup
        self._stop_engine = stop_engine  # closes the leases too
        self._training: tuple[int, int, float] | None = None  # (step, samples, monotonic start) while one runs
        self._overlapped: asyncio.Task | None = None  # the step running beside the rollouts (`overlap`)
        self._idle_mark: tuple[float, float] | None = None  # the generation clock at the last step's end
        self._restart_copy: asyncio.Task | None = None  # exporting the weights just pushed (`_keep_restart_copy`)

    async def run(self) -> None:
        """Forever: on every wake-up, drain once the batch is complete, and train once the leases are gone."""
        try:
            while True:
                await self._wakeup.wait()
                await self._guarded(self._advance())
        finally:
            for task in (self._overlapped, self._restart_copy):
                if task is not None:
                    task.cancel()

    async def _advance(self) -> None:
        lifecycle = self._lifecycle
        silent = await self._ledger.drop_silent(lifecycle.config.num_repeat)
        if silent:  # a role that never speaks must not fill the pool with groups nothing can train on
            self._telemetry.counters.episodes_silent += silent
            log.info("dropped %d episodes of groups in which the agent never called the model", silent)
        if lifecycle.config.overlap:
            if self._overlapped is not None:
                await self._bound_rollouts()
            elif (lifecycle.state == EngineState.ROLLING
                    and len(await self._ready_groups()) >= lifecycle.config.batch_size):  # fmt: skip
                self._overlapped = asyncio.create_task(self._overlapped_step())
            return
        if lifecycle.state == EngineState.ROLLING and len(await self._ready_groups()) >= lifecycle.config.batch_size:
            lifecycle.move_to(EngineState.ROLLING_POST)
            log.info("batch complete: draining %d running leases", len(self._pool.leases))
        if lifecycle.state == EngineState.ROLLING_POST and not len(self._pool.leases):
            await self._train_step()

    async def _guarded(self, work: Awaitable[None]) -> None:
        """Await a step's work: a failure fails the step (`_step_failed`), never the loop that runs it."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._step_failed(exc)

    async def _ready_groups(self) -> list[GroupKey]:
        groups = await self._ledger.pool_groups()
        return [key for key, n in groups.items() if n >= self._lifecycle.config.num_repeat]

    async def _overlapped_step(self) -> None:
        """A step beside the rollouts; the loop looks again when it is done (the pool may hold the next batch)."""
        try:
            await self._guarded(self._train_step(overlap=True))
        finally:
            self._overlapped = None
            self._pool.rollout_room = None
            self._wakeup.wake()

    async def _bound_rollouts(self) -> None:
        """While an overlapped step trains on version v: an episode begun now is trained after every episode pending
        or running, at a step that starts `1 + (pending + running) // batch` versions later. `max_staleness` caps
        that, so the pool refuses a lease (503 rollouts_ahead) once pending + running reach `max_staleness`
        batches: rollouts run at most that far ahead of training instead of generating samples to be dropped."""
        config = self._lifecycle.config
        pending = await self._ledger.pending_episodes()
        self._pool.rollout_room = config.max_staleness * config.batch_size * config.num_repeat - pending

    async def _train_step(self, overlap: bool = False) -> None:
        """Claim a batch, train, publish, checkpoint. Drained (WEIGHT_SYNCING, no lease open), or with `overlap`
        while ROLLING (no state change; vLLM is not put to sleep: generation goes on)."""
        lifecycle, counters = self._lifecycle, self._telemetry.counters
        if not overlap:
            lifecycle.move_to(EngineState.WEIGHT_SYNCING)
        generation, step, config = lifecycle.generation, lifecycle.policy_version + 1, lifecycle.config
        served, trainer = lifecycle.engine, lifecycle.trainer  # a stop meanwhile clears them from the lifecycle
        dropped = await self._ledger.drop_stale(lifecycle.policy_version - config.max_staleness)
        counters.samples_dropped_stale += dropped
        ready = (await self._ready_groups())[: config.batch_size]
        if len(ready) < config.batch_size:  # stale samples were dropped: roll on until the batch refills
            if not overlap:
                lifecycle.move_to(EngineState.ROLLING)
            return
        claimed = await self._ledger.claim_batch(step, ready)
        if overlap:
            await self._bound_rollouts()
        batch = TrainBatch(step=step, dropped_stale=dropped, groups=[
            Group(job=k.job, task_id=k.task_id, agent=k.agent, samples=s) for k, s in claimed.items()])
        if not overlap:
            await asyncio.to_thread(served.before_training_step)
        metrics = await self._train(batch, trainer)
        if generation != lifecycle.generation:
            return  # stopped meanwhile: the next boot returns the claim to the pool
        # the step's cached device memory back to the driver before an engine on the same GPU wakes to take weights
        metrics.update(await asyncio.to_thread(trainer.release_memory))
        await self._publish(served, trainer)
        await asyncio.to_thread(release_freed_memory)
        if config.save_freq and step % config.save_freq == 0:
            await asyncio.to_thread(lifecycle.checkpoints.save, trainer, step, config.keep_checkpoints)
            if config.keep_sample_tokens_steps is not None:  # only steps the checkpoint holds: never recovered
                await self._ledger.compact(step - config.keep_sample_tokens_steps)
        if generation != lifecycle.generation:
            return
        counters.train_steps += 1
        counters.train_steps_empty += metrics.get("tokens_trained") == 0  # counted, never shown as progress
        self._record.append(step, {**metrics, **self._rollout_idle()})
        if overlap:
            # Still ROLLING. Set after the checkpoint, so a version a client sees is one a restart comes back to; a
            # call that began on the new weights before this records the old version, and the next step weighs its
            # tokens as stale against pi_start, which is the policy that sampled them (w = 1: grpo.py, step 2).
            lifecycle.policy_version = step
        else:
            lifecycle.serve_version(step)
        log.info("step %d done: %s", step, json.dumps({k: round(v, 4) for k, v in metrics.items()}))
        self._wakeup.wake()  # ROLLING again

    async def _publish(self, served: InferenceEngine, trainer: Trainer) -> None:
        """The step's weights to the engine: pushed through vLLM's weight-transfer engine where both sides can (an
        engine with `push_weights`, a trainer with `push_weights`: servers.engines.weight_transfer), else, or when
        the push failed (the engine logs and counts it), as the lifecycle publishes them (tensors, or a directory)."""
        pushed, push = getattr(served, "push_weights", None), getattr(trainer, "push_weights", None)
        if pushed is not None and push is not None and await asyncio.to_thread(pushed, push):
            self._restart_copy = asyncio.create_task(self._keep_restart_copy(served, trainer))
            return
        await self._lifecycle.publish_weights(served, trainer)

    async def _keep_restart_copy(self, served: InferenceEngine, trainer: Trainer) -> None:
        """After a push: export the weights just pushed for the engine to restart with (a push leaves it no file),
        while the rollouts run; the next step waits for this before it changes the trainer's weights."""
        exported = None
        scratch = tempfile.TemporaryDirectory(prefix=".weights-", dir=self._lifecycle.data_dir)
        try:
            exported = await asyncio.to_thread(trainer.export_weights, Path(scratch.name))
        except Exception:  # noqa: BLE001 - the engine then cannot restart, and says so; serving goes on
            log.exception("could not export the pushed weights for a vLLM restart")
        try:
            await asyncio.to_thread(served.keep_restart_copy, exported)  # type: ignore[attr-defined]
        finally:
            await asyncio.to_thread(scratch.cleanup)

    async def _train(self, batch: TrainBatch, trainer: Trainer) -> dict[str, float]:
        if self._restart_copy is not None:  # the last push's copy, from the weights this step is about to change
            await self._restart_copy
            self._restart_copy = None
        samples = sum(len(g.samples) for g in batch.groups)
        log.info("step %d: training on %d groups (%d samples)", batch.step, len(batch.groups), samples)
        self._training = (batch.step, samples, time.monotonic())
        try:
            metrics = await asyncio.to_thread(trainer.step, batch)
        finally:
            self._training = None
        return {k: float(v) for k, v in metrics.items()}

    def _rollout_idle(self) -> dict[str, float]:
        """`rollout_idle_frac`: the share of the time since the last step's end (or the first generation) in which
        no generation ran on this server: the drain and the drained step, or none of them with `overlap`."""
        clock = self._telemetry.generation
        idle, self._idle_mark = clock.idle_fraction(self._idle_mark), clock.mark()
        return {} if idle is None else {"rollout_idle_frac": idle}

    async def _step_failed(self, exc: Exception) -> None:
        log.exception("training step failed")
        step = self._lifecycle.policy_version + 1
        await self._ledger.recover(self._lifecycle.policy_version)  # the step never happened: its samples go back
        if self._lifecycle.state in RUNNING_STATES:
            await self._stop_engine()
        self._telemetry.errors.report(f"training step {step} failed: {exc}; fix it and start the engine again")

    def progress(self) -> TrainingProgress | None:
        """The step running now, for a monitor (None between steps)."""
        started = self._training
        if started is None or not (self._lifecycle.state == EngineState.WEIGHT_SYNCING or self._overlapped):
            return None
        step, samples, since = started
        progress = getattr(self._lifecycle.trainer, "progress", None)
        done, total = progress if progress is not None else (None, None)
        return TrainingProgress(step=step, seconds=time.monotonic() - since, samples=samples, done=done, total=total)


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
