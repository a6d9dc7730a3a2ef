"""`Refusal`: a request a swarm server turns down, raised anywhere in `servers/` and turned into HTTP by `servers.app`.

Every refusal names an `ErrorCode` (clients branch on it, never on the message); its OpenAI `type` follows from the
code, so two refusals with one code never disagree about who is at fault.
"""

from __future__ import annotations

from dataclasses import dataclass

from marl.protocol import EngineState, ErrorCode, ErrorInfo, ErrorType

#: The OpenAI error type of the codes that are not plain invalid requests.
_TYPE_OF_CODE = {
    ErrorCode.UNAUTHORIZED: ErrorType.AUTHENTICATION,
    ErrorCode.INVALID_API_KEY: ErrorType.AUTHENTICATION,
    ErrorCode.NOT_LEASE_HOLDER: ErrorType.PERMISSION,
    ErrorCode.ENGINE_ERROR: ErrorType.SERVER,
    ErrorCode.INTERNAL_ERROR: ErrorType.SERVER,
}


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
            self.type = _TYPE_OF_CODE.get(self.code, ErrorType.INVALID_REQUEST)

    def __str__(self) -> str:
        return self.message

    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=self.type.value, code=self.code.value, param=self.param,
                         state=self.state, retry_after_s=self.retry_after_s)
