"""The rollout pool: the leases of running episodes, and how far the pool is from the next training step.

`RolloutPool` grants leases while the engine is ROLLING (at most `max_leases` at once), aborts, renews and expires
them, admits data-plane calls by their episode key, closes a lease once its episode is recorded (the recording
itself is `servers.episodes.recorder`'s), and says how far the pool is from the next training step (`info`). A lease
that closes wakes the train loop (`servers.training.batch_wakeup.BatchWakeup`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from marl.protocol import (
    RUNNING_STATES,
    AbortEpisodeResponse,
    EngineState,
    EpisodeLease,
    EpisodeState,
    ErrorCode,
    GroupProgress,
    LeaseInfo,
    PoolInfo,
)
from servers.episodes.leases import Lease, LeaseTable, NoFreeSlot
from servers.episodes.ledger import LedgerThread
from servers.episodes.prepared import PreparedEpisodes
from servers.errors import Refusal
from servers.metrics.telemetry import Counters
from servers.training.batch_wakeup import BatchWakeup
from servers.training.lifecycle import EngineLifecycle

log = logging.getLogger("marl.server")

_REAP_INTERVAL_S = 0.25


class RolloutPool:
    def __init__(self, lifecycle: EngineLifecycle, ledger: LedgerThread, prepared: PreparedEpisodes, counters: Counters,
                 wakeup: BatchWakeup, public_url: str | None = None, id_prefix: str = ""):
        self.leases = LeaseTable(id_prefix)
        self._lifecycle = lifecycle
        self._ledger = ledger
        self._prepared = prepared
        self._counters = counters
        self._wakeup = wakeup
        self._public_url = public_url  # base of the URLs handed to agents; default: the URL the client used
        #: `overlap`: leases that may run while a step trains before their samples would be too stale to train
        #: (set by the train loop; None: no bound)
        self.rollout_room: int | None = None

    # --- leases --------------------------------------------------------------------------------------------------

    def begin(self, client_id: str, request_url: str) -> EpisodeLease:
        state, config = self._lifecycle.state, self._lifecycle.config
        if state != EngineState.ROLLING:
            waiting = state == EngineState.BOOTING or state in RUNNING_STATES  # draining or training: soon again
            what = ("wait: leases resume when the engine is ROLLING" if waiting
                    else "start the engine first (SwarmClient.auto_sync_train_config_and_start_engine)")
            raise Refusal(503 if waiting else 409, ErrorCode.ENGINE_NOT_ROLLING,
                          f"no new leases while the engine is {state.value}; {what}",
                          retry_after_s=1.0 if waiting else None, state=state)
        if self.rollout_room is not None and len(self.leases) >= self.rollout_room:
            raise Refusal(503, ErrorCode.ROLLOUTS_AHEAD, f"a step trains and {len(self.leases)} running episodes plus"
                          " those waiting in the pool fill the batches of the next steps: one begun now would be"
                          f" trained more than {config.max_staleness} versions late (train.max_staleness)",
                          retry_after_s=0.5, state=state)
        try:
            lease = self.leases.open(client_id=client_id, generation=self._lifecycle.generation,
                                     patience_s=config.lease_patience_s, max_leases=config.max_leases,
                                     policy_version=self._lifecycle.policy_version)
        except NoFreeSlot:
            raise Refusal(503, ErrorCode.NO_FREE_SLOT, f"all {config.max_leases} lease slots are taken; wait for one"
                          " to end (train.max_leases)", retry_after_s=0.5, state=state) from None
        self._counters.leases_begun += 1
        return EpisodeLease(episode_id=lease.episode_id, base_url=(self._public_url or request_url).rstrip("/") + "/v1",
                            api_key=lease.key, model=self._lifecycle.served_name, generation=lease.generation,
                            patience_s=lease.patience_s, policy_version=self._lifecycle.policy_version)

    def abort(self, lease: Lease) -> AbortEpisodeResponse:
        """Discard a held lease unrecorded (see `held`)."""
        disposition = self._release(lease, "the episode was aborted")
        self._counters.leases_aborted += 1
        return AbortEpisodeResponse(episode_id=lease.episode_id, disposition=disposition)

    def finish(self, lease: Lease, reason: str) -> None:
        """Close the lease of an episode that is now recorded (ended or prepared)."""
        self.leases.close(lease, reason)
        self._wakeup.wake()  # a lease closed (and an ended episode entered the pool)

    def renew(self, episode_id: str, client_id: str) -> EpisodeState:
        self.held(episode_id, client_id).touch()
        return self.episode_state(episode_id)

    def episode_state(self, episode_id: str) -> EpisodeState | None:
        """The state of a running episode; None when it has no live lease."""
        lease = self.leases.get(episode_id)
        if lease is None:
            return None
        return EpisodeState(episode_id=episode_id, can_continue=not lease.sealed, state=self._lifecycle.state,
                            reason="being ended" if lease.sealed else "running", idle_s=lease.idle_s(),
                            patience_s=lease.patience_s)

    def close_all(self, reason: str) -> None:
        """Drop every lease unrecorded (the engine stops): counted as discarded (a sealed one is being recorded)."""
        for lease in list(self.leases.by_episode.values()):
            self.leases.close(lease, reason)
            self._counters.leases_discarded += not lease.sealed

    async def expire_idle_leases(self) -> None:
        """Forever: release leases idle longer than their patience (their slot is re-queued while ROLLING)."""
        while True:
            await asyncio.sleep(_REAP_INTERVAL_S)
            for lease in self.leases.expired():
                self._release(lease, f"the lease expired after {lease.patience_s:g}s without activity")
                self._counters.leases_expired += 1
                log.info("lease %s expired", lease.episode_id)

    def held(self, episode_id: str, client_id: str) -> Lease:
        """The live lease of `episode_id` if `client_id` holds it; 404 if it is not running, 403 if not theirs."""
        lease = self.leases.get(episode_id)
        if lease is None:
            raise self.not_running(episode_id)
        if lease.client_id != client_id:
            raise self.not_holder(episode_id)
        return lease

    def not_running(self, episode_id: str) -> Refusal:
        closed = self.leases.why_closed(episode_id)
        why = (f"its lease closed: {closed}" if closed else "it ended, was aborted, expired after"
               f" {self._lifecycle.config.lease_patience_s:g}s idle, or never existed")
        return Refusal(404, ErrorCode.EPISODE_NOT_FOUND, f"episode {episode_id} is not running here: {why}; begin a"
                       " new episode", state=self._lifecycle.state, param="episode_id")

    def not_holder(self, episode_id: str) -> Refusal:
        return Refusal(403, ErrorCode.NOT_LEASE_HOLDER, f"episode {episode_id} is held by another client; only its"
                       " holder may end, prepare, commit or abort it", state=self._lifecycle.state)

    def _release(self, lease: Lease, reason: str) -> str:
        """Drop a lease without recording it: its slot is re-queued while ROLLING, discarded after the batch filled."""
        disposition = "requeued" if self._lifecycle.state == EngineState.ROLLING else "discarded"
        self.leases.close(lease, reason)
        if disposition == "requeued":
            self._counters.leases_requeued += 1
        else:
            self._counters.leases_discarded += 1
        self._wakeup.wake()  # a lease closed
        return disposition

    # --- the data plane ------------------------------------------------------------------------------------------

    def admit(self, api_key: str | None) -> Lease:
        """The live lease a data-plane key belongs to; a dead or unknown key is refused, saying why."""
        lease = self.leases.by_key(api_key) if api_key else None
        if lease is not None and not lease.sealed:
            return lease
        if lease is not None:
            raise Refusal(401, ErrorCode.INVALID_API_KEY, "this episode is being ended: its key takes no more calls",
                          state=self._lifecycle.state)
        reason = self.leases.why_dead(api_key) if api_key else None
        raise Refusal(401, ErrorCode.INVALID_API_KEY,
                      f"this episode key is no longer valid: {reason}; begin a new episode" if reason else
                      "missing or unknown episode key: use the api_key that begin_episode returned",
                      state=self._lifecycle.state)

    # --- progress towards the next step --------------------------------------------------------------------------

    async def info(self, *, detailed: bool = False) -> PoolInfo:
        config = self._lifecycle.config
        groups = await self._ledger.pool_groups()
        pending = await self._ledger.pending_episodes()
        prepared = await self._ledger.run(self._prepared.count)
        rolling = self._lifecycle.state == EngineState.ROLLING
        return PoolInfo(
            batch_size=config.batch_size,
            num_repeat=config.num_repeat,
            complete_groups=sum(n >= config.num_repeat for n in groups.values()),
            pending_episodes=pending,
            groups=[GroupProgress(job=k.job, task_id=k.task_id, agent=k.agent, episodes=n)
                    for k, n in groups.items()] if detailed else [],
            running_leases=len(self.leases),
            free_slots=max(0, config.max_leases - len(self.leases)) if rolling else 0,
            leases=self._lease_infos() if detailed else [],
            requeued=self._counters.leases_requeued,
            discarded=self._counters.leases_discarded,
            expired=self._counters.leases_expired,
            prepared_episodes=prepared,
        )

    def _lease_infos(self) -> list[LeaseInfo]:
        now = time.monotonic()
        return [LeaseInfo(episode_id=lease.episode_id, client_id=lease.client_id, idle_s=lease.idle_s(now),
                          patience_s=lease.patience_s, calls=len(lease.calls), age_s=now - lease.created_at)
                for lease in self.leases.by_episode.values()]
