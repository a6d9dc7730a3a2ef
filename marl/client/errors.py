"""The exceptions a `SwarmClient` raises, and how a server's refusal becomes one of them.

The tree (every one carries `status_code`, the server's `error` (`ErrorInfo`) and `what`, the call's name)::

    SwarmError                      a call failed: a 5xx, an answer that is not the protocol's, a lost connection
    ├── SwarmRefused                a 4xx without `retry_after_s`: refused for good, the same call will not help
    └── SwarmTimeout (TimeoutError) told to wait (or unreachable) until the call's time budget ran out

Branch on `.code` (an `ErrorCode`), never on the message text. A refusal that carries `retry_after_s` is not an
error yet: the transport core (`marl/client/core.py`) waits and retries it, and raises `SwarmTimeout` when the budget
runs out. `refusal()` builds the error of any other refusal, with a hint, by its error code, of what to do.
"""

from __future__ import annotations

import httpx
from pydantic import ValidationError

from marl.protocol import ADMIN_TOKEN_ENV, EngineState, ErrorCode, ErrorInfo, ErrorResponse


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
        return error_code(self.error.code) if self.error else None

    @property
    def state(self) -> EngineState | None:
        return self.error.state if self.error else None

    def __str__(self) -> str:
        return self.message


def error_code(code: str | None) -> ErrorCode | str | None:
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
# A refusal, as an error
# --------------------------------------------------------------------------------------------------------------


def refusal(
    resp: httpx.Response, what: str, episode_id: str | None, *, url: str, client_id: str, has_token: bool
) -> SwarmError:
    """The server's error body as an exception whose message says what to do.

    One that says to wait (`retry_after_s`) is a bare `SwarmError` holding the server's `ErrorInfo`, for the caller
    to retry; any other 4xx is a `SwarmRefused`, anything else a `SwarmError`. `url`, `client_id` and `has_token`
    (whether an admin token was sent) are the asking client's, for the hint.
    """
    status = resp.status_code
    info = error_info(resp, episode_id)
    if info.retry_after_s is not None:
        return SwarmError(info.message, status_code=status, error=info, what=what)
    message = f"{what}: {url} refused (HTTP {status}"
    message += f", code {info.code}" if info.code else ""
    message += f", engine {info.state.value}" if info.state else ""
    message += f"): {info.message}"
    hint = _hint(what, status, error_code(info.code), episode_id, url=url, client_id=client_id, has_token=has_token)
    if hint:
        message += f" -- {hint}"
    cls = SwarmRefused if 400 <= status < 500 else SwarmError
    return cls(message, status_code=status, error=info, what=what)


def error_info(resp: httpx.Response, episode_id: str | None) -> ErrorInfo:
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


def _hint(
    what: str, status: int, code: ErrorCode | str | None, episode_id: str | None, *, url: str, client_id: str,
    has_token: bool,
) -> str:
    """What to do about a refusal, by its error code (by the HTTP status only for bodies that carry none)."""
    if code is ErrorCode.UNAUTHORIZED or (code is None and status == 401):
        return _token_hint(has_token)
    if code in (ErrorCode.ROUTE_NOT_FOUND, ErrorCode.METHOD_NOT_ALLOWED):
        return f"{url} has no such route: is it a marl swarm server of the same version?"
    if code is ErrorCode.INVALID_REQUEST or (code is None and status == 422):
        return "the server rejected the request body: are client and server the same marl version?"
    if code is ErrorCode.NOT_LEASE_HOLDER:
        return (
            f"episode {episode_id} is held by another client; only the client that began it (same client_id, "
            f"this one is {client_id!r}) may end, abort or renew it."
        )
    if code is ErrorCode.ENGINE_NOT_OFFLINE:
        return _not_offline_hint(what)
    return _FIXED_HINTS.get(code, "")


#: The hints that depend on nothing but the error code.
_FIXED_HINTS = {
    ErrorCode.EPISODE_NOT_FOUND: (
        "the episode is unknown, already ended or aborted, or its lease expired (idle longer than "
        "patience_s): its result was not recorded. For agents that pause between model calls, call "
        "renew_episode() or use episode(..., heartbeat_s=...)."
    ),
    ErrorCode.EPISODE_ALREADY_ENDED: (
        "the episode was recorded already (ended, prepared or committed) with another request; only the"
        " very same request may be repeated."
    ),
    ErrorCode.EPISODE_ABORTED: "the prepared episode was aborted (by its holder, or by the server at its deadline).",
    ErrorCode.REQUEST_TOO_LARGE: "the request body is over the server's limit (marl serve --max-body-mb).",
    ErrorCode.STATIC_SERVER: "a STATIC server grants no leases and trains nothing: call its OpenAI endpoint directly.",
    ErrorCode.ENGINE_NOT_ROLLING: "start the engine first: client.auto_sync_train_config_and_start_engine(config).",
}


def _token_hint(has_token: bool) -> str:
    if not has_token:
        return (
            f"no admin token was given: pass SwarmClient(url, admin_token=...) (on marl's command line:"
            f" --admin-token) or set ${ADMIN_TOKEN_ENV} to the server's admin token."
        )
    return f"the admin token was rejected: use the token the server was started with (${ADMIN_TOKEN_ENV})."


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
