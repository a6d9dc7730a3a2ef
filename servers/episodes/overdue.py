"""Prepared episodes that nobody committed or aborted by their deadline, resolved by the server itself.

Every second `OverdueResolver.run` looks for prepared episodes past their deadline (`servers.episodes.prepared`) and
asks the decision log their prepare named (`marl.decision_record.read_decision`): COMMIT commits the episode, ABORT or
no decision aborts it; a prepare that named no log is aborted (presumed abort). A log this server cannot read (it
cannot see the coordinator's run directory) leaves the episode prepared: presuming either way could break the game's
atomicity, so it waits for the coordinator's re-drive, and the log is read again at every pass.
"""

from __future__ import annotations

import asyncio
import logging
import time

from marl.decision_record import Decision, DecisionLogUnreadable, read_decision
from servers.episodes.ledger import LedgerThread
from servers.episodes.prepared import Overdue, PreparedEpisodes
from servers.episodes.recorder import EpisodeRecorder
from servers.metrics.telemetry import Counters

log = logging.getLogger("marl.server")

_INTERVAL_S = 1.0


class OverdueResolver:
    def __init__(self, *, ledger: LedgerThread, prepared: PreparedEpisodes, recorder: EpisodeRecorder,
                 counters: Counters):
        self._ledger = ledger
        self._prepared = prepared
        self._recorder = recorder
        self._counters = counters
        self._unreadable: set[str] = set()  # episodes whose log could not be read (warned once each)

    async def run(self) -> None:
        """Forever (from server start: prepared episodes survive restarts, and so do their deadlines)."""
        while True:
            try:
                for overdue in await self._ledger.run(self._prepared.overdue, time.time()):
                    await self._resolve(overdue)
            except Exception:  # never let one bad row stop the resolver
                log.exception("resolving overdue prepared episodes failed; trying again")
            await asyncio.sleep(_INTERVAL_S)

    async def _resolve(self, overdue: Overdue) -> None:
        decision = await asyncio.to_thread(self._decision, overdue)
        if decision is Decision.COMMIT:
            recorded, changed = await self._ledger.run(self._prepared.commit, overdue.episode_id)
            if changed and recorded is not None:
                self._recorder.count_committed(recorded)
        elif decision is Decision.ABORT:
            _, changed = await self._ledger.run(self._prepared.abort, overdue.episode_id)
            self._counters.prepared_aborted += changed
        else:
            return
        if changed:
            log.info("prepared episode %s (game %s) passed its deadline unresolved: %s, as %s",
                     overdue.episode_id, overdue.game_id, "committed" if decision is Decision.COMMIT else "aborted",
                     "its decision log says" if overdue.decision_log else "presumed without a decision log")

    def _decision(self, overdue: Overdue) -> Decision | None:
        """COMMIT or ABORT, or None when the decision log cannot be read from here."""
        if overdue.decision_log is None:
            return Decision.ABORT
        try:
            return read_decision(overdue.decision_log, overdue.game_id) or Decision.ABORT
        except DecisionLogUnreadable as exc:
            if overdue.episode_id not in self._unreadable:
                self._unreadable.add(overdue.episode_id)
                log.warning("prepared episode %s (game %s) is overdue, but %s: it stays prepared until its"
                            " coordinator commits or aborts it", overdue.episode_id, overdue.game_id, exc)
            return None
