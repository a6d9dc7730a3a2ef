"""HTTP for `marl proxy`: the OpenAI and Anthropic routes the app calls, authenticated by the proxy's own API key.

`/v1/chat/completions`, `/v1/responses` and `/v1/messages` (streamed or not; the last two translated to chat
completions by `marl.apis`, answered with the best candidate and translated back) and `/v1/models` need
`Authorization: Bearer <the proxy's API key>` (or the anthropic SDK's `x-api-key`): a key
of its own, which is never the swarm server's admin token and never leaves the proxy (candidates are generated with
lease keys). `/health` and the Prometheus `/metrics` are open (counts only). Every error is an OpenAI-shaped
`ErrorResponse` with an `ErrorCode`. `app.state.service` is the `ProxyService` (tests look inside it).
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from marl.apis import messages as messages_api
from marl.apis import responses as responses_api
from marl.apis.messages import AnthropicErrors, MessagesRequest
from marl.apis.responses import ResponsesRequest
from marl.client import SwarmClient
from marl.protocol import (
    EPISODE_KEY_PREFIX,
    ROUTE_CHAT,
    ROUTE_HEALTH,
    ROUTE_MESSAGES,
    ROUTE_METRICS,
    ROUTE_MODELS,
    ROUTE_RESPONSES,
    ChatCompletionRequest,
    ErrorCode,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from marl.proxy.candidates import CandidateCaller
from marl.proxy.errors import ProxyError
from marl.proxy.leases import LeaseBroker
from marl.proxy.metrics import ProxyMetrics
from marl.proxy.rewards import RewardFunction
from marl.proxy.service import ProxyService
from marl.proxy.stream import reply_events, sse_events

log = logging.getLogger("marl.proxy")


@dataclass(frozen=True)
class ProxyOptions:
    server_url: str  # the swarm server's root URL
    admin_token: str  # the swarm server's admin token: the proxy begins and ends episodes with it
    api_key: str  # what the app must send; never the admin token
    reward: RewardFunction
    num_repeat: int  # candidates per request (episodes per GRPO group)
    served_model: str  # the model /v1/models lists and replies name
    max_wait_s: float = 60.0  # longest wait for leases before a 503
    conversation_idle_s: float = 30.0  # how long a conversation's lease is held for its next turn; 0: never

    def __post_init__(self) -> None:
        if not self.api_key or secrets.compare_digest(self.api_key.encode(), self.admin_token.encode()):
            raise ValueError("the proxy's API key must be set and differ from the swarm server's admin token: the app"
                             " must never hold a key to the swarm's control plane")
        if self.num_repeat < 1 or self.max_wait_s < 0 or self.conversation_idle_s < 0:
            raise ValueError(f"need num_repeat >= 1, max_wait_s >= 0, conversation_idle_s >= 0 (got {self})")


def build_app(options: ProxyOptions) -> FastAPI:
    metrics = ProxyMetrics()
    client = SwarmClient(options.server_url, admin_token=options.admin_token,
                         client_id=f"marl-proxy-{uuid.uuid4().hex}")
    service = ProxyService(LeaseBroker(client, max_wait_s=options.max_wait_s, metrics=metrics), CandidateCaller(),
                           options.reward, num_repeat=options.num_repeat,
                           conversation_idle_s=options.conversation_idle_s, metrics=metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await service.start()
        yield
        await service.close()

    app = FastAPI(title="marl proxy", lifespan=lifespan)
    app.state.service = service
    for error, handler in _ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
    app.include_router(_open_routes(metrics))
    app.include_router(_app_routes(service, options.served_model), dependencies=[Depends(_app_auth(options.api_key))])
    app.add_middleware(AnthropicErrors)  # every error on /v1/messages in Anthropic's shape
    app.openapi()  # builds the routes' models here, not in the serving thread: see servers.http.openapi.install
    return app


def _open_routes(metrics: ProxyMetrics) -> APIRouter:
    router = APIRouter()

    @router.get(ROUTE_HEALTH)
    async def health() -> dict:
        return {"ok": True}

    @router.get(ROUTE_METRICS)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def _app_routes(service: ProxyService, served_model: str) -> APIRouter:
    router = APIRouter()

    @router.get(ROUTE_MODELS)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model)])

    @router.post(ROUTE_CHAT, response_model=None)
    async def chat_completions(body: ChatCompletionRequest):
        reply = await service.chat(body)
        if not body.stream:
            return reply
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(sse_events(reply, include_usage=usage), media_type="text/event-stream")

    @router.post(ROUTE_RESPONSES, response_model=None)
    async def responses(body: ResponsesRequest):
        reply = await service.chat(_as_chat(body))
        if not body.stream:
            return JSONResponse(responses_api.reply(body, reply))
        return StreamingResponse(responses_api.stream(body, reply.model, reply_events(reply)),
                                 media_type="text/event-stream")

    @router.post(ROUTE_MESSAGES, response_model=None)
    async def messages(body: MessagesRequest):
        reply = await service.chat(_as_chat(body))
        if not body.stream:
            return JSONResponse(messages_api.reply(reply))
        return StreamingResponse(messages_api.stream(reply.model, reply.usage.prompt_tokens, reply_events(reply)),
                                 media_type="text/event-stream")

    return router


def _as_chat(body: ResponsesRequest | MessagesRequest) -> ChatCompletionRequest:
    """The app's request as chat completions: what candidates are generated from and rewards and conversations see."""
    try:
        return body.to_chat()
    except ValueError as exc:
        raise ProxyError(400, ErrorCode.INVALID_REQUEST, str(exc)) from exc


def _app_auth(api_key: str):
    def check(authorization: str | None = Header(None), x_api_key: str | None = Header(None)) -> None:
        token = authorization[7:].strip() if authorization and authorization.lower().startswith("bearer ") else None
        token = token if token is not None else x_api_key  # the anthropic SDK's header
        if token is not None and secrets.compare_digest(token.encode(), api_key.encode()):
            return
        if token is None:
            message = "missing 'Authorization: Bearer <API key>': the key `marl proxy` was given (--api-key-env)"
        elif token.startswith(EPISODE_KEY_PREFIX):
            message = "an episode key of the swarm server is not a key of this proxy: use the proxy's API key"
        else:
            message = "wrong API key for this proxy (its own key, not the swarm server's admin token)"
        raise ProxyError(401, ErrorCode.INVALID_API_KEY, message)

    return check


# --- errors --------------------------------------------------------------------------------------------------------


def _error_response(error: ProxyError) -> JSONResponse:
    headers = {"Retry-After": str(math.ceil(error.retry_after_s))} if error.retry_after_s else None
    return JSONResponse(ErrorResponse(error=error.info()).model_dump(mode="json"), status_code=error.status,
                        headers=headers)


async def _proxy_error(_: Request, exc: ProxyError) -> JSONResponse:
    return _error_response(exc)


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    problems = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
                         for e in exc.errors())
    return _error_response(ProxyError(400, ErrorCode.INVALID_REQUEST, f"invalid request: {problems}"))


_HTTP_ERROR_CODES = {404: ErrorCode.ROUTE_NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = _HTTP_ERROR_CODES.get(exc.status_code, ErrorCode.HTTP_ERROR)
    return _error_response(ProxyError(exc.status_code, code, f"{exc.detail}: {request.method} {request.url.path}"))


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    log.error("unexpected error: %r", exc)  # Starlette logs the traceback after this answer is sent
    return _error_response(ProxyError(500, ErrorCode.INTERNAL_ERROR, f"internal proxy error: {exc}"))


_ERROR_HANDLERS = {ProxyError: _proxy_error, RequestValidationError: _invalid, StarletteHTTPException: _http_error,
                   Exception: _internal_error}
