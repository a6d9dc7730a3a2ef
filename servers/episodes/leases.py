"""Leases: the live episodes of a server, and the opaque keys that let agents call the model for them.

A key is a random server-issued token mapped to its lease in memory: it carries no meaning of its own, and it stops
working the instant its lease ends, is aborted, expires, or the engine restarts (a new generation). Dead keys and
closed episodes are remembered for a while so a late caller learns *why* it was refused. While its end is being
written a lease is *sealed*: it takes no new calls and never expires, and it closes only once the write has
committed.

A lease is also what a data-plane call runs under (`servers.calls.chat`): it gives the call its history (for
prompt splicing), counts it as busy while the model works, and keeps the finished call for the episode's samples.
A call that was already generating when the lease was sealed is still kept: `end` (or `prepare`) waits for it
(`drained`) before it merges the calls, so a served call is never dropped; a call that had not started generating
by then is refused instead (it generated nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from marl.protocol import EPISODE_KEY_PREFIX, ErrorCode
from servers.episodes.samples import CallRecord
from servers.errors import Refusal

_REMEMBERED = 10_000  # dead keys, and closed episodes


@dataclass
class Lease:
    episode_id: str
    key: str
    client_id: str
    generation: int
    patience_s: float
    policy_version: int = 0  # the version serving when the lease began (a silent agent's sample carries it)
    created_at: float = field(default_factory=time.monotonic)
    last_active: float = field(default_factory=time.monotonic)
    inflight: int = 0  # data-plane calls running now: a lease is never idle while the model works for it
    calls: list[CallRecord] = field(default_factory=list)  # oldest first
    closed: bool = False  # ended, aborted, expired or the engine stopped: its key is dead
    sealed: bool = False  # its end (or prepare) is being written: no new calls, no expiry
    _idle: asyncio.Event | None = field(default=None, repr=False)  # set when the last call in flight finishes

    def idle_s(self, now: float | None = None) -> float:
        return 0.0 if self.inflight or self.sealed else (now or time.monotonic()) - self.last_active

    def touch(self) -> None:
        self.last_active = time.monotonic()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """While a call generates for this lease: it is never idle meanwhile, and active when the call ends. A call
        that would start generating once the lease is sealed is refused: its end is already waiting for the calls
        in flight, and this one would come too late for it."""
        if self.sealed:
            raise Refusal(401, ErrorCode.INVALID_API_KEY, "this episode is being ended: its key takes no more calls")
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1
            self.touch()
            if not self.inflight and self._idle is not None:
                self._idle.set()

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no call generates for this lease, at most `timeout_s`: True if none does. Call it sealed (no
        call starts meanwhile), so that once drained the lease stays so."""
        if self.inflight:
            self._idle = self._idle or asyncio.Event()
            self._idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout_s)
        return not self.inflight

    def record(self, call: CallRecord) -> bool:
        """Keep a finished call; False (nothing kept) if the lease closed meanwhile (aborted, expired, the engine
        stopped). A sealed lease still keeps a call that was generating when it was sealed: its end waits for it."""
        if self.closed:
            return False
        self.calls.append(call)
        self.touch()
        return True


class NoFreeSlot(Exception):
    """`max_leases` leases are open already."""


class LeaseTable:
    """The open leases by episode id and by key, and why recently closed keys died."""

    def __init__(self, id_prefix: str = "") -> None:
        #: Starts every episode id and follows EPISODE_KEY_PREFIX in every key: a policy's name and separator on a
        #: server of several policies, which routes by it (`servers.policies.server`); empty otherwise.
        self.id_prefix = id_prefix
        self.by_episode: dict[str, Lease] = {}
        self._by_key: dict[str, Lease] = {}
        self._dead_keys: OrderedDict[str, str] = OrderedDict()
        self._closed: OrderedDict[str, str] = OrderedDict()  # episode id -> why its lease closed

    def __len__(self) -> int:
        return len(self.by_episode)

    def open(self, *, client_id: str, generation: int, patience_s: float, max_leases: int,
             policy_version: int = 0) -> Lease:
        if len(self.by_episode) >= max_leases:
            raise NoFreeSlot
        lease = Lease(
            episode_id=self.id_prefix + uuid.uuid4().hex,
            key=EPISODE_KEY_PREFIX + self.id_prefix + secrets.token_urlsafe(24),
            client_id=client_id,
            generation=generation,
            patience_s=patience_s,
            policy_version=policy_version,
        )
        self.by_episode[lease.episode_id] = lease
        self._by_key[lease.key] = lease
        return lease

    def get(self, episode_id: str) -> Lease | None:
        return self.by_episode.get(episode_id)

    def by_key(self, key: str) -> Lease | None:
        return self._by_key.get(key)

    def close(self, lease: Lease, reason: str) -> None:
        """Remove the lease; its key is refused from now on with `reason`."""
        lease.closed = True
        self.by_episode.pop(lease.episode_id, None)
        self._by_key.pop(lease.key, None)
        _remember(self._dead_keys, lease.key, reason)
        _remember(self._closed, lease.episode_id, reason)

    def why_dead(self, key: str) -> str | None:
        return self._dead_keys.get(key)

    def why_closed(self, episode_id: str) -> str | None:
        return self._closed.get(episode_id)

    def expired(self) -> list[Lease]:
        now = time.monotonic()
        return [lease for lease in self.by_episode.values() if lease.idle_s(now) > lease.patience_s]


def _remember(memory: OrderedDict[str, str], key: str, value: str) -> None:
    memory[key] = value
    while len(memory) > _REMEMBERED:
        memory.popitem(last=False)
