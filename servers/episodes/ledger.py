"""The durable sample ledger: SQLite in WAL mode, one file per server data directory, used from one thread.

Guarantees (invariant 1: no acknowledged sample is lost or counted twice):
- `record_episode` commits the episode and all its samples in one transaction, fsynced (synchronous=FULL), before
  the server answers end_episode; with them goes the digest of the request that ended it, so a repeated end is
  answered from here (`ended_episode`), even after a restart. Ends that arrive while a commit is under way share the
  next transaction (`LedgerThread.record_episode`, a group commit), each in a savepoint of its own.
- `claim_batch(step, ...)` marks the batch's samples with the step that consumes them, in one transaction; a sample is
  claimed at most once.
- The pool's counts (`pool_groups`, `pending_episodes`), which the train loop reads after every end, are counted in
  SQLite once and then kept up to date by the writes: an inserted episode adds to them when its transaction commits,
  and every other write that moves samples in or out of the pool (`claim_batch`, `drop_stale`, `recover`) makes the
  next read count again. A GROUP BY over the pool at every end cost time in proportion to the pool (21.7 ms at
  5,000 pending episodes, `bench/ledger_commit.py --recount`) on the ledger's one thread, where the ends wait.
- A claim is kept only as long as a checkpoint holds its step: a restarted server calls `recover(resume_step)` with
  the step of the checkpoint it resumed from, which returns the claims of later steps (the restored model never kept
  those updates) to the pool, so the resumed lineage trains on every sample exactly once.

Rows are small: token ids, masks and logprobs are stored as packed arrays. `LedgerThread` runs a `Ledger`'s calls
(and those of `servers.episodes.prepared`, which shares its connection) on one worker thread, off the server's event
loop, which also serialises the writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
from array import array
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from marl.protocol import EpisodePhase
from servers.episodes.samples import Sample

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS episodes (
    episode_id TEXT PRIMARY KEY,
    job TEXT NOT NULL,
    task_id TEXT NOT NULL,
    client_id TEXT NOT NULL,
    reward REAL NOT NULL,
    agent_rewards TEXT,
    metadata TEXT NOT NULL,
    num_calls INTEGER NOT NULL,
    ended_at REAL NOT NULL,
    request_digest TEXT,  -- of the end (or prepare) body that recorded it: a repeat with the same body is replayed
    trainable_tokens INTEGER
);
CREATE TABLE IF NOT EXISTS samples (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    episode_id TEXT NOT NULL REFERENCES episodes(episode_id),
    job TEXT NOT NULL,
    task_id TEXT NOT NULL,
    agent TEXT NOT NULL,
    reward REAL NOT NULL,
    policy_version INTEGER NOT NULL,
    num_calls INTEGER NOT NULL,
    num_tokens INTEGER NOT NULL,
    token_ids BLOB NOT NULL,
    loss_mask BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    versions BLOB,  -- Sample.versions, flattened (version, count, ...); NULL: every token at policy_version
    -- NULL: in the pool; N > 0: claimed by training step N; -1: dropped as too stale to train on; -2: dropped silent
    consumed_step INTEGER
);
CREATE INDEX IF NOT EXISTS samples_pool ON samples (consumed_step, job, task_id, agent);
CREATE INDEX IF NOT EXISTS samples_episode ON samples (episode_id);
"""

DROPPED_STALE = -1
#: consumed_step of the samples of a silent group (every episode complete, no call in any: nothing to train on)
DROPPED_SILENT = -2
T = TypeVar("T")

#: Columns added to `episodes` after its first release, created on open in ledgers written before them.
_ADDED_EPISODE_COLUMNS = {"request_digest": "TEXT", "trainable_tokens": "INTEGER"}
_ADDED_SAMPLE_COLUMNS = {"versions": "BLOB"}
#: The columns a `Sample` is read from, in `_sample`'s order.
_SAMPLE_COLUMNS = "episode_id, agent, token_ids, loss_mask, logprobs, reward, policy_version, num_calls, versions"


@dataclass(frozen=True)
class GroupKey:
    job: str
    task_id: str
    agent: str


@dataclass
class PoolCounts:
    """Pending episodes per group (oldest group first, as `Ledger.pool_groups`) and in all; `silent`: the groups
    whose every sample is an agent's empty one (no call: servers.episodes.samples), which nothing can train on."""

    groups: dict[GroupKey, int]
    episodes: int
    silent: set[GroupKey]

    def add(self, groups: list[tuple[GroupKey, bool]]) -> None:
        """One more episode, with samples in `groups` (each once, in the order of its samples, with whether the agent
        called the model in it; none: it adds nothing to the pool)."""
        for key, called in groups:
            if key not in self.groups and not called:
                self.silent.add(key)
            elif called:
                self.silent.discard(key)
            self.groups[key] = self.groups.get(key, 0) + 1  # a new group goes last: its oldest sample is the newest
        self.episodes += bool(groups)

    def trainable(self) -> dict[GroupKey, int]:
        return {key: n for key, n in self.groups.items() if key not in self.silent}


@dataclass(frozen=True)
class RecordedEpisode:
    """What the ledger holds of an episode that left its lease: enough to answer a repeated end, prepare, commit or
    abort with the outcome it already had."""

    phase: EpisodePhase  # PREPARED, ENDED (in the pool) or ABORTED (a prepared episode dropped)
    client_id: str
    request_digest: str | None  # None: recorded by a server older than idempotent ends
    samples: int
    trainable_tokens: int
    deadline: float | None = None  # of a prepared episode: when the server resolves it itself


def trainable_tokens(samples: list[Sample]) -> int:
    return sum(sum(s.loss_mask) for s in samples)


@dataclass(frozen=True)
class EpisodeRow:
    episode_id: str
    job: str
    task_id: str
    reward: float
    agent_rewards: dict[str, float]
    num_calls: int
    ended_at: float
    num_samples: int
    consumed_step: int | None  # None: still in the pool; -1: dropped as stale
    metadata: dict = field(default_factory=dict)  # what the client sent at end (co-players, seed, ...)


class Ledger:
    """Not thread-safe by itself: the server calls it from one worker thread."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")  # an acknowledged episode survives power loss, not just a crash
        self.db.executescript(_SCHEMA)
        for table, added in (("episodes", _ADDED_EPISODE_COLUMNS), ("samples", _ADDED_SAMPLE_COLUMNS)):
            columns = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
            for name, kind in added.items():
                if name not in columns:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
        self._pool: PoolCounts | None = None  # None: count in SQLite at the next read (module docstring)
        # the groups of each episode the open transaction inserted, with whether its agent called the model there
        self._inserted: list[list[tuple[GroupKey, bool]]] = []

    def close(self) -> None:
        self.db.close()

    # --- meta ----------------------------------------------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    # --- writing ---------------------------------------------------------------------------------------------

    def record_episode(self, **episode: Any) -> None:
        """Commit one episode and its samples (`insert_episode`'s arguments) in one transaction."""
        with self.transaction():
            self.insert_episode(**episode)

    def record_episodes(self, episodes: list[dict[str, Any]]) -> list[Exception | None]:
        """Commit several episodes (`insert_episode`'s arguments each) in one transaction, so one fsync: a group
        commit. Each goes in a savepoint of its own, so one that fails leaves the others: the list holds, in order,
        each one's error or None. A commit that fails raises, and then none was recorded."""
        with self.transaction():
            return [self._insert_alone(episode) for episode in episodes]

    def _insert_alone(self, episode: dict[str, Any]) -> Exception | None:
        inserted = len(self._inserted)
        self.db.execute("SAVEPOINT episode")
        try:
            self.insert_episode(**episode)
        except Exception as exc:  # noqa: BLE001 - this episode's own outcome, handed to whoever ended it
            self.db.execute("ROLLBACK TO episode")
            del self._inserted[inserted:]  # its groups never reach the pool's counts
            return exc
        finally:
            self.db.execute("RELEASE episode")
        return None

    def insert_episode(self, *, episode_id: str, job: str, task_id: str, client_id: str, reward: float,
                       agent_rewards: dict[str, float] | None, metadata: dict, num_calls: int, samples: list[Sample],
                       request_digest: str | None = None) -> None:
        """Insert the episode and its samples into the pool, inside the caller's transaction."""
        self.db.execute(
            "INSERT INTO episodes (episode_id, job, task_id, client_id, reward, agent_rewards, metadata, num_calls,"
            " ended_at, request_digest, trainable_tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (episode_id, job, task_id, client_id, reward,
             json.dumps(agent_rewards) if agent_rewards is not None else None, json.dumps(metadata), num_calls,
             time.time(), request_digest, trainable_tokens(samples)),
        )
        called: dict[GroupKey, bool] = {}  # in id order
        for s in samples:
            key = GroupKey(job, task_id, s.agent)
            called[key] = called.get(key, False) or s.num_calls > 0
        self._inserted.append(list(called.items()))
        self.db.executemany(
            "INSERT INTO samples (episode_id, job, task_id, agent, reward, policy_version, num_calls, num_tokens,"
            " token_ids, loss_mask, logprobs, versions, consumed_step) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?,"
            " NULL)",
            [
                (episode_id, job, task_id, s.agent, s.reward, s.policy_version, s.num_calls, len(s.token_ids),
                 array("i", s.token_ids).tobytes(), array("b", s.loss_mask).tobytes(),
                 array("f", s.logprobs).tobytes(), array("i", [x for run in s.versions for x in run]).tobytes())
                for s in samples
            ],
        )

    def ended_episode(self, episode_id: str) -> RecordedEpisode | None:
        """What was stored when the episode was ended (or committed), or None if it is not in the pool's ledger."""
        row = self.db.execute(
            "SELECT client_id, request_digest, trainable_tokens, (SELECT COUNT(*) FROM samples s WHERE"
            " s.episode_id = e.episode_id) FROM episodes e WHERE episode_id = ?", (episode_id,)).fetchone()
        if row is None:
            return None
        client_id, digest, tokens, samples = row
        return RecordedEpisode(EpisodePhase.ENDED, client_id, digest, samples, tokens or 0)

    # --- the pool ----------------------------------------------------------------------------------------------

    def pool_groups(self) -> dict[GroupKey, int]:
        """Episodes per (job, task, agent) group among samples not yet consumed, oldest group first; a group of empty
        samples only (its agent never called the model: nothing to train on) is left out until one that called
        joins it (and leaves the pool as stale, else)."""
        return self._counts().trainable()

    def pending_episodes(self) -> int:
        """Episodes with a sample not yet consumed."""
        return self._counts().episodes

    def _counts(self) -> PoolCounts:
        if self._pool is None:
            self._pool = self._count_pool()
        return self._pool

    def count_pending_episodes(self) -> int:
        """`pending_episodes` counted in SQLite."""
        query = "SELECT COUNT(DISTINCT episode_id) FROM samples WHERE consumed_step IS NULL"
        return self.db.execute(query).fetchone()[0]

    def count_pool_groups(self) -> dict[GroupKey, int]:
        """`pool_groups` counted in SQLite (what the kept counts must always equal)."""
        return self._count_pool().trainable()

    def _count_pool(self) -> PoolCounts:
        rows = self.db.execute(
            "SELECT job, task_id, agent, COUNT(DISTINCT episode_id), MAX(num_calls) FROM samples WHERE consumed_step"
            " IS NULL GROUP BY job, task_id, agent ORDER BY MIN(id)"
        ).fetchall()
        return PoolCounts({GroupKey(job, task, agent): n for job, task, agent, n, _ in rows},
                          self.count_pending_episodes(),
                          {GroupKey(job, task, agent) for job, task, agent, _, calls in rows if not calls})

    def drop_stale(self, min_version: int) -> int:
        """Take samples older than `min_version` out of the pool (never silently: returns how many)."""
        with self.transaction():
            self._pool = None  # samples leave the pool: count it again
            cur = self.db.execute(
                "UPDATE samples SET consumed_step = ? WHERE consumed_step IS NULL AND policy_version < ?",
                (DROPPED_STALE, min_version),
            )
        return cur.rowcount

    def drop_silent(self, num_repeat: int) -> int:
        """Take out of the pool every group of `num_repeat` episodes or more in which the agent never called the
        model (empty samples only: nothing can ever train on it, and without this such groups pile up for as long as
        the role stays silent); returns how many episodes it held (never silently)."""
        silent = [key for key in self._counts().silent if self._counts().groups.get(key, 0) >= num_repeat]
        if not silent:
            return 0
        episodes = 0
        with self.transaction():
            self._pool = None  # samples leave the pool: count it again
            for key in silent:
                cur = self.db.execute(
                    "UPDATE samples SET consumed_step = ? WHERE consumed_step IS NULL AND job = ? AND task_id = ?"
                    " AND agent = ?", (DROPPED_SILENT, key.job, key.task_id, key.agent))
                episodes += cur.rowcount  # one empty sample per episode and agent
        return episodes

    def claim_batch(self, step: int, groups: Iterable[GroupKey]) -> dict[GroupKey, list[Sample]]:
        """Mark every pooled sample of these groups as consumed by `step` and return them."""
        claimed: dict[GroupKey, list[Sample]] = {}
        with self.transaction():
            self._pool = None  # samples leave the pool: count it again
            for key in groups:
                rows = self.db.execute(
                    f"SELECT id, {_SAMPLE_COLUMNS} FROM samples WHERE consumed_step IS NULL AND job = ? AND task_id = ?"
                    " AND agent = ? ORDER BY id",
                    (key.job, key.task_id, key.agent),
                ).fetchall()
                self.db.executemany("UPDATE samples SET consumed_step = ? WHERE id = ?", [(step, r[0]) for r in rows])
                claimed[key] = [_sample(r[1:]) for r in rows]
        return claimed

    def recover(self, resume_step: int) -> int:
        """Return to the pool the samples claimed by steps after `resume_step` (the model never kept them)."""
        with self.transaction():
            self._pool = None  # samples return to the pool: count it again
            cur = self.db.execute("UPDATE samples SET consumed_step = NULL WHERE consumed_step > ?", (resume_step,))
        return cur.rowcount

    def compact(self, through_step: int) -> int:
        """Empty the token payloads (ids, mask, logprobs, versions) of samples trained by step `through_step` or
        before, or dropped as stale; returns how many. Their rows stay (episode, reward, version, token count), as do
        the episodes': only what a step after the latest checkpoint may need again (`recover`) must stay whole, and
        the caller passes a step at or before it. SQLite reuses the freed pages, so the file stops growing with the
        tokens of a long run."""
        with self.transaction():
            cur = self.db.execute(
                "UPDATE samples SET token_ids = x'', loss_mask = x'', logprobs = x'', versions = NULL"
                " WHERE consumed_step IS NOT NULL AND consumed_step <= ? AND length(token_ids) > 0", (through_step,))
        return cur.rowcount

    # --- reading -----------------------------------------------------------------------------------------------

    def samples_of(self, episode_id: str) -> list[Sample]:
        rows = self.db.execute(
            f"SELECT {_SAMPLE_COLUMNS} FROM samples WHERE episode_id = ? ORDER BY id",
            (episode_id,),
        ).fetchall()
        return [_sample(r) for r in rows]

    def episodes(self, limit: int = 20, episode_id: str | None = None) -> list[EpisodeRow]:
        """The latest ended episodes, newest first (or the one whose id starts with `episode_id`)."""
        query = ("SELECT e.episode_id, e.job, e.task_id, e.reward, e.agent_rewards, e.num_calls, e.ended_at,"
                 " COUNT(s.id), MIN(s.consumed_step), e.metadata"
                 " FROM episodes e LEFT JOIN samples s USING (episode_id)")
        if episode_id is not None:
            rows = self.db.execute(query + " WHERE e.episode_id LIKE ? GROUP BY e.episode_id LIMIT ?",
                                   (episode_id.replace("%", "") + "%", limit)).fetchall()
        else:
            rows = self.db.execute(query + " GROUP BY e.episode_id ORDER BY e.ended_at DESC LIMIT ?",
                                   (limit,)).fetchall()
        return [EpisodeRow(r[0], r[1], r[2], r[3], json.loads(r[4]) if r[4] else {}, r[5], r[6], r[7], r[8],
                           json.loads(r[9]) if r[9] else {}) for r in rows]

    @contextlib.contextmanager
    def transaction(self):
        """One write transaction; the episodes it inserted join the kept pool counts once it commits."""
        self.db.execute("BEGIN IMMEDIATE")
        self._inserted, counted = [], self._pool
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            self._pool = None  # whatever the transaction did is undone: count again rather than undo by hand
            raise
        self.db.execute("COMMIT")
        if counted is not None and self._pool is counted:  # not counted again meanwhile (that count saw the inserts)
            for groups in self._inserted:
                counted.add(groups)


def _sample(row) -> Sample:
    episode_id, agent, token_ids, loss_mask, logprobs, reward, version, num_calls, versions = row
    runs = array("i", versions or b"").tolist()
    return Sample(
        episode_id=episode_id,
        agent=agent,
        token_ids=array("i", token_ids).tolist(),
        loss_mask=array("b", loss_mask).tolist(),
        logprobs=array("f", logprobs).tolist(),
        reward=reward,
        policy_version=version,
        num_calls=num_calls,
        versions=list(zip(runs[::2], runs[1::2], strict=True)),
    )


class LedgerThread:
    """A `Ledger` for the server's event loop: each call runs on the ledger's own worker thread, one at a time."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ledger")
        self._queued: list[tuple[dict[str, Any], asyncio.Future[None]]] = []  # episodes for the next group commit
        self._committing: asyncio.Task[None] | None = None

    async def run(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`call(*args, **kwargs)` on the ledger thread (any function that uses this ledger's connection)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, lambda: call(*args, **kwargs))

    async def set_meta(self, key: str, value: str) -> None:
        await self.run(self.ledger.set_meta, key, value)

    async def record_episode(self, **episode: Any) -> None:
        """Commit one episode; returns once it is durable. Episodes that arrive while a commit is under way wait for
        it, then go together in the next one (`Ledger.record_episodes`: one transaction, one fsync): a burst of
        ends shares a few fsyncs instead of one each, and a lone end commits at once, as before."""
        recorded = asyncio.get_running_loop().create_future()
        self._queued.append((episode, recorded))
        if self._committing is None or self._committing.done():
            self._committing = asyncio.create_task(self._commit_queued())
        await recorded

    async def _commit_queued(self) -> None:
        while self._queued:
            group, self._queued = self._queued, []
            try:
                errors = await self.run(self.ledger.record_episodes, [episode for episode, _ in group])
            except Exception as exc:  # noqa: BLE001 - the commit failed: every episode of the group has that error
                errors = [exc] * len(group)
            for (_, recorded), error in zip(group, errors, strict=True):
                if recorded.done():  # its caller was cancelled; the episode is recorded (or not) all the same
                    continue
                if error is None:
                    recorded.set_result(None)
                else:
                    recorded.set_exception(error)

    async def pool_groups(self) -> dict[GroupKey, int]:
        return await self.run(self.ledger.pool_groups)

    async def pending_episodes(self) -> int:
        return await self.run(self.ledger.pending_episodes)

    async def drop_stale(self, min_version: int) -> int:
        return await self.run(self.ledger.drop_stale, min_version)

    async def drop_silent(self, num_repeat: int) -> int:
        return await self.run(self.ledger.drop_silent, num_repeat)

    async def claim_batch(self, step: int, groups: Iterable[GroupKey]) -> dict[GroupKey, list[Sample]]:
        return await self.run(self.ledger.claim_batch, step, list(groups))

    async def recover(self, resume_step: int) -> int:
        return await self.run(self.ledger.recover, resume_step)

    async def compact(self, through_step: int) -> int:
        return await self.run(self.ledger.compact, through_step)

    async def close(self) -> None:
        if self._committing is not None:
            await self._committing  # the ends already queued are committed before the connection closes
        await self.run(self.ledger.close)
        self._thread.shutdown(wait=True)
