"""`ProxyError`: an answer the proxy gives the app instead of a completion, OpenAI-shaped (`marl.protocol.ErrorInfo`).

Codes are `ErrorCode` members, as the swarm server's are, so an app (or the openai SDK) branches on them the same
way; a temporary refusal carries `retry_after_s`, sent as a `Retry-After` header too.
"""

from __future__ import annotations

import httpx
from pydantic import ValidationError

from marl.protocol import EngineState, ErrorCode, ErrorInfo, ErrorResponse, error_type_of


class ProxyError(Exception):
    """The app gets HTTP `status` with this error instead of a completion."""

    def __init__(self, status: int, code: ErrorCode, message: str, *, retry_after_s: float | None = None,
                 state: EngineState | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, ErrorCode(code), message
        self.retry_after_s, self.state, self.param = retry_after_s, state, param

    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=error_type_of(self.code).value, code=self.code.value,
                         param=self.param, state=self.state, retry_after_s=self.retry_after_s)


def upstream_error(response: httpx.Response) -> ProxyError:
    """What the app gets when the swarm server refused a candidate's call.

    The app's own mistakes (a 4xx: context too long, bad messages) pass through as they are. A dead lease key means
    the server dropped the lease mid-request (the engine stopped or restarted): a temporary 503. A server failure
    becomes 502 with the server's code.
    """
    info = _error_info(response)
    try:
        code = ErrorCode(info.code)
    except ValueError:
        code = ErrorCode.HTTP_ERROR
    status = response.status_code
    if code is ErrorCode.INVALID_API_KEY:
        return ProxyError(503, ErrorCode.ENGINE_UNAVAILABLE, f"the swarm server dropped a candidate's lease mid-request"
                          f" ({info.message}); retry", retry_after_s=1.0, state=info.state)
    if status >= 500 and info.retry_after_s is None:
        return ProxyError(502, code, f"the swarm server failed a candidate: {info.message}", state=info.state)
    return ProxyError(status, code, info.message, retry_after_s=info.retry_after_s, state=info.state,
                      param=info.param)


def _error_info(response: httpx.Response) -> ErrorInfo:
    try:
        return ErrorResponse.model_validate_json(response.content).error
    except ValidationError:
        return ErrorInfo(message=f"HTTP {response.status_code}: {response.text[:300]}")
