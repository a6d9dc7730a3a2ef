"""The transport core of `SwarmClient`: one server, one `httpx.Client`, and the retry loop every call runs through.

`ClientCore` holds what every call needs: the server's url, the admin token (a Bearer header), the client id that
owns the leases it begins, the policy of a server of several, the time budgets, and one pooled `httpx.Client`
(thread-safe, shared by every thread; `connection_limits` says why every connection stays pooled). Its `_call` sends
one request and turns the answer into the protocol's response model, or retries:

- a refusal whose `error.retry_after_s` is set (the engine is BOOTING, ROLLING_POST or WEIGHT_SYNCING, every lease
  slot is busy, an end or prepare found its episode's model call still generating: `calls_in_flight`) is
  temporary: retried with exponential backoff from `retry_after_s`, capped at 5 s, with jitter, until the call's
  budget, then `SwarmTimeout`;
- a transport error (connection refused or reset, a timeout) is retried the same way when the call allows it:
  `retry="always"` for idempotent calls (GETs, begin, config, stop, renew; end, prepare and commit, which the server
  answers with the outcome it stored when it had already acted: `replayed`), `retry="unsent"` (abort, start) only
  when the request provably never left this machine;
- anything else raises at once (`marl/client/errors.py`: `SwarmRefused` for a 4xx, `SwarmError` otherwise).

The API on top (`control.py`, `leases.py`) is mixins of this class; `SwarmClient` composes them.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import ssl
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Self, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from marl.client.errors import SwarmError, SwarmTimeout, refusal
from marl.protocol import ADMIN_TOKEN_ENV, CLIENT_KEEP_ALIVE_S, POLICY_PARAM, ErrorInfo

log = logging.getLogger("marl.client")  # one logger for the whole client (its users filter on this name)

_BACKOFF_CAP_S = 5.0  # longest pause between two retries (unless the server asks for longer)
_TRANSPORT_RETRY_S = 0.25  # first pause after a transport error (there is no retry_after_s to start from)
_JITTER = 0.25  # each pause is stretched by up to this fraction, so that waiting clients do not retry in lockstep

# Transport errors worth retrying at all (a malformed URL or a local protocol error is not).
_TRANSIENT = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
# Transport errors raised before a single byte of the request reached the server: safe to retry even for end/abort.
_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)

_M = TypeVar("_M", bound=BaseModel)
_Retry = Literal["always", "unsent"]


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


@dataclass(frozen=True)
class _Request:
    """What `ClientCore._call` sends, and how it may be retried."""

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


class ClientCore:
    """The connection to one server and the retry loop; the constructor and lifecycle of `SwarmClient`."""

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        policy = f", policy={self.policy!r}" if self.policy else ""
        return f"{type(self).__name__}({self.url!r}, client_id={self.client_id!r}{policy})"

    # -- one call, retried --------------------------------------------------------------------------------------

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
        err = refusal(resp, req.what, req.episode_id, url=self.url, client_id=self.client_id,
                      has_token=self._has_token)
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
            hint = "Is the server running, and are the url's host and port right?"
            if what != "status":  # never the advice to run what just failed (`marl status` is this call)
                hint += " `marl status URL` checks it."
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
