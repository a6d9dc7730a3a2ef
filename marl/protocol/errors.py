"""The engine's states and the error vocabulary: every `error.code` a swarm server sends, its OpenAI `type`, and
the error body (`{"error": {...}}`) with what a client needs to decide whether to retry."""

from __future__ import annotations

import enum

from pydantic import BaseModel


class EngineState(str, enum.Enum):
    OFFLINE = "OFFLINE"  # process up, no model loaded; waiting for config + start
    BOOTING = "BOOTING"  # loading the model (and the trainer)
    ROLLING = "ROLLING"  # granting leases, serving calls
    ROLLING_POST = "ROLLING_POST"  # batch complete: no new leases, running ones may finish
    WEIGHT_SYNCING = "WEIGHT_SYNCING"  # training step + publishing the new weights
    STATIC = "STATIC"  # `marl serve --static`: serves the model, no leases, no training


#: States of a trainable engine that has been started (serving, draining or training).
RUNNING_STATES = frozenset({EngineState.ROLLING, EngineState.ROLLING_POST, EngineState.WEIGHT_SYNCING})


class ErrorType(enum.StrEnum):
    """OpenAI's error `type`: the broad class of an error."""

    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    PERMISSION = "permission_error"
    SERVER = "server_error"


class ErrorCode(enum.StrEnum):
    """Every `error.code` a swarm server sends. Clients branch on these, never on the message text."""

    # 400: the request itself is wrong
    INVALID_REQUEST = "invalid_request"  # body or parameters fail validation
    INVALID_MESSAGES = "invalid_messages"  # messages cannot be rendered into a prompt
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt + max_tokens over the model's context
    UNSUPPORTED_VALUE = "unsupported_value"  # a parameter value this server does not support (it says which)
    # 401 / 403: who is asking
    UNAUTHORIZED = "unauthorized"  # control plane: missing or wrong admin token
    INVALID_API_KEY = "invalid_api_key"  # data plane: missing, unknown or dead episode key
    NOT_LEASE_HOLDER = "not_lease_holder"  # another client holds the episode
    # 404 / 405: what is asked for does not exist
    EPISODE_NOT_FOUND = "episode_not_found"
    MODEL_NOT_FOUND = "model_not_found"
    POLICY_NOT_FOUND = "policy_not_found"  # a `policy` this server does not train
    POLICY_REQUIRED = "policy_required"  # 400: the server trains several policies and the call names none
    FROZEN_POLICY_NOT_FOUND = "frozen_policy_not_found"  # unloading a frozen policy that is not loaded
    ROUTE_NOT_FOUND = "route_not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    # 413: the body is over the server's limit (marl serve --max-body-mb)
    REQUEST_TOO_LARGE = "request_too_large"
    # 409: not in this state (do something else first)
    ENGINE_NOT_OFFLINE = "engine_not_offline"
    STATIC_SERVER = "static_server"
    NO_POLICIES = "no_policies"  # frozen policies need a server of LoRA policies
    FROZEN_POLICY_EXISTS = "frozen_policy_exists"  # a frozen policy of that name is loaded from another adapter
    EPISODE_ALREADY_ENDED = "episode_already_ended"  # ended, prepared or committed with another body; abort too late
    EPISODE_NOT_PREPARED = "episode_not_prepared"  # commit of an episode that is still running
    EPISODE_ABORTED = "episode_aborted"  # commit of a prepared episode that was aborted (or timed out: presumed abort)
    # 409 or 503: no lease now (503 with retry_after_s while BOOTING / ROLLING_POST / WEIGHT_SYNCING)
    ENGINE_NOT_ROLLING = "engine_not_rolling"
    # 503: wait and retry (retry_after_s is set)
    NO_FREE_SLOT = "no_free_slot"
    # `overlap`: a step trains and enough episodes wait for the next ones that a lease begun now would be trained
    # more than `max_staleness` versions late (servers.training.loop bounds the rollouts)
    ROLLOUTS_AHEAD = "rollouts_ahead"
    ENGINE_BOOTING = "engine_booting"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    LEDGER_UNAVAILABLE = "ledger_unavailable"  # the ledger write failed; nothing changed, the lease is still live
    # end or prepare waited (`servers.episodes.recorder.CALLS_WAIT_S`) for the lease's calls still generating, and some
    # still are: nothing changed, the lease is still live; the retry records them once they finish
    CALLS_IN_FLIGHT = "calls_in_flight"
    # 5xx: the server failed
    ENGINE_ERROR = "engine_error"  # generation failed
    # the model's logprobs overflowed (NaN or inf: an adapter's huge weights); the call is not recorded
    NON_FINITE_OUTPUT = "non_finite_output"
    INTERNAL_ERROR = "internal_error"  # anything unexpected
    HTTP_ERROR = "http_error"  # another HTTP-level refusal


def error_type_of(code: ErrorCode) -> ErrorType:
    """The OpenAI error type that goes with a code (who is at fault): one table for every server and the proxy."""
    return _ERROR_TYPE_OF_CODE.get(code, ErrorType.INVALID_REQUEST)


_ERROR_TYPE_OF_CODE = {
    ErrorCode.UNAUTHORIZED: ErrorType.AUTHENTICATION,
    ErrorCode.INVALID_API_KEY: ErrorType.AUTHENTICATION,
    ErrorCode.NOT_LEASE_HOLDER: ErrorType.PERMISSION,
    ErrorCode.ENGINE_ERROR: ErrorType.SERVER,
    ErrorCode.NON_FINITE_OUTPUT: ErrorType.SERVER,
    ErrorCode.INTERNAL_ERROR: ErrorType.SERVER,
    ErrorCode.LEDGER_UNAVAILABLE: ErrorType.SERVER,
}


class ErrorInfo(BaseModel):
    """OpenAI-shaped error (`{"error": {...}}`), plus what a client needs to decide whether to retry."""

    message: str
    type: str = ErrorType.INVALID_REQUEST.value
    #: An `ErrorCode` value from a swarm server; a str here so that errors from other servers still parse.
    code: str | None = None
    param: str | None = None
    state: EngineState | None = None
    #: Set when the refusal is temporary ("wait"): the client may retry after this many seconds.
    retry_after_s: float | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
