"""How a running episode is recorded, exactly once: `end` in one step, or `prepare` then `commit` or `abort` (this
server's half of a game's two-phase commit).

One step, whole or not at all. The body was validated before anything happens (`marl.protocol`: finite rewards,
encodable text); then the episode's calls are merged into samples and written to the ledger together with the
digest of the body, in one transaction, and only once that has committed is the lease closed. While the write runs
the lease is sealed (its key takes no new calls, it never expires); if the write fails, the lease is live again and
the client may retry (503 `ledger_unavailable`).

No served call is dropped. A call of the lease that is still generating when `end` (or `prepare`) arrives is waited
for, at most `CALLS_WAIT_S`, and recorded with the episode; calls that would start meanwhile are refused (the key is
sealed). If some call still generates after that wait, nothing is recorded, the lease is live again, and the request
is refused with 503 `calls_in_flight` and `retry_after_s`: `SwarmClient` retries it, and the retry records the call.

Idempotent. A repeated end, prepare, commit or abort gets the outcome the first one had: from the write still in
flight, else from the ledger (so even after a restart). The same body is answered 200 with `replayed: true`; a
different body for an episode already recorded is refused with 409 `episode_already_ended`.

Prepared episodes left unresolved past their deadline are resolved by `servers.episodes.overdue`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import sqlite3
from collections.abc import Awaitable, Callable
from typing import Any

from marl.protocol import (
    AbortEpisodeResponse,
    EndEpisodeRequest,
    EndEpisodeResponse,
    EpisodePhase,
    EpisodeState,
    ErrorCode,
    PrepareEpisodeRequest,
    PrepareEpisodeResponse,
)
from servers.episodes.leases import Lease
from servers.episodes.ledger import LedgerThread, RecordedEpisode, trainable_tokens
from servers.episodes.prepared import PreparedEpisodes
from servers.episodes.rollout_pool import RolloutPool
from servers.episodes.samples import merge_calls
from servers.errors import Refusal
from servers.metrics.telemetry import Counters
from servers.training.batch_wakeup import BatchWakeup
from servers.training.lifecycle import EngineLifecycle

log = logging.getLogger("marl.server")

#: Writes an ended or prepared episode: (lease, body, samples, body digest) -> the episode as recorded.
Write = Callable[[Lease, Any, list, str], Awaitable[RecordedEpisode]]

#: How long `end` or `prepare` waits for the lease's calls still generating before it answers 503 `calls_in_flight`
#: (well under a client's request timeout, 30 s by default, so that the answer arrives).
CALLS_WAIT_S = 10.0
_CALLS_RETRY_S = 1.0

_PHASE_WORDS = {EpisodePhase.PREPARED: "prepared", EpisodePhase.ENDED: "ended (it is in the pool)",
                EpisodePhase.ABORTED: "prepared, then aborted"}


def body_digest(body: EndEpisodeRequest) -> str:
    """What tells a repeated request from a different one: a hash of the validated body, keys sorted."""
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class EpisodeRecorder:
    def __init__(self, *, pool: RolloutPool, lifecycle: EngineLifecycle, ledger: LedgerThread,
                 prepared: PreparedEpisodes, counters: Counters, wakeup: BatchWakeup):
        self._pool = pool
        self.calls_wait_s = CALLS_WAIT_S
        self._lifecycle = lifecycle
        self._ledger = ledger
        self._prepared = prepared
        self._counters = counters
        self._wakeup = wakeup
        #: episode id -> (body digest, outcome) while its end or prepare is being written
        self._writing: dict[str, tuple[str, asyncio.Future[RecordedEpisode]]] = {}

    async def end(self, episode_id: str, body: EndEpisodeRequest, *, include_pool: bool = False) -> EndEpisodeResponse:
        recorded, replayed = await self._record(episode_id, body, self._write_end, "the episode ended")
        return EndEpisodeResponse(episode_id=episode_id, samples=recorded.samples,
                                  trainable_tokens=recorded.trainable_tokens,
                                  pool=await self._pool.info() if include_pool else None, replayed=replayed)

    async def prepare(self, episode_id: str, body: PrepareEpisodeRequest) -> PrepareEpisodeResponse:
        recorded, replayed = await self._record(episode_id, body, self._write_prepared,
                                                f"the episode was prepared (game {body.game_id})")
        return PrepareEpisodeResponse(episode_id=episode_id, samples=recorded.samples,
                                      trainable_tokens=recorded.trainable_tokens, deadline=recorded.deadline or 0.0,
                                      replayed=replayed)

    async def commit(self, episode_id: str, client_id: str, *, include_pool: bool = False) -> EndEpisodeResponse:
        if self._pool.leases.get(episode_id) is not None:
            self._pool.held(episode_id, client_id)
            raise Refusal(409, ErrorCode.EPISODE_NOT_PREPARED, f"episode {episode_id} is still running: prepare it"
                          " first (or end it)", state=self._lifecycle.state)
        recorded, committed = await self._ledger.run(self._prepared.commit, episode_id, client_id)
        recorded = self._check_recorded(episode_id, client_id, recorded)
        if recorded.phase is EpisodePhase.ABORTED:
            raise self._aborted(episode_id)
        if committed:
            self.count_committed(recorded)
        return EndEpisodeResponse(episode_id=episode_id, samples=recorded.samples,
                                  trainable_tokens=recorded.trainable_tokens,
                                  pool=await self._pool.info() if include_pool else None, replayed=not committed)

    async def abort(self, episode_id: str, client_id: str) -> AbortEpisodeResponse:
        if self._pool.leases.get(episode_id) is not None:
            self._pool.held(episode_id, client_id)
            if await self._recorded_meanwhile(episode_id):
                raise self._already_ended(episode_id, "it was recorded while this abort waited for its end")
            return self._pool.abort(self._pool.held(episode_id, client_id))
        recorded, aborted = await self._ledger.run(self._prepared.abort, episode_id, client_id)
        recorded = self._check_recorded(episode_id, client_id, recorded)
        if recorded.phase is EpisodePhase.ENDED:
            raise self._already_ended(episode_id, "it is in the pool; an ended episode cannot be aborted")
        self._counters.prepared_aborted += aborted
        return AbortEpisodeResponse(episode_id=episode_id, disposition="discarded", replayed=not aborted)

    async def episode_state(self, episode_id: str) -> EpisodeState:
        running = self._pool.episode_state(episode_id)
        if running is not None:
            return running
        recorded = await self._ledger.run(self._prepared.find, episode_id)
        if recorded is not None:
            return EpisodeState(episode_id=episode_id, can_continue=False, state=self._lifecycle.state,
                                reason=_PHASE_WORDS[recorded.phase], phase=recorded.phase)
        return EpisodeState(episode_id=episode_id, can_continue=False, state=self._lifecycle.state,
                            reason=self._pool.not_running(episode_id).message, phase=EpisodePhase.GONE)

    def count_committed(self, recorded: RecordedEpisode) -> None:
        """A prepared episode entered the pool (committed by its client, or by the server at its deadline)."""
        self._counters.episodes_ended += 1
        self._counters.samples_recorded += recorded.samples
        self._wakeup.wake()  # an episode entered the pool

    # --- one step, whole or not at all ---------------------------------------------------------------------------

    async def _record(self, episode_id: str, body: EndEpisodeRequest, write: Write,
                      reason: str) -> tuple[RecordedEpisode, bool]:
        """Record the episode with `write` and close its lease; or the outcome a first identical request had."""
        digest = body_digest(body)
        if self._pool.leases.get(episode_id) is None:
            recorded = await self._ledger.run(self._prepared.find, episode_id)
            return self._replayed(episode_id, body.client_id, digest, recorded), True
        lease = self._pool.held(episode_id, body.client_id)
        if episode_id in self._writing:
            return await self._join(episode_id, digest), True
        outcome: asyncio.Future[RecordedEpisode] = asyncio.get_running_loop().create_future()
        self._writing[episode_id] = (digest, outcome)
        lease.sealed = True
        try:
            await self._drained(lease)
            samples = merge_calls(episode_id, _finite_calls(lease), body.reward, body.agent_rewards,
                                  policy_version=lease.policy_version)
            recorded = await self._written(write(lease, body, samples, digest))
        except BaseException as exc:
            lease.sealed = False  # nothing was recorded: the lease goes on, and the client may retry
            _fail(outcome, exc)
            raise
        finally:
            del self._writing[episode_id]
        self._pool.finish(lease, reason)
        outcome.set_result(recorded)
        return recorded, False

    async def _join(self, episode_id: str, digest: str) -> RecordedEpisode:
        """Wait for the end or prepare of this episode that is being written (a retry whose first try goes on)."""
        first_digest, outcome = self._writing[episode_id]
        if first_digest != digest:
            raise self._already_ended(episode_id, "an end or prepare with another body is being written")
        return await asyncio.shield(outcome)

    async def _recorded_meanwhile(self, episode_id: str) -> bool:
        """Wait for an end or prepare in flight, if any: True if it recorded the episode."""
        writing = self._writing.get(episode_id)
        if writing is None:
            return False
        try:
            await asyncio.shield(writing[1])
        except Exception:
            return False
        return True

    async def _drained(self, lease: Lease) -> None:
        """Wait for the lease's calls still generating (the sealed lease starts no new one); refuse if they outlast
        `calls_wait_s`."""
        if not await lease.drained(self.calls_wait_s):
            raise Refusal(503, ErrorCode.CALLS_IN_FLIGHT, f"episode {lease.episode_id} still has {lease.inflight}"
                          f" model call(s) generating after {self.calls_wait_s:g}s: nothing was recorded and the lease"
                          " is still live; retry, and the calls are recorded once they finish",
                          retry_after_s=_CALLS_RETRY_S, state=self._lifecycle.state)

    async def _written(self, write: Awaitable[RecordedEpisode]) -> RecordedEpisode:
        try:
            return await write
        except (sqlite3.Error, OSError) as exc:
            log.exception("the ledger could not record an episode")
            raise Refusal(503, ErrorCode.LEDGER_UNAVAILABLE, f"the ledger could not record the episode ({exc});"
                          " nothing was recorded and the lease is still live: retry", retry_after_s=1.0,
                          state=self._lifecycle.state) from exc

    async def _write_end(self, lease: Lease, body: EndEpisodeRequest, samples: list, digest: str) -> RecordedEpisode:
        await self._ledger.record_episode(**self._episode_fields(lease, body), samples=samples, request_digest=digest)
        self._counters.episodes_ended += 1
        self._counters.samples_recorded += len(samples)
        return RecordedEpisode(EpisodePhase.ENDED, body.client_id, digest, len(samples), trainable_tokens(samples))

    async def _write_prepared(self, lease: Lease, body: PrepareEpisodeRequest, samples: list,
                              digest: str) -> RecordedEpisode:
        recorded = await self._ledger.run(
            self._prepared.prepare, game_id=body.game_id, timeout_s=body.timeout_s, decision_log=body.decision_log,
            request_digest=digest, samples=samples, **self._episode_fields(lease, body))
        self._counters.episodes_prepared += 1
        return recorded

    def _episode_fields(self, lease: Lease, body: EndEpisodeRequest) -> dict[str, Any]:
        return dict(episode_id=lease.episode_id, job=self._lifecycle.config.job, task_id=body.task_id,
                    client_id=body.client_id, reward=body.reward, agent_rewards=body.agent_rewards,
                    metadata=body.metadata, num_calls=len(lease.calls))

    # --- answers from the ledger ---------------------------------------------------------------------------------

    def _replayed(self, episode_id: str, client_id: str, digest: str,
                  recorded: RecordedEpisode | None) -> RecordedEpisode:
        recorded = self._check_recorded(episode_id, client_id, recorded)
        if recorded.request_digest != digest:
            raise self._already_ended(episode_id, f"it was {_PHASE_WORDS[recorded.phase]} with another body")
        if recorded.phase is EpisodePhase.ABORTED:
            raise self._aborted(episode_id)
        return recorded

    def _check_recorded(self, episode_id: str, client_id: str, recorded: RecordedEpisode | None) -> RecordedEpisode:
        if recorded is None:
            raise self._pool.not_running(episode_id)
        if recorded.client_id != client_id:
            raise self._pool.not_holder(episode_id)
        return recorded

    def _already_ended(self, episode_id: str, why: str) -> Refusal:
        return Refusal(409, ErrorCode.EPISODE_ALREADY_ENDED, f"episode {episode_id} cannot change any more: {why}."
                       " Resending the very same request is safe and returns the stored outcome",
                       state=self._lifecycle.state)

    def _aborted(self, episode_id: str) -> Refusal:
        return Refusal(409, ErrorCode.EPISODE_ABORTED, f"prepared episode {episode_id} was aborted (by its client, or"
                       " by this server when its deadline passed undecided): it will never enter the pool",
                       state=self._lifecycle.state)


def _finite_calls(lease: Lease) -> list:
    """The lease's calls whose logprobs are all finite. A NaN or inf logprob (an adapter that diverged) cannot be
    trained on, so such a call is never recorded as a sample (its tokens still reach later calls' prompts, as
    context). A sum is finite exactly when every term is (logprobs are far from overflowing it)."""
    calls = [call for call in lease.calls if math.isfinite(sum(call.logprobs, 0.0))]
    if len(calls) < len(lease.calls):
        log.warning("episode %s: %d call(s) with non-finite logprobs are left out of its samples", lease.episode_id,
                    len(lease.calls) - len(calls))
    return calls


def _fail(outcome: asyncio.Future, exc: BaseException) -> None:
    """Pass a failed write on to the identical requests waiting for it."""
    if isinstance(exc, asyncio.CancelledError):
        outcome.cancel()
        return
    outcome.set_exception(exc)
    outcome.exception()  # retrieved: nobody may be waiting, and that is fine
