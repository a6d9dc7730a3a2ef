"""The coordinator's decision log: each game's commit decision, durable before any server is told to commit.

A game commits its episodes on several servers with a two-phase commit (docs/design.md, "Two-phase commit"):

1. `begin(game_id, participants)`: the game and its episode on each server, before the first prepare;
2. prepare on every server (`SwarmClient.prepare_episode`, naming this log and a timeout);
3. `decide(game_id, commit=..., decide_by=...)`: the decision, fsynced. COMMIT is written only while it is earlier
   than `decide_by` (the coordinator passes half the prepare timeout after its first prepare): a server resolving
   an overdue prepared episode must never find "nothing decided" and later a COMMIT;
4. commit (or abort) on every server, then `done(game_id)`.

A restarted coordinator re-drives what is not done (`unfinished`; `marl.transaction.two_phase.redrive`): commit where
COMMIT was decided, abort everywhere else. A server whose prepared episode outlives its deadline reads the decision
itself (`read_decision`): COMMIT means commit, ABORT or nothing means abort. The log is one SQLite file in
rollback-journal mode (not WAL), so a server process can read it while the coordinator writes; it lives in the run
directory.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from marl.decision_record import SCHEMA, Decision, DecisionLogUnreadable, read_decision

__all__ = ["Decision", "DecisionLog", "DecisionLogUnreadable", "GameDecision", "Participant", "read_decision"]


@dataclass(frozen=True)
class Participant:
    """One server's episode of a game: where it is, and the client that holds it (only the holder may commit)."""

    url: str
    episode_id: str
    client_id: str


@dataclass(frozen=True)
class GameDecision:
    game_id: str
    participants: dict[str, Participant]
    decision: Decision | None


#: `done` compacts the log every this many finished games.
COMPACT_EVERY = 1000


class DecisionLog:
    """Written by one coordinator process (any of its threads); read by servers with `read_decision`.

    A game acknowledged everywhere (`done`) is needed by nobody: no server will read its decision again, and a
    restarted coordinator re-drives only unfinished games. So `compact` deletes those rows (every `COMPACT_EVERY`
    done games, by itself), and the file stays as large as the games in flight, however long the run."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._done_since_compact = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=DELETE")  # readable from other processes without write access
        self._db.execute("PRAGMA synchronous=FULL")  # a decision survives power loss before any commit is sent
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def begin(self, game_id: str, participants: Mapping[str, Participant]) -> None:
        """Record the game and its participants, undecided (a game begun twice keeps its first record)."""
        record = json.dumps({name: asdict(p) for name, p in participants.items()})
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO games (game_id, participants, begun_at) VALUES (?, ?, ?)",
                             (game_id, record, time.time()))

    def decide(self, game_id: str, *, commit: bool, decide_by: float | None = None) -> Decision:
        """Record the decision and return the one that holds: the first decided wins, and a COMMIT asked for at or
        after `decide_by` (unix time) is recorded as ABORT."""
        late = decide_by is not None and time.time() >= decide_by
        wanted = Decision.COMMIT if commit and not late else Decision.ABORT
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR IGNORE INTO games (game_id, participants, begun_at) VALUES (?, '{}', ?)",
                                 (game_id, time.time()))
                self._db.execute("UPDATE games SET decision = ?, decided_at = ? WHERE game_id = ? AND decision IS"
                                 " NULL", (wanted.value, time.time(), game_id))
                decided = self._db.execute("SELECT decision FROM games WHERE game_id = ?", (game_id,)).fetchone()[0]
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        return Decision(decided)

    def done(self, game_id: str) -> None:
        """Every server acknowledged the game's decision: nothing left to re-drive."""
        with self._lock:
            self._db.execute("UPDATE games SET done = 1 WHERE game_id = ?", (game_id,))
            self._done_since_compact += 1
            due = self._done_since_compact >= COMPACT_EVERY
        if due:
            self.compact()

    def compact(self) -> int:
        """Delete the games every server acknowledged; returns how many (their pages are reused by later games)."""
        with self._lock:
            self._done_since_compact = 0
            return self._db.execute("DELETE FROM games WHERE done = 1").rowcount

    def decision(self, game_id: str) -> Decision | None:
        with self._lock:
            row = self._db.execute("SELECT decision FROM games WHERE game_id = ?", (game_id,)).fetchone()
        return Decision(row[0]) if row and row[0] else None

    def unfinished(self) -> list[GameDecision]:
        """Games not acknowledged everywhere, oldest first: what a restarted coordinator must re-drive."""
        with self._lock:
            rows = self._db.execute("SELECT game_id, participants, decision FROM games WHERE done = 0"
                                    " ORDER BY begun_at").fetchall()
        return [GameDecision(game_id, {name: Participant(**p) for name, p in json.loads(parts).items()},
                             Decision(decision) if decision else None)
                for game_id, parts, decision in rows]
