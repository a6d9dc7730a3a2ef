"""`Refusal`: a request a swarm server turns down, raised anywhere in `servers/`, and its HTTP answer.

Every refusal names an `ErrorCode` (clients branch on it, never on the message); its OpenAI `type` follows from the
code, so two refusals with one code never disagree about who is at fault. `refusal_response` is the one way a
refusal becomes an HTTP response (route handlers and the ASGI guards in front of them alike).
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from marl.protocol import EngineState, ErrorCode, ErrorInfo, ErrorResponse, ErrorType, error_type_of


@dataclass
class Refusal(Exception):
    """A request the server turns down: becomes an `ErrorResponse` with HTTP status `status`."""

    status: int
    code: ErrorCode
    message: str
    #: Set when the refusal is temporary: the client may retry after this many seconds (also a Retry-After header).
    retry_after_s: float | None = None
    state: EngineState | None = None
    type: ErrorType | None = None  # None: the type that goes with `code`
    param: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.code, ErrorCode):
            raise TypeError(f"a Refusal's code must be an ErrorCode, not {self.code!r}")
        if self.type is None:
            self.type = error_type_of(self.code)

    def __str__(self) -> str:
        return self.message

    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=self.type.value, code=self.code.value, param=self.param,
                         state=self.state, retry_after_s=self.retry_after_s)


def refusal_response(refusal: Refusal, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The OpenAI-shaped error body, with `Retry-After` when the refusal is temporary."""
    headers = dict(headers or {})
    if refusal.retry_after_s:
        headers["Retry-After"] = f"{refusal.retry_after_s:g}"
    return JSONResponse(ErrorResponse(error=refusal.info()).model_dump(mode="json"), status_code=refusal.status,
                        headers=headers or None)


def _short_repr() -> reprlib.Repr:
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother, short.maxlong = 3, 60, 40, 40
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 6
    return short


_SHORT = _short_repr()


def excerpt(value: Any, limit: int = 80) -> str:
    """A short repr of a value a client sent, for an error message: at most `limit` characters, built without the
    repr of the whole value (4 million integers took seconds to repr, and made a 3 MB error)."""
    text = _SHORT.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
