"""`ProxyService`: one app request answered by the best of N candidates, each an episode on the swarm server.

A request is one *turn*. The service finds the conversation it continues (`ConversationStore`), leases the turn's
episodes (the held branch of that conversation plus N-1 fresh leases, or N fresh leases), sends the request through
each (`CandidateCaller`), scores the N candidates against each other (`rewards.score`), ends the losing branches
with their rewards, holds the winning branch for the conversation's next turn (or ends it too, with holding off),
and answers with the winner. Ends run in the background after the answer; a failed turn aborts all of its leases
before the app hears of it. A watcher ends held branches when they idle out, and at once when the server wants to
drain. Design and ledger: docs/proxy.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from marl.client import SwarmError
from marl.protocol import ChatCompletionRequest, ChatCompletionResponse, EngineState, EpisodeLease
from marl.proxy.candidates import CandidateCaller
from marl.proxy.conversations import Branch, ConversationStore, turn_tag
from marl.proxy.errors import ProxyError
from marl.proxy.leases import LeaseBroker, Wait
from marl.proxy.metrics import ProxyMetrics
from marl.proxy.rewards import Candidate, RewardFunction, score

log = logging.getLogger("marl.proxy")

WATCH_INTERVAL_S = 0.5  # how often held branches are checked against their idle limit and the server's state


@dataclass
class Turn:
    """The episodes answering one request: `carried` (a held branch) plays on leases[0] when it is set."""

    task_id: str
    number: int
    leases: list[EpisodeLease]
    carried: Branch | None = None

    @property
    def tag(self) -> str:
        return turn_tag(self.number)


class ProxyService:
    def __init__(self, broker: LeaseBroker, caller: CandidateCaller, reward: RewardFunction, *, num_repeat: int,
                 conversation_idle_s: float, metrics: ProxyMetrics) -> None:
        self.broker, self.caller, self.reward = broker, caller, reward
        self.num_repeat = num_repeat
        self.conversation_idle_s = conversation_idle_s  # 0: hold nothing, every turn is a conversation of its own
        self.metrics = metrics
        self.conversations = ConversationStore()
        metrics.conversations.set_function(lambda: len(self.conversations))
        self._background: set[asyncio.Task] = set()
        self._watcher: asyncio.Task | None = None

    async def start(self) -> None:
        self._watcher = asyncio.create_task(self._watch())

    async def close(self) -> None:
        """End every held branch with its rewards and wait for every pending end: nothing is left on the server."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        self.release_conversations()
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        await self.caller.close()
        self.broker.close()

    # --- one request ---------------------------------------------------------------------------------------------

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        """The best of N candidates (the first one, unscored, when the reward function fails)."""
        self.metrics.in_flight.inc()
        try:
            with self.metrics.latency.time():
                turn = await self._open_turn(self.conversations.take(request.messages))
                return await self._play(turn, request)
        except ProxyError as exc:
            self.metrics.requests.labels("unavailable" if exc.status == 503 else "error").inc()
            raise
        finally:
            self.metrics.in_flight.dec()

    async def _open_turn(self, held: Branch | None) -> Turn:
        if held is not None:
            turn = await self._continue(held)
            if turn is not None:
                self.metrics.turns.labels("continued").inc()
                return turn
        leases = await self.broker.acquire(self.num_repeat, before_waiting=self.release_conversations)
        self.metrics.turns.labels("fresh").inc()
        return Turn(task_id=f"proxy-{uuid.uuid4().hex}", number=1, leases=leases)

    async def _continue(self, held: Branch) -> Turn | None:
        """The next turn on the held branch's lease plus N-1 fresh ones, if the server grants them now; else None
        (the branch is ended, or was lost, and the turn starts afresh)."""
        if not await self.broker.renew(held.lease):
            log.warning("conversation lease %s died on the server; its turns were not recorded", held.lease.episode_id)
            self.metrics.episodes.labels("lost").inc()
            return None
        try:
            fresh = await self.broker.try_acquire(self.num_repeat - 1)
        except BaseException:  # the server refused for good, or the request was cancelled: keep the turns played
            self._end_later(held)
            raise
        if isinstance(fresh, Wait):  # a server that wants to drain waits for every lease: do not keep this one
            self._end_later(held)
            return None
        return Turn(task_id=held.task_id, number=held.turn + 1, leases=[held.lease, *fresh], carried=held)

    async def _play(self, turn: Turn, request: ChatCompletionRequest) -> ChatCompletionResponse:
        try:
            responses = await self.caller.generate_all(turn.leases, request, turn.tag)
        except Exception:  # a failed candidate: nothing of this turn is recorded, and nothing left when the app hears
            await self._abort(turn)
            raise
        except BaseException:  # cancelled (the proxy stops): abort in the background, `close` waits for it
            self._spawn(self._abort(turn))
            raise
        try:
            rewards = await score(self.reward, request, [Candidate.from_response(r) for r in responses])
        except Exception:
            log.exception("the reward function failed: the %d episodes of this request are aborted and the app gets"
                          " the first candidate, unscored", len(turn.leases))
            await self._abort(turn)  # before answering: nothing of this request is left on the server
            self.metrics.requests.labels("unscored").inc()
            return responses[0]
        winner = max(range(len(rewards)), key=rewards.__getitem__)  # the first of equals: the held branch
        self._settle(turn, rewards, winner, [*request.messages, responses[winner].choices[0].message])
        self.metrics.scored(turn.leases[0].policy_version, rewards, winner)
        return responses[winner]

    def _settle(self, turn: Turn, rewards: list[float], winner: int, continued_by: list[Any]) -> None:
        """End the losing branches; hold the winner for the next turn (`continued_by` opens it), or end it too."""
        for i, lease in enumerate(turn.leases):
            earlier = turn.carried.rewards if turn.carried is not None and i == 0 else {}
            branch = Branch(lease=lease, task_id=turn.task_id, turn=turn.number,
                            rewards={**earlier, turn.tag: rewards[i]})
            if i == winner and self.conversation_idle_s > 0:
                displaced = self.conversations.hold(continued_by, branch, self.conversation_idle_s)
                if displaced is not None:
                    self._end_later(displaced)
            else:
                self._end_later(branch)

    async def _abort(self, turn: Turn) -> None:
        """Abort every lease of a failed turn. A carried branch's earlier turns go with it: its lease already holds
        this turn's unscored call, and nothing unscored is ever recorded."""
        await self.broker.abort(turn.leases)
        self.metrics.episodes.labels("aborted").inc(len(turn.leases))

    # --- held branches -------------------------------------------------------------------------------------------

    def release_conversations(self) -> None:
        """End every held branch now (the server wants its slots, or drains, or the proxy stops)."""
        for branch in self.conversations.take_all():
            self._end_later(branch)

    def _end_later(self, branch: Branch) -> None:
        self._spawn(self._end(branch))

    async def _end(self, branch: Branch) -> None:
        ended = await self.broker.end(branch.lease, branch.task_id, branch.output())
        self.metrics.episodes.labels("ended" if ended else "lost").inc()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` in the background; `close` waits for it (a cancelled request cannot cancel it)."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _watch(self) -> None:
        """Forever: end held branches past their idle limit, and all of them once the server stops ROLLING (a
        drain waits for every lease to go, so a held conversation must never delay a training step)."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for branch in self.conversations.take_expired():
                self._end_later(branch)
            if len(self.conversations) and not await self._server_rolling():
                self.release_conversations()

    async def _server_rolling(self) -> bool:
        try:
            return (await self.broker.status()).state == EngineState.ROLLING
        except SwarmError as exc:  # unreachable: held leases die with it or live on; the next turn finds out
            log.debug("status of the swarm server failed: %s", exc)
            return True
