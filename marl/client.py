"""`SwarmClient`: the typed, thread-safe HTTP client of one swarm server.

A training script needs four calls::

    from marl import SwarmClient

    client = SwarmClient("http://gpu-box:8000")                      # admin token from $MARL_ADMIN_TOKEN
    client.auto_sync_train_config_and_start_engine({"batch_size": 8, "num_repeat": 4})

    def rollout(task):
        with client.episode(task) as ep:                              # begins a lease; aborts it if the body raises
            oai = ep.openai(agent="solver")                           # OpenAI SDK bound to this lease
            reply = oai.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": task.prompt}])
            ep.reward = score(task, reply.choices[0].message.content)  # ended with this reward on exit

The call style of AgentJet's swarm API works unchanged::

    episode_id, lease = client.begin_episode()
    try:
        output = run_agent(task, lease.base_url, lease.api_key)       # any object with `.reward`
        client.end_episode(task, episode_id, output)
    except Exception:
        client.abort_episode(episode_id)
        raise

Waiting and retrying. A refusal whose `error.retry_after_s` is set (the engine is BOOTING, ROLLING_POST or
WEIGHT_SYNCING, every lease slot is busy, or an end or prepare found the episode's own model call still generating
past the server's wait: `calls_in_flight`) is temporary: the call retries with exponential backoff (starting at
`retry_after_s`, capped at 5 s, with jitter) until its `timeout`, then raises `SwarmTimeout`. Any other error raises at
once (`SwarmRefused` for a 4xx, `SwarmError` otherwise); its `.code` is the server's `ErrorCode`: branch on that,
never on the message text. Transport errors (connection refused or reset, timeouts) are retried the same way on
idempotent calls: GETs, begin, config, stop, renew, and end, prepare and commit, which the server answers with the
stored outcome when it had already acted on the same request (`replayed`). Abort and start are retried only when the
request provably never left this machine (connection refused, connect or pool timeout).

A game spanning several servers commits with `prepare_episode` on each, then `commit_episode` on each (two-phase
commit; `marl.two_phase` drives it with the coordinator's decision log).

Thread safety: one `httpx.Client` (thread-safe) is shared by every thread; a `SwarmClient` holds no per-episode state,
so any number of threads may begin, end and abort episodes concurrently.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
import ssl
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import httpx
from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python

from marl.protocol import (
    ADMIN_TOKEN_ENV,
    AGENT_HEADER,
    CLIENT_KEEP_ALIVE_S,
    INCLUDE_POOL_PARAM,
    POLICY_PARAM,
    ROUTE_ABORT,
    ROUTE_BEGIN,
    ROUTE_COMMIT,
    ROUTE_CONFIG,
    ROUTE_END,
    ROUTE_EPISODE,
    ROUTE_FROZEN,
    ROUTE_FROZEN_ONE,
    ROUTE_HEALTH,
    ROUTE_MONITOR,
    ROUTE_POOL,
    ROUTE_PREPARE,
    ROUTE_RENEW,
    ROUTE_START,
    ROUTE_STATUS,
    ROUTE_STOP,
    RUNNING_STATES,
    AbortEpisodeResponse,
    BeginEpisodeRequest,
    ClientRequest,
    ConfigResponse,
    EndEpisodeRequest,
    EndEpisodeResponse,
    EngineState,
    EpisodeLease,
    EpisodeState,
    ErrorCode,
    ErrorInfo,
    ErrorResponse,
    FrozenPolicy,
    FrozenPolicyList,
    LoadFrozenPolicyRequest,
    MonitorSnapshot,
    PoolInfo,
    PrepareEpisodeRequest,
    PrepareEpisodeResponse,
    ServerStatus,
    TrainConfig,
)

if TYPE_CHECKING:  # the openai SDK is imported only when a client is asked for (it takes a while to import)
    import openai

__all__ = [
    "ADMIN_TOKEN_ENV",
    "RUNNING_STATES",
    "Episode",
    "EpisodeOutput",
    "SwarmClient",
    "SwarmError",
    "SwarmRefused",
    "SwarmTimeout",
]

log = logging.getLogger("marl.client")

_BACKOFF_CAP_S = 5.0  # longest pause between two retries (unless the server asks for longer)
_TRANSPORT_RETRY_S = 0.25  # first pause after a transport error (there is no retry_after_s to start from)
_JITTER = 0.25  # each pause is stretched by up to this fraction, so that waiting clients do not retry in lockstep

# Transport errors worth retrying at all (a malformed URL or a local protocol error is not).
_TRANSIENT = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
# Transport errors raised before a single byte of the request reached the server: safe to retry even for end/abort.
_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)

_M = TypeVar("_M", bound=BaseModel)
_Retry = Literal["always", "unsent"]


# --------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------


class SwarmError(Exception):
    """A swarm server call failed. Base class of every error this module raises for a server call.

    `status_code` is the HTTP status (None when no answer came back); `error` is the server's `ErrorInfo` (None when
    the server did not send one); `what` names the call (e.g. "begin_episode"). Branch on `code` (an `ErrorCode`),
    never on the message text.
    """

    def __init__(
        self, message: str, *, status_code: int | None = None, error: ErrorInfo | None = None, what: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.error = error
        self.what = what

    @property
    def code(self) -> ErrorCode | str | None:
        """The server's `error.code`: an `ErrorCode` member when it is one (a str enum, so `== "unauthorized"` holds
        too), the raw string for a code this version does not know (another server, a proxy), None without one."""
        return _error_code(self.error.code) if self.error else None

    @property
    def state(self) -> EngineState | None:
        return self.error.state if self.error else None

    def __str__(self) -> str:
        return self.message


def _error_code(code: str | None) -> ErrorCode | str | None:
    try:
        return ErrorCode(code) if code is not None else None
    except ValueError:
        return code


class SwarmRefused(SwarmError):
    """The server refused the call for good (a 4xx without `retry_after_s`): retrying the same call will not help."""


class SwarmTimeout(SwarmError, TimeoutError):
    """The call kept being told to wait (or could not reach the server) until its timeout ran out.

    `waited_s` is how long it tried, `last_state` the engine state the server last reported (None if unknown).
    """

    def __init__(
        self,
        message: str,
        *,
        waited_s: float = 0.0,
        last_state: EngineState | None = None,
        status_code: int | None = None,
        error: ErrorInfo | None = None,
        what: str | None = None,
    ) -> None:
        super().__init__(message, status_code=status_code, error=error, what=what)
        self.waited_s = waited_s
        self.last_state = last_state


# --------------------------------------------------------------------------------------------------------------
# Episode output
# --------------------------------------------------------------------------------------------------------------


@dataclass
class EpisodeOutput:
    """What `end_episode` reports. A bare float means `EpisodeOutput(reward=that_float)`.

    `agent_rewards` gives a different reward per agent tag (`X-Marl-Agent`); agents not listed get `reward`.
    `metadata` is stored with the episode (shown by the episode viewer); values that are not JSON become strings.
    Any object with a `.reward` attribute (and optionally `.agent_rewards`, `.metadata`) is accepted in its place,
    so AgentJet's `WorkflowOutput` works as is.
    """

    reward: float
    agent_rewards: dict[str, float] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def _task_id(task: Any) -> str:
    """A task id from a string, a number, an object with `.task_id` / `.id`, or a mapping with those keys."""
    if isinstance(task, str):
        task_id = task
    elif isinstance(task, int) and not isinstance(task, bool):
        task_id = str(task)
    elif isinstance(task, Mapping):
        value = task.get("task_id", task.get("id"))
        if value is None:
            raise TypeError(f"task mapping has neither 'task_id' nor 'id' key (keys: {sorted(map(str, task))})")
        task_id = str(value)
    else:
        value = getattr(task, "task_id", None)
        if value is None:
            value = getattr(task, "id", None)
        if value is None:
            raise TypeError(
                f"cannot get a task id from {type(task).__name__!r}: pass a string, or an object with a "
                "`task_id` (or `id`) attribute"
            )
        task_id = str(value)
    if not task_id:
        raise ValueError("task id is empty: episodes of the same task form a GRPO group, so the id must be non-empty")
    return task_id


def _reward(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)  # numpy / torch scalars
        except (TypeError, ValueError):
            raise TypeError(f"{what} must be a number, got {type(value).__name__!r} ({value!r})") from None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{what} is {value}: rewards must be finite (abort the episode instead of reporting it)")
    return value


def _output_fields(output: Any) -> tuple[float, dict[str, float] | None, dict[str, Any]]:
    """(reward, agent_rewards, metadata) from a number, an `EpisodeOutput`, any object with `.reward`, or a mapping."""
    if isinstance(output, (int, float)) and not isinstance(output, bool):
        return _reward(output, "reward"), None, {}
    if isinstance(output, Mapping):
        if "reward" not in output:
            raise TypeError(f"output mapping has no 'reward' key (keys: {sorted(map(str, output))})")
        reward, agent_rewards, metadata = output["reward"], output.get("agent_rewards"), output.get("metadata")
    elif hasattr(output, "reward"):
        reward = output.reward
        agent_rewards = getattr(output, "agent_rewards", None)
        metadata = getattr(output, "metadata", None)
    else:
        raise TypeError(
            f"cannot get a reward from {type(output).__name__!r}: pass a float, an EpisodeOutput, or any object "
            "with a `.reward` attribute"
        )
    if reward is None:
        raise ValueError("output.reward is None: set a reward, or call abort_episode() to discard the episode")
    rewards = None
    if agent_rewards is not None:
        if not isinstance(agent_rewards, Mapping):
            raise TypeError(f"agent_rewards must map agent tag -> reward, got {type(agent_rewards).__name__!r}")
        rewards = {str(k): _reward(v, f"agent_rewards[{k!r}]") for k, v in agent_rewards.items()}
    meta: dict[str, Any] = {}
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise TypeError(f"metadata must be a mapping, got {type(metadata).__name__!r}")
        meta = to_jsonable_python(dict(metadata), fallback=str)  # non-JSON values -> str; inf/nan -> null
    return _reward(reward, "reward"), rewards, meta


@functools.cache
def connection_limits(max_connections: int = 100) -> httpx.Limits:
    """Pool limits for a client many threads share: every connection may stay pooled, for `CLIENT_KEEP_ALIVE_S`.

    httpcore 1.0.9 closes an idle connection whenever the pool holds more connections *in all* than
    `max_keepalive_connections` (httpx's default: 20), or one idle past its keep-alive (httpx's default: 5 s), even
    one it has just handed to a thread that has not woken yet; that thread's request then hangs until its read
    timeout and fails with `ReadError: [Errno 9] Bad file descriptor` (encode/httpcore#1110; seen here with 1,000
    threads on one SwarmClient). With as many keep-alive connections as connections, and a keep-alive longer than
    a seat waits between calls, neither pass closes a connection that is about to be used.
    """
    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                        keepalive_expiry=CLIENT_KEEP_ALIVE_S)


def _plain_http_ssl_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def _state(value: EngineState | str) -> EngineState:
    try:
        return EngineState(value.upper() if isinstance(value, str) else value)
    except ValueError:
        raise ValueError(f"unknown engine state {value!r}; one of {[s.value for s in EngineState]}") from None


# --------------------------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------------------------


class SwarmClient:
    """Client of ONE swarm server: control plane (config, start/stop, status, pool) and episode leases.

    `url` is the server's root (e.g. "http://gpu-box:8000"). `admin_token` defaults to `$MARL_ADMIN_TOKEN`.
    `client_id` identifies this client as the holder of the leases it begins (only it may end or abort them); it
    defaults to a fresh random id. `timeout` bounds one HTTP request, and is the default time budget of calls that
    do not wait for the server (status, end, abort, ...); `max_wait_s` is the default budget of calls that do
    (begin_episode, wait_until_state, auto_sync_train_config_and_start_engine). Every call takes `timeout=` to
    override its budget.
    """

    def __init__(
        self,
        url: str,
        admin_token: str | None = None,
        *,
        client_id: str | None = None,
        timeout: float = 30.0,
        max_wait_s: float = 600.0,
        policy: str | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"swarm url must start with http:// or https://, got {url!r}")
        if timeout <= 0 or max_wait_s <= 0:
            raise ValueError(f"timeout and max_wait_s must be > 0 (got timeout={timeout}, max_wait_s={max_wait_s})")
        self.url = url.rstrip("/")
        #: One policy of a server of several: its status, pool, config, start and stop, and its episodes.
        self.policy = policy
        self._policy_params = {POLICY_PARAM: policy} if policy else None
        self.client_id = client_id or uuid.uuid4().hex
        self.timeout = float(timeout)
        self.max_wait_s = float(max_wait_s)
        token = admin_token if admin_token is not None else os.environ.get(ADMIN_TOKEN_ENV)
        self._has_token = bool(token)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # Plain-http servers need no TLS: reuse one context instead of building one (~0.1 s) per client.
        verify: Any = _plain_http_ssl_context() if self.url.startswith("http://") else True
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=self.timeout, verify=verify,
                                  limits=connection_limits())

    # -- lifecycle --------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection pool. Leases still held are not touched (they expire on the server)."""
        self._http.close()

    def __enter__(self) -> SwarmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        policy = f", policy={self.policy!r}" if self.policy else ""
        return f"SwarmClient({self.url!r}, client_id={self.client_id!r}{policy})"

    # -- control plane ----------------------------------------------------------------------------------------

    def health(self, timeout: float | None = None) -> bool:
        """True if the server answers its health check (no auth, no retry)."""
        try:
            resp = self._http.get(ROUTE_HEALTH, timeout=timeout or self.timeout)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    def status(self, *, timeout: float | None = None) -> ServerStatus:
        """Engine state, model, policy version, pool and metrics."""
        return self._call("GET", ROUTE_STATUS, ServerStatus, what="status", params=self._policy_params,
                          timeout=timeout)

    def pool(self, *, timeout: float | None = None) -> PoolInfo:
        """How far the rollout pool is from the next training step, and which leases are running."""
        return self._call("GET", ROUTE_POOL, PoolInfo, what="pool", params=self._policy_params, timeout=timeout)

    def monitor(self, *, timeout: float | None = None) -> MonitorSnapshot:
        """Everything `marl overwatch` shows: status, detailed pool, recent steps, tokens/s, latest errors."""
        return self._call("GET", ROUTE_MONITOR, MonitorSnapshot, what="monitor", params=self._policy_params,
                          timeout=timeout)

    def sync_train_config(
        self, config: TrainConfig | Mapping[str, Any], *, timeout: float | None = None
    ) -> ConfigResponse:
        """Send the full training config. Validated here first, so a typo in a key fails before any request.

        Raises `SwarmRefused` (409) if the engine is not OFFLINE and runs a different config.
        """
        cfg = self._as_config(config)
        return self._call(
            "POST", ROUTE_CONFIG, ConfigResponse, what="sync_train_config", json=cfg.model_dump(mode="json"),
            params=self._policy_params, timeout=timeout,
        )

    def start_engine(self, *, timeout: float | None = None) -> ServerStatus:
        """OFFLINE -> BOOTING (returns at once; see `wait_until_state`). 409 `engine_not_offline` otherwise."""
        return self._call("POST", ROUTE_START, ServerStatus, what="start_engine", retry="unsent",
                          params=self._policy_params, timeout=timeout)

    def stop_engine(self, *, timeout: float | None = None) -> ServerStatus:
        """Stop the engine (any state -> OFFLINE). This stops training for every client of this server."""
        return self._call("POST", ROUTE_STOP, ServerStatus, what="stop_engine", params=self._policy_params,
                          timeout=timeout)

    def load_frozen_policy(self, name: str, adapter: str | None, *, policy_version: int | None = None,
                           timeout: float | None = None) -> FrozenPolicy:
        """Serve a past adapter of one of the server's LoRA policies as frozen policy `name` (`speaker@3`): calls
        with `model=name` and the returned `api_key` at the server's /v1 run it, unrecorded. `adapter`: a PEFT
        adapter directory on the server's filesystem (None: the base model, a fresh adapter's outputs). Waits for
        the engine (up to `timeout`, default `max_wait_s`); loading the same name and adapter again is a no-op."""
        body = LoadFrozenPolicyRequest(name=name, adapter=adapter, policy_version=policy_version)
        return self._call("POST", ROUTE_FROZEN, FrozenPolicy, what="load_frozen_policy",
                          json=body.model_dump(mode="json"), timeout=self.max_wait_s if timeout is None else timeout)

    def frozen_policies(self, *, timeout: float | None = None) -> list[FrozenPolicy]:
        """The frozen policies the server's engine serves now (none after the engine restarted)."""
        return self._call("GET", ROUTE_FROZEN, FrozenPolicyList, what="frozen_policies", timeout=timeout).data

    def unload_frozen_policy(self, name: str, *, timeout: float | None = None) -> list[FrozenPolicy]:
        """Stop serving frozen policy `name` (its engine slot is freed once its calls finished); the ones left.
        `SwarmRefused` 404 `frozen_policy_not_found` if it is not loaded."""
        path = ROUTE_FROZEN_ONE.format(name=name)
        return self._call("DELETE", path, FrozenPolicyList, what="unload_frozen_policy", timeout=timeout).data

    def wait_until_state(
        self, *states: EngineState | str, timeout: float | None = None, poll_s: float = 1.0
    ) -> ServerStatus:
        """Poll the status until the engine is in one of `states` (default: any running state); return that status.

        Raises `SwarmTimeout` after `timeout` (default `max_wait_s`), and `SwarmError` if the engine falls from
        BOOTING back to OFFLINE while OFFLINE is not one of `states` (the boot failed: the error says why).
        """
        wanted = {_state(s) for s in states} if states else set(RUNNING_STATES)
        names = "/".join(sorted(s.value for s in wanted))
        budget = self.max_wait_s if timeout is None else timeout
        start = time.monotonic()
        deadline = start + budget
        pause = min(0.05, poll_s)
        seen_booting = False
        while True:
            st = self.status(timeout=max(deadline - time.monotonic(), 0.0))
            if st.state in wanted:
                return st
            if st.state is EngineState.BOOTING:
                seen_booting = True
            elif st.state is EngineState.OFFLINE and seen_booting:
                raise SwarmError(
                    f"wait for {names}: the engine at {self.url} went from BOOTING back to OFFLINE "
                    f"(last error: {st.last_error or 'none reported'}). Check the server log, fix the cause "
                    "(model path, memory, ...), then start it again.",
                    what="wait_until_state",
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SwarmTimeout(
                    f"wait for {names}: the engine at {self.url} is still {st.state.value} after "
                    f"{time.monotonic() - start:.1f}s (timeout={budget}s). Pass a larger timeout= (or max_wait_s=), "
                    "or check the server with `marl status`.",
                    waited_s=time.monotonic() - start, last_state=st.state, what="wait_until_state",
                )
            time.sleep(min(pause, remaining))
            pause = min(pause * 1.5, poll_s)

    def auto_sync_train_config_and_start_engine(
        self, config: TrainConfig | Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> ServerStatus:
        """Make the server train `config`, whatever state it is in; idempotent, safe to run from every client.

        - OFFLINE: sync the config, start the engine, wait until it runs.
        - BOOTING: check the config is the same, wait until it runs.
        - ROLLING / ROLLING_POST / WEIGHT_SYNCING with the same config: nothing to do.
        - running with a different config: raises `SwarmRefused` (call `stop_engine()` first, deliberately).
        - STATIC: raises `SwarmRefused` (a static server serves a fixed model and trains nothing).

        Returns the status once the engine runs. `config=None` means the server's defaults (`TrainConfig()`).
        """
        cfg = self._as_config(config if config is not None else TrainConfig())
        budget = self.max_wait_s if timeout is None else timeout
        deadline = time.monotonic() + budget

        def remaining() -> float:
            return max(deadline - time.monotonic(), 0.0)

        booted = False  # a boot was started by this call, or waited out: OFFLINE now means it failed
        while True:
            st = self.status(timeout=remaining())
            if st.static or st.state is EngineState.STATIC:
                raise self._static_refusal(st)
            if st.state in RUNNING_STATES:
                self._check_same_config(cfg, st, remaining())
                return st
            if st.state is EngineState.BOOTING:
                self._check_same_config(cfg, st, remaining())
                self.wait_until_state(*RUNNING_STATES, EngineState.OFFLINE, timeout=remaining())
                booted = True
                continue  # re-check: running (another client may have reconfigured it meanwhile) or failed
            if st.state is EngineState.OFFLINE:
                if booted:  # never restart a failing boot in a loop
                    raise SwarmError(
                        f"auto_sync_train_config_and_start_engine: the engine at {self.url} fell back to OFFLINE "
                        f"after booting (last error: {st.last_error or 'none reported'}). Check the server log, fix "
                        "the cause (model path, memory, ...), then run this again.",
                        what="auto_sync_train_config_and_start_engine",
                    )
                self.sync_train_config(cfg, timeout=remaining())
                try:
                    self.start_engine(timeout=remaining())
                    booted = True
                except SwarmRefused as exc:
                    if exc.code is not ErrorCode.ENGINE_NOT_OFFLINE:
                        raise
                    log.info("start_engine on %s raced with another client (already started); re-checking", self.url)
                continue
            raise SwarmError(f"auto_sync_train_config_and_start_engine: unexpected engine state {st.state}")

    def _static_refusal(self, st: ServerStatus) -> SwarmRefused:
        message = (
            f"auto_sync_train_config_and_start_engine: {self.url} is a STATIC server (it serves {st.model!r} without "
            "training). Do not sync a train config to it; call its model directly."
        )
        error = ErrorInfo(message=message, code=ErrorCode.STATIC_SERVER.value, state=st.state)
        return SwarmRefused(message, error=error, what="auto_sync_train_config_and_start_engine")

    def _check_same_config(self, cfg: TrainConfig, st: ServerStatus, timeout: float) -> None:
        """Sync `cfg` to a started engine: accepted only if it equals the running config (the server compares the
        validated configs, so an AgentJet-style flat `learning_rate` equals the same value given in `grpo`)."""
        try:
            self.sync_train_config(cfg, timeout=timeout)
        except SwarmRefused as exc:
            if exc.code is not ErrorCode.ENGINE_NOT_OFFLINE:
                raise
            raise SwarmRefused(
                f"auto_sync_train_config_and_start_engine: the engine at {self.url} is {st.state.value} with a "
                f"different train config ({exc.error.message if exc.error else exc}). To change it, call "
                "stop_engine() first (this stops training for every client of this server), then run this again; "
                "or sync the same config the server runs.",
                status_code=409, error=exc.error, what="auto_sync_train_config_and_start_engine",
            ) from exc

    # -- episodes ---------------------------------------------------------------------------------------------

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
        body = EndEpisodeRequest(client_id=self.client_id, task_id=_task_id(task), **self._output_body(output))
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
        body = PrepareEpisodeRequest(client_id=self.client_id, task_id=_task_id(task), game_id=game_id,
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
        reward, agent_rewards, metadata = _output_fields(output)
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

    def episode(
        self, task: Any, *, timeout: float | None = None, heartbeat_s: float | None = None, policy: str | None = None
    ) -> Episode:
        """Context manager: begin a lease on enter, end or abort it on exit. A crash never leaks a lease.

        Inside the block set `ep.reward` (and optionally `ep.agent_rewards`, `ep.metadata`): the episode is ended
        with it on a normal exit. Or call `ep.end(output)` yourself. If the block raises, the episode is aborted and
        the exception propagates; if it exits without a reward, the episode is aborted with a warning.
        `heartbeat_s` renews the lease in the background every that many seconds (for agents that think long
        between model calls). `timeout` bounds the wait for the lease. `policy`: as in `begin_episode`.
        """
        return Episode(self, task, timeout=timeout, heartbeat_s=heartbeat_s, policy=policy)

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
            headers[AGENT_HEADER] = agent
        return {"base_url": lease.base_url, "api_key": lease.api_key, "default_headers": headers or None, **kwargs}

    # -- plumbing -----------------------------------------------------------------------------------------------

    @staticmethod
    def _as_config(config: TrainConfig | Mapping[str, Any]) -> TrainConfig:
        if isinstance(config, TrainConfig):
            return config
        if isinstance(config, Mapping):
            return TrainConfig.model_validate(dict(config))  # ValidationError names the bad key
        raise TypeError(f"config must be a TrainConfig or a dict of its fields, got {type(config).__name__!r}")

    def _call(
        self,
        method: str,
        path: str,
        model: type[_M],
        *,
        what: str,
        json: Any = None,
        params: dict[str, str] | None = None,
        retry: _Retry = "always",
        timeout: float | None = None,
        episode_id: str | None = None,
    ) -> _M:
        """One call: retries temporary refusals (and transport errors, per `retry`) with backoff until `timeout`."""
        budget = self.timeout if timeout is None else timeout
        start = time.monotonic()
        deadline = start + budget
        attempt = 0
        while True:
            # One request never runs past the client's timeout, and gets at least a second (or `timeout` if smaller).
            request_timeout = min(self.timeout, max(deadline - time.monotonic(), 1.0))
            outcome = self._attempt(
                _Request(method, path, what, json, params, retry, episode_id), model, request_timeout
            )
            if not isinstance(outcome, _Wait):
                return outcome
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout_error(what, budget, time.monotonic() - start, outcome)
            # Exponential backoff from the server's hint, capped (but never below what the server asked), + jitter.
            pause = outcome.pause_s
            delay = min(pause * 2**attempt, max(_BACKOFF_CAP_S, pause)) * (1.0 + _JITTER * random.random())
            log.debug("%s: %s; retrying in %.2fs", what, outcome.error.message if outcome.error else outcome.exc, delay)
            attempt += 1
            time.sleep(min(delay, remaining))

    def _attempt(self, req: _Request, model: type[_M], timeout: float) -> _M | _Wait:
        """One request: the parsed answer, or how long to wait before the next try; raises when retrying cannot help."""
        try:
            resp = self._http.request(req.method, req.path, json=req.json, params=req.params, timeout=timeout)
        except _TRANSIENT as exc:
            if req.retry == "unsent" and not isinstance(exc, _NEVER_SENT):
                raise self._maybe_acted_error(req, exc) from exc
            return _Wait(_TRANSPORT_RETRY_S, exc=exc)
        except httpx.HTTPError as exc:  # not transient: a bad url, a local protocol error, ...
            raise SwarmError(
                f"{req.what}: request to {self.url}{req.path} failed: {type(exc).__name__}: {exc}", what=req.what
            ) from exc
        if resp.is_success:
            try:
                return model.model_validate(resp.json())
            except (ValueError, ValidationError) as exc:
                raise SwarmError(
                    f"{req.what}: {self.url}{req.path} answered HTTP {resp.status_code} with a body that is not a "
                    f"{model.__name__} ({str(exc)[:300]}). Is this a marl swarm server of the same version?",
                    status_code=resp.status_code, what=req.what,
                ) from exc
        err = self._error(resp, req.what, req.episode_id)
        if err.error is None or err.error.retry_after_s is None:
            raise err
        return _Wait(err.error.retry_after_s, status_code=resp.status_code, error=err.error)

    def _maybe_acted_error(self, req: _Request, exc: Exception) -> SwarmError:
        """A non-idempotent call whose answer was lost: retrying could apply it twice, so say how to find out."""
        check = (
            f"Check with can_continue_episode({req.episode_id!r}): False means it is gone."
            if req.episode_id
            else "Check with status()."
        )
        return SwarmError(
            f"{req.what}: the connection to {self.url} failed after the request was sent "
            f"({type(exc).__name__}: {exc or 'no detail'}); the server may or may not have acted on it. {check}",
            what=req.what,
        )

    def _timeout_error(self, what: str, budget: float, waited: float, last: _Wait) -> SwarmTimeout:
        if last.exc is not None:
            reason = f"could not reach the server ({type(last.exc).__name__}: {last.exc or 'no detail'})"
            hint = "Is the server running and the url right? `marl status URL` checks it."
        else:
            assert last.error is not None
            state = f"engine {last.error.state.value}" if last.error.state else "engine state not reported"
            reason = f"the server kept saying to wait ({state}: {last.error.message})"
            hint = "Pass a larger timeout= (or SwarmClient(max_wait_s=...)), or check the server with `marl status`."
        err = SwarmTimeout(
            f"{what}: gave up after {waited:.1f}s (timeout={budget}s) at {self.url}: {reason}. {hint}",
            waited_s=waited, last_state=last.error.state if last.error else None, status_code=last.status_code,
            error=last.error, what=what,
        )
        if last.exc is not None:
            err.__cause__ = last.exc
        return err

    def _error(self, resp: httpx.Response, what: str, episode_id: str | None) -> SwarmError:
        """The server's error body as an exception whose message says what to do."""
        status = resp.status_code
        info = _error_info(resp, episode_id)
        if info.retry_after_s is not None:
            return SwarmError(info.message, status_code=status, error=info, what=what)
        message = f"{what}: {self.url} refused (HTTP {status}"
        message += f", code {info.code}" if info.code else ""
        message += f", engine {info.state.value}" if info.state else ""
        message += f"): {info.message}"
        hint = self._hint(what, status, _error_code(info.code), episode_id)
        if hint:
            message += f" -- {hint}"
        cls = SwarmRefused if 400 <= status < 500 else SwarmError
        return cls(message, status_code=status, error=info, what=what)

    def _hint(self, what: str, status: int, code: ErrorCode | str | None, episode_id: str | None) -> str:
        """What to do about a refusal, by its error code (by the HTTP status only for bodies that carry none)."""
        if code is ErrorCode.UNAUTHORIZED or (code is None and status == 401):
            return self._token_hint()
        if code in (ErrorCode.ROUTE_NOT_FOUND, ErrorCode.METHOD_NOT_ALLOWED):
            return f"{self.url} has no such route: is it a marl swarm server of the same version?"
        if code is ErrorCode.INVALID_REQUEST or (code is None and status == 422):
            return "the server rejected the request body: are client and server the same marl version?"
        if code is ErrorCode.NOT_LEASE_HOLDER:
            return (
                f"episode {episode_id} is held by another client; only the client that began it (same client_id, "
                f"this one is {self.client_id!r}) may end, abort or renew it."
            )
        if code is ErrorCode.EPISODE_NOT_FOUND:
            return (
                "the episode is unknown, already ended or aborted, or its lease expired (idle longer than "
                "patience_s): its result was not recorded. For agents that pause between model calls, call "
                "renew_episode() or use episode(..., heartbeat_s=...)."
            )
        if code is ErrorCode.EPISODE_ALREADY_ENDED:
            return ("the episode was recorded already (ended, prepared or committed) with another request; only the"
                    " very same request may be repeated.")
        if code is ErrorCode.EPISODE_ABORTED:
            return "the prepared episode was aborted (by its holder, or by the server at its deadline)."
        if code is ErrorCode.REQUEST_TOO_LARGE:
            return "the request body is over the server's limit (marl serve --max-body-mb)."
        if code is ErrorCode.STATIC_SERVER:
            return "a STATIC server grants no leases and trains nothing: call its OpenAI endpoint directly."
        if code is ErrorCode.ENGINE_NOT_ROLLING:
            return "start the engine first: client.auto_sync_train_config_and_start_engine(config)."
        if code is ErrorCode.ENGINE_NOT_OFFLINE:
            return self._not_offline_hint(what)
        return ""

    def _token_hint(self) -> str:
        if not self._has_token:
            return (
                f"no admin token was given: pass SwarmClient(url, admin_token=...) or set ${ADMIN_TOKEN_ENV} to "
                "the server's admin token."
            )
        return f"the admin token was rejected: use the token the server was started with (${ADMIN_TOKEN_ENV})."

    @staticmethod
    def _not_offline_hint(what: str) -> str:
        if what == "start_engine":
            return (
                "the engine is already started; auto_sync_train_config_and_start_engine() is the idempotent "
                "way, or stop_engine() first to restart it."
            )
        if what == "sync_train_config":
            return (
                "the engine runs a different config: stop_engine() first (stops training for every client), "
                "or sync the same config."
            )
        return ""


def _pool_param(include_pool: bool) -> dict[str, str] | None:
    """The query of an end or commit that asks for the pool's progress in its reply (none: the server skips it)."""
    return {INCLUDE_POOL_PARAM: "true"} if include_pool else None


def _error_info(resp: httpx.Response, episode_id: str | None) -> ErrorInfo:
    """The server's `ErrorInfo`; for a body outside the protocol (a proxy, a bare FastAPI 404), one made from it."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "error" in body:
        try:
            return ErrorResponse.model_validate(body).error
        except ValidationError:
            pass
    detail = body.get("detail") if isinstance(body, dict) else None
    text = str(detail) if detail is not None else (resp.text[:300] or resp.reason_phrase)
    code = None
    if detail is not None and episode_id is None:  # a framework's own "no such route": not our protocol's server
        code = {404: ErrorCode.ROUTE_NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}.get(resp.status_code)
    return ErrorInfo(message=text, code=code.value if code else None)


@dataclass(frozen=True)
class _Request:
    """What `SwarmClient._call` sends, and how it may be retried."""

    method: str
    path: str
    what: str
    json: Any
    params: dict[str, str] | None
    retry: _Retry
    episode_id: str | None


@dataclass(frozen=True)
class _Wait:
    """A try that may be repeated: the pause the server asked for (or a transport error's), and why."""

    pause_s: float
    status_code: int | None = None
    error: ErrorInfo | None = None
    exc: Exception | None = None


# --------------------------------------------------------------------------------------------------------------
# The episode context manager
# --------------------------------------------------------------------------------------------------------------


class Episode:
    """One lease, as a context manager (see `SwarmClient.episode`).

    Attributes: `episode_id`, `lease`, `base_url`, `api_key`, `model`, `task_id`; set `reward` (and optionally
    `agent_rewards`, `metadata`) to have the episode ended with it on exit; `result` holds the server's
    `EndEpisodeResponse` once ended, `aborted` is True once aborted.
    """

    def __init__(self, client: SwarmClient, task: Any, *, timeout: float | None, heartbeat_s: float | None,
                 policy: str | None = None) -> None:  # fmt: skip
        if heartbeat_s is not None and heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self.client = client
        self.task = task
        self.task_id = _task_id(task)  # fail before claiming a lease
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
