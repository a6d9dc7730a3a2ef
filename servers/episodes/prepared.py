"""Prepared episodes (a game's two-phase commit), in the ledger: recorded durably, outside the pool until committed.

A prepared episode is a whole episode (its row and samples) kept in the `prepared` table of the server's ledger,
with the game it belongs to and its deadline. `commit` moves it into the pool (episodes + samples) and marks it
committed, in one transaction; `abort` marks it aborted and drops its samples. Resolved rows stay (small, without
their samples) so that a repeated prepare, commit or abort is answered with the outcome it already had. Everything
here runs on the ledger's thread (`servers.episodes.ledger.LedgerThread.run`), inside the ledger's transactions.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from pydantic import TypeAdapter

from marl.protocol import EpisodePhase
from servers.episodes.ledger import Ledger, RecordedEpisode, trainable_tokens
from servers.episodes.samples import Sample

_SCHEMA = """
CREATE TABLE IF NOT EXISTS prepared (
    episode_id TEXT PRIMARY KEY,
    game_id TEXT NOT NULL,
    client_id TEXT NOT NULL,
    request_digest TEXT NOT NULL,
    episode TEXT NOT NULL,  -- the episode row's fields, as JSON; '{}' once resolved
    samples BLOB,  -- the samples, as JSON; NULL once resolved
    num_samples INTEGER NOT NULL,
    trainable_tokens INTEGER NOT NULL,
    prepared_at REAL NOT NULL,
    deadline REAL NOT NULL,  -- unix time: unresolved by then, the server resolves it itself
    decision_log TEXT,  -- where the coordinator records its decision (None: presumed abort at the deadline)
    outcome TEXT  -- NULL while prepared, then 'committed' or 'aborted'
);
CREATE INDEX IF NOT EXISTS prepared_open ON prepared (outcome, deadline);
"""

_SAMPLES = TypeAdapter(list[Sample])
_PHASES = {None: EpisodePhase.PREPARED, "committed": EpisodePhase.ENDED, "aborted": EpisodePhase.ABORTED}


@dataclass(frozen=True)
class Overdue:
    """A prepared episode past its deadline, and where to learn what its game decided."""

    episode_id: str
    game_id: str
    client_id: str
    decision_log: str | None


class PreparedEpisodes:
    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self.db = ledger.db
        self.db.executescript(_SCHEMA)

    def prepare(self, *, game_id: str, timeout_s: float, decision_log: str | None, request_digest: str,
                samples: list[Sample], **episode) -> RecordedEpisode:
        """Record the episode as prepared (fsynced); `episode` holds the rest of `Ledger.insert_episode`'s fields."""
        now = time.time()
        with self.ledger.transaction():
            self.db.execute(
                "INSERT INTO prepared VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL)",
                (episode["episode_id"], game_id, episode["client_id"], request_digest, json.dumps(episode),
                 _SAMPLES.dump_json(samples), len(samples), trainable_tokens(samples), now, now + timeout_s,
                 decision_log))
        return self.find(episode["episode_id"])

    def find(self, episode_id: str) -> RecordedEpisode | None:
        """The episode as recorded: prepared (with its outcome), else ended into the pool, else None."""
        row = self.db.execute(
            "SELECT client_id, request_digest, num_samples, trainable_tokens, deadline, outcome FROM prepared"
            " WHERE episode_id = ?", (episode_id,)).fetchone()
        if row is None:
            return self.ledger.ended_episode(episode_id)
        client_id, digest, samples, tokens, deadline, outcome = row
        return RecordedEpisode(_PHASES[outcome], client_id, digest, samples, tokens, deadline)

    def commit(self, episode_id: str, client_id: str | None = None) -> tuple[RecordedEpisode | None, bool]:
        """Move a prepared episode into the pool, if `client_id` (None: the server itself) holds it and it is still
        prepared. Returns the episode as recorded afterwards, and whether this call committed it."""
        with self.ledger.transaction():
            row = self.db.execute("SELECT client_id, episode, samples, request_digest FROM prepared WHERE"
                                  " episode_id = ? AND outcome IS NULL", (episode_id,)).fetchone()
            committing = row is not None and client_id in (None, row[0])
            if committing:
                self.ledger.insert_episode(**json.loads(row[1]), samples=_SAMPLES.validate_json(row[2]),
                                           request_digest=row[3])
                self._resolve(episode_id, "committed")
        return self.find(episode_id), committing

    def abort(self, episode_id: str, client_id: str | None = None) -> tuple[RecordedEpisode | None, bool]:
        """Drop a prepared episode, if `client_id` (None: the server itself) holds it and it is still prepared.
        Returns the episode as recorded afterwards, and whether this call aborted it."""
        with self.ledger.transaction():
            row = self.db.execute("SELECT client_id FROM prepared WHERE episode_id = ? AND outcome IS NULL",
                                  (episode_id,)).fetchone()
            aborting = row is not None and client_id in (None, row[0])
            if aborting:
                self._resolve(episode_id, "aborted")
        return self.find(episode_id), aborting

    def _resolve(self, episode_id: str, outcome: str) -> None:
        self.db.execute("UPDATE prepared SET outcome = ?, episode = '{}', samples = NULL WHERE episode_id = ?",
                        (outcome, episode_id))

    def overdue(self, now: float) -> list[Overdue]:
        rows = self.db.execute("SELECT episode_id, game_id, client_id, decision_log FROM prepared WHERE outcome IS"
                               " NULL AND deadline <= ? ORDER BY deadline", (now,)).fetchall()
        return [Overdue(*row) for row in rows]

    def count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM prepared WHERE outcome IS NULL").fetchone()[0]
