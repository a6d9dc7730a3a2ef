"""The OpenAPI document says what the server really answers.

Each route declares the error statuses it can send (`errors(...)`), all with the `ErrorResponse` body; FastAPI's
automatic 422 is taken out, because a body that fails validation is answered 400 `invalid_request` (OpenAI's
status), and so is its `HTTPValidationError` schema, which no response uses. Routes behind the admin token or a
lease key carry the bearer security scheme (`BEARER`), so a schema-driven client knows to authenticate.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Security
from fastapi.openapi.utils import get_openapi
from fastapi.security import HTTPBearer

from marl.protocol import ErrorResponse

_MEANING = {
    400: "Invalid request: the body or a parameter fails validation, or the messages cannot make a prompt.",
    401: "Missing or wrong credentials: the admin token (control and episode routes) or a live lease key (data"
         " plane).",
    403: "Another client holds the episode.",
    404: "No such episode (or model).",
    409: "Not in this state: see `error.code`.",
    413: "The request body is over the server's limit (marl serve --max-body-mb).",
    500: "Generation failed in the engine.",
    503: "Temporarily unavailable: retry after `error.retry_after_s`.",
}

#: Documents (in the schema only) that a route takes `Authorization: Bearer ...`; the check itself is
#: `servers.http.guards.RequestGate`'s, made before the body is read.
BEARER = Security(HTTPBearer(auto_error=False, description="The admin token, or a lease's api_key on /v1/chat."))


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route that may answer these error statuses."""
    return {status: {"model": ErrorResponse, "description": _MEANING[status]} for status in statuses}


def install(app: FastAPI) -> None:
    """Make `app.openapi()` the honest document, and build it now: call this once every route is added.

    Building it builds every route's request and response models too, here on the thread that makes the app.
    FastAPI would build them on the first request, in the serving thread, inside `warnings.catch_warnings()`
    (which silences pydantic's warning about the aliases FastAPI gives parameters); that is not thread-safe
    before Python 3.14, so servers of one process that start together leaked the warning.
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description=app.description)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    openapi()
