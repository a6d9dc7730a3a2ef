"""`Episode`: one lease as a context manager, which a crash never leaks (`SwarmClient.episode(task)` makes one).

On enter it begins a lease (waiting while the server says to wait); on a normal exit it ends the episode with the
`reward` set in the block, and otherwise aborts it (an exception propagates; a block that set no reward is aborted
with a warning). With `heartbeat_s` a daemon thread renews the lease meanwhile, for agents that think long between
model calls; it stops at the end, or once the server refuses or says the episode can no longer continue.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from marl.client.errors import SwarmError, SwarmRefused
from marl.client.leases import LeaseCalls
from marl.client.output import EpisodeOutput, task_id_of
from marl.protocol import AbortEpisodeResponse, EndEpisodeResponse, EpisodeLease, EpisodeState

if TYPE_CHECKING:  # the openai SDK is imported only when a client is asked for (it takes a while to import)
    import openai

log = logging.getLogger("marl.client")


class Episode:
    """One lease, as a context manager (see `SwarmClient.episode`).

    Attributes: `episode_id`, `lease`, `base_url`, `api_key`, `model`, `task_id`; set `reward` (and optionally
    `agent_rewards`, `metadata`) to have the episode ended with it on exit; `result` holds the server's
    `EndEpisodeResponse` once ended, `aborted` is True once aborted.
    """

    def __init__(self, client: LeaseCalls, task: Any, *, timeout: float | None, heartbeat_s: float | None,
                 policy: str | None = None) -> None:  # fmt: skip
        if heartbeat_s is not None and heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self.client = client
        self.task = task
        self.task_id = task_id_of(task)  # fail before claiming a lease
        self.reward: float | None = None
        self.agent_rewards: dict[str, float] | None = None
        self.metadata: dict[str, Any] = {}
        self.result: EndEpisodeResponse | None = None
        self.aborted = False
        self._lease: EpisodeLease | None = None
        self._timeout = timeout
        self._heartbeat_s = heartbeat_s
        self._policy = policy
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # -- lease attributes ---------------------------------------------------------------------------------------

    @property
    def lease(self) -> EpisodeLease:
        if self._lease is None:
            raise RuntimeError("the episode has not begun: use it as `with client.episode(task) as ep:`")
        return self._lease

    @property
    def episode_id(self) -> str:
        return self.lease.episode_id

    @property
    def base_url(self) -> str:
        return self.lease.base_url

    @property
    def api_key(self) -> str:
        return self.lease.api_key

    @property
    def model(self) -> str:
        return self.lease.model

    @property
    def done(self) -> bool:
        return self.result is not None or self.aborted

    def __repr__(self) -> str:
        eid = self._lease.episode_id if self._lease else None
        return f"Episode(episode_id={eid!r}, task_id={self.task_id!r}, reward={self.reward!r}, done={self.done})"

    # -- actions ------------------------------------------------------------------------------------------------

    def openai(self, agent: str | None = None, **kwargs: Any) -> openai.OpenAI:
        """`openai.OpenAI` for this lease; `agent` tags the calls with a role."""
        return self.client.openai_client(self.lease, agent, **kwargs)

    def async_openai(self, agent: str | None = None, **kwargs: Any) -> openai.AsyncOpenAI:
        return self.client.async_openai_client(self.lease, agent, **kwargs)

    def end(self, output: Any = None) -> EndEpisodeResponse:
        """End now with `output` (a float, an EpisodeOutput, or anything with `.reward`), or with `self.reward`."""
        if self.done:
            raise RuntimeError(f"episode {self.episode_id} is already {'ended' if self.result else 'aborted'}")
        if output is None:
            if self.reward is None:
                raise ValueError("no reward: set ep.reward or pass ep.end(reward)")
            output = EpisodeOutput(self.reward, self.agent_rewards, self.metadata)
        self.result = self.client.end_episode(self.task_id, self.episode_id, output)
        self._stop.set()
        return self.result

    def abort(self) -> AbortEpisodeResponse | None:
        """Discard the episode now (the lease's slot goes back to the pool)."""
        if self.done:
            return None
        self.aborted = True
        self._stop.set()
        return self.client.abort_episode(self.episode_id)

    def renew(self) -> EpisodeState:
        return self.client.renew_episode(self.episode_id)

    def can_continue(self) -> bool:
        return self.client.can_continue_episode(self.episode_id)

    # -- context manager ----------------------------------------------------------------------------------------

    def __enter__(self) -> Episode:
        if self._lease is not None:
            raise RuntimeError("an Episode can be entered only once: call client.episode(task) again")
        _, self._lease = self.client.begin_episode(policy=self._policy, timeout=self._timeout)
        if self._heartbeat_s:
            self._heartbeat = threading.Thread(
                target=self._beat, name=f"marl-heartbeat-{self._lease.episode_id}", daemon=True
            )
            self._heartbeat.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=self.client.timeout)
        if self.done:
            return
        if exc_type is None and self.reward is not None:
            try:
                self.end()
            except BaseException:  # the caller must know the episode was not recorded; free its slot anyway
                self._abort_quietly()
                raise
            return
        if exc_type is None:
            log.warning("episode %s (task %s) exited without a reward: aborted", self.episode_id, self.task_id)
        self._abort_quietly()

    def _abort_quietly(self) -> None:
        """Abort without masking the exception being handled; a lease that cannot be aborted expires anyway."""
        if self.done:
            return
        try:
            self.abort()
        except Exception as exc:
            log.warning("abort of episode %s failed (%s); its lease will expire on the server", self.episode_id, exc)

    def _beat(self) -> None:
        assert self._heartbeat_s is not None
        while not self._stop.wait(self._heartbeat_s):
            try:
                state = self.client.renew_episode(self.episode_id)
            except SwarmError as exc:
                log.warning("heartbeat of episode %s failed: %s", self.episode_id, exc)
                if isinstance(exc, SwarmRefused):
                    return
                continue
            if not state.can_continue:
                log.warning("episode %s can no longer continue: %s", self.episode_id, state.reason)
                return
