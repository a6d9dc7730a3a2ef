"""The episode calls of `SwarmClient`: a lease's begin, end, prepare, commit, abort, renew and state, and the OpenAI
clients bound to a lease.

`LeaseCalls` is a mixin of `ClientCore` (`marl/client/core.py`). Every call names the client's `client_id`, so only
the client that began a lease may end, abort or renew it; none keeps per-episode state, so any number of threads
may run episodes on one client. `end_episode` and `commit_episode` are idempotent (a repeat with the same body gets
the stored outcome, `replayed`), which is why the core may retry them after a lost answer; `abort_episode` is not,
and is retried only when the request never left. A game spanning several servers commits with `prepare_episode` on
each, then `commit_episode` on each (`marl/transaction/two_phase.py` drives it). The context manager over these calls is
`Episode` (`marl/client/episode.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from marl.client.core import ClientCore
from marl.client.errors import SwarmRefused
from marl.client.output import output_fields, task_id_of
from marl.protocol import (
    INCLUDE_POOL_PARAM,
    ROUTE_ABORT,
    ROUTE_BEGIN,
    ROUTE_COMMIT,
    ROUTE_END,
    ROUTE_EPISODE,
    ROUTE_PREPARE,
    ROUTE_RENEW,
    AbortEpisodeResponse,
    BeginEpisodeRequest,
    ClientRequest,
    EndEpisodeRequest,
    EndEpisodeResponse,
    EpisodeLease,
    EpisodeState,
    ErrorCode,
    PrepareEpisodeRequest,
    PrepareEpisodeResponse,
    agent_headers,
)

if TYPE_CHECKING:  # the openai SDK is imported only when a client is asked for (it takes a while to import)
    import openai


class LeaseCalls(ClientCore):
    """The calls on one episode's lease, and its OpenAI clients; see `SwarmClient`."""

    def begin_episode(self, *, policy: str | None = None, timeout: float | None = None) -> tuple[str, EpisodeLease]:
        """Claim a lease; waits (up to `timeout`, default `max_wait_s`) while the server says to wait.

        Returns `(episode_id, lease)`; `lease.base_url`, `lease.api_key` and `lease.model` are what the OpenAI SDK
        (or any OpenAI-compatible client) needs for this episode, and only for it. End the lease with `end_episode`
        or discard it with `abort_episode`; see also `episode()`, which does that for you. `policy`: which policy
        of a server of several the episode trains (default: the client's `policy`, else the server's only one).
        """
        body = BeginEpisodeRequest(client_id=self.client_id, policy=policy or self.policy)
        lease = self._call(
            "POST", ROUTE_BEGIN, EpisodeLease, what="begin_episode",
            json=body.model_dump(mode="json", exclude_none=True),
            timeout=self.max_wait_s if timeout is None else timeout,
        )
        return lease.episode_id, lease

    def end_episode(
        self, task: Any, episode_id: str, output: Any, *, include_pool: bool = False, timeout: float | None = None
    ) -> EndEpisodeResponse:
        """Commit the episode with its reward; returns once the server has stored it durably.

        `task`: a task id string, or an object with `task_id` (or `id`), or a mapping with one of those keys.
        `output`: a float reward, an `EpisodeOutput`, or any object with `.reward` (and optionally
        `.agent_rewards`, `.metadata`). Bad arguments raise `TypeError`/`ValueError` before any request is sent.
        A transport error is retried with the same body: the server answers a repeat with the outcome it stored
        (`replayed: True`), so an end whose answer was lost is never recorded twice nor lost.
        `include_pool=True` asks for the pool's progress in the reply's `pool` (None otherwise; `pool()` reads it
        any time).
        """
        body = EndEpisodeRequest(client_id=self.client_id, task_id=task_id_of(task), **self._output_body(output))
        return self._call(
            "POST", ROUTE_END.format(episode_id=episode_id), EndEpisodeResponse, what="end_episode",
            json=body.model_dump(mode="json"), params=_pool_param(include_pool), timeout=timeout,
            episode_id=episode_id,
        )

    def prepare_episode(
        self, task: Any, episode_id: str, output: Any, *, game_id: str, prepare_timeout_s: float | None = None,
        decision_log: str | None = None, timeout: float | None = None,
    ) -> PrepareEpisodeResponse:
        """Phase one of a two-phase commit: the server validates the episode and stores it durably as PREPARED (its
        lease key dies), outside the pool until `commit_episode` (or dropped by `abort_episode`).

        `game_id` names the game; `decision_log` is the path of the coordinator's decision log as the server sees
        it. If neither commit nor abort arrives within `prepare_timeout_s` (server default 300 s), the server
        resolves the episode from that log (commit if the game was decided so, else abort), or aborts it when
        no log was named. Retried on transport errors like `end_episode`.
        """
        extra = {} if prepare_timeout_s is None else {"timeout_s": prepare_timeout_s}
        body = PrepareEpisodeRequest(client_id=self.client_id, task_id=task_id_of(task), game_id=game_id,
                                     decision_log=decision_log, **self._output_body(output), **extra)
        return self._call(
            "POST", ROUTE_PREPARE.format(episode_id=episode_id), PrepareEpisodeResponse, what="prepare_episode",
            json=body.model_dump(mode="json"), timeout=timeout, episode_id=episode_id,
        )

    def commit_episode(
        self, episode_id: str, *, include_pool: bool = False, timeout: float | None = None
    ) -> EndEpisodeResponse:
        """Phase two: a prepared episode enters the pool. Idempotent (a repeat answers `replayed: True`); refused
        with 409 `episode_aborted` if it was aborted meanwhile (by its holder, or at its deadline).
        `include_pool=True`: the pool's progress in the reply, as for `end_episode`."""
        return self._call(
            "POST", ROUTE_COMMIT.format(episode_id=episode_id), EndEpisodeResponse, what="commit_episode",
            json=ClientRequest(client_id=self.client_id).model_dump(mode="json"), params=_pool_param(include_pool),
            timeout=timeout, episode_id=episode_id,
        )

    @staticmethod
    def _output_body(output: Any) -> dict[str, Any]:
        reward, agent_rewards, metadata = output_fields(output)
        return {"reward": reward, "agent_rewards": agent_rewards, "metadata": metadata}

    def abort_episode(
        self, episode_id: str, *, missing_ok: bool = True, timeout: float | None = None
    ) -> AbortEpisodeResponse | None:
        """Discard the episode: a running one (its slot is re-queued while ROLLING) or a prepared one. Returns None
        if a prepared episode was aborted already, or if the server no longer runs it (aborted, expired) and
        `missing_ok`; the episode does not count either way. An episode already ended (or committed) cannot be
        aborted: `SwarmRefused` with code `episode_already_ended`."""
        try:
            response = self._call(
                "POST", ROUTE_ABORT.format(episode_id=episode_id), AbortEpisodeResponse, what="abort_episode",
                json=ClientRequest(client_id=self.client_id).model_dump(mode="json"), retry="unsent",
                timeout=timeout, episode_id=episode_id,
            )
        except SwarmRefused as exc:
            if missing_ok and exc.code is ErrorCode.EPISODE_NOT_FOUND:
                return None
            raise
        return None if response.replayed else response

    def renew_episode(self, episode_id: str, *, timeout: float | None = None) -> EpisodeState:
        """Heartbeat: reset the lease's idle timer (needed only when the agent makes no model call for a while)."""
        return self._call(
            "POST", ROUTE_RENEW.format(episode_id=episode_id), EpisodeState, what="renew_episode",
            json=ClientRequest(client_id=self.client_id).model_dump(mode="json"), timeout=timeout,
            episode_id=episode_id,
        )

    def episode_state(self, episode_id: str, *, timeout: float | None = None) -> EpisodeState:
        """The lease's state: `can_continue`, the reason, the engine state, idle time and patience."""
        return self._call(
            "GET", ROUTE_EPISODE.format(episode_id=episode_id), EpisodeState, what="episode_state",
            params={"client_id": self.client_id}, timeout=timeout, episode_id=episode_id,
        )

    def can_continue_episode(self, episode_id: str, *, timeout: float | None = None) -> bool:
        """False if the server no longer accepts this episode (expired, aborted, unknown, engine stopped)."""
        try:
            return self.episode_state(episode_id, timeout=timeout).can_continue
        except SwarmRefused as exc:
            if exc.code is ErrorCode.EPISODE_NOT_FOUND:
                return False
            raise

    # -- OpenAI SDK ---------------------------------------------------------------------------------------------

    def openai_client(self, lease: EpisodeLease, agent: str | None = None, **kwargs: Any) -> openai.OpenAI:
        """An `openai.OpenAI` bound to the lease; `agent` tags every call with that role (`X-Marl-Agent`).

        Extra keyword arguments go to `openai.OpenAI` (e.g. `max_retries`, `timeout`).
        """
        import openai

        return openai.OpenAI(**self._openai_kwargs(lease, agent, kwargs))

    def async_openai_client(
        self, lease: EpisodeLease, agent: str | None = None, **kwargs: Any
    ) -> openai.AsyncOpenAI:
        """Like `openai_client`, for asyncio code."""
        import openai

        return openai.AsyncOpenAI(**self._openai_kwargs(lease, agent, kwargs))

    @staticmethod
    def _openai_kwargs(lease: EpisodeLease, agent: str | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(lease, EpisodeLease):
            raise TypeError(
                f"expected the EpisodeLease from begin_episode(), got {type(lease).__name__!r} "
                "(note: begin_episode() returns a tuple (episode_id, lease))"
            )
        headers = dict(kwargs.pop("default_headers", None) or {})
        if agent:
            headers.update(agent_headers(agent))
        return {"base_url": lease.base_url, "api_key": lease.api_key, "default_headers": headers or None, **kwargs}


def _pool_param(include_pool: bool) -> dict[str, str] | None:
    """The query of an end or commit that asks for the pool's progress in its reply (none: the server skips it)."""
    return {INCLUDE_POOL_PARAM: "true"} if include_pool else None
