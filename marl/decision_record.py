"""The decision log's format on disk: what a coordinator writes and a server may read.

The coordinator keeps each multi-server game's commit decision in one SQLite file
(`marl.transaction.decision_log.DecisionLog` writes it); a server whose prepared episode outlives its deadline reads its
game's decision from that file itself (`servers/episodes/overdue.py`). This module is that shared format, standard
library only, so both sides import it and neither imports the other: the table, the decisions, and the read-only reader.
"""

from __future__ import annotations

import enum
import sqlite3
from pathlib import Path
from urllib.parse import quote

__all__ = ["SCHEMA", "Decision", "DecisionLogUnreadable", "read_decision"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS games (
    game_id TEXT PRIMARY KEY,
    participants TEXT NOT NULL,  -- JSON: server name -> {url, episode_id, client_id}
    begun_at REAL NOT NULL,
    decision TEXT,  -- NULL until decided, then 'commit' or 'abort'
    decided_at REAL,
    done INTEGER NOT NULL DEFAULT 0  -- every server acknowledged the decision
);
"""


class Decision(enum.StrEnum):
    COMMIT = "commit"
    ABORT = "abort"


class DecisionLogUnreadable(Exception):
    """The decision log cannot be read from here (no such file, no permission, not a decision log)."""


def read_decision(path: Path | str, game_id: str) -> Decision | None:
    """What the coordinator decided for `game_id` (None: nothing yet), read-only, from another process.

    Raises `DecisionLogUnreadable` when the log cannot be read here (a server that cannot see the coordinator's
    run directory): the caller must then not presume anything.
    """
    try:
        db = sqlite3.connect(f"file:{quote(str(Path(path).resolve()))}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error as exc:
        raise DecisionLogUnreadable(f"cannot open decision log {path}: {exc}") from exc
    try:
        row = db.execute("SELECT decision FROM games WHERE game_id = ?", (game_id,)).fetchone()
    except sqlite3.Error as exc:
        raise DecisionLogUnreadable(f"cannot read decision log {path}: {exc}") from exc
    finally:
        db.close()
    return Decision(row[0]) if row and row[0] else None
