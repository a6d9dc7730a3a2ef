"""HTTP for one swarm server: routes, authentication and error bodies; every route is one call into the server.

Control and episode routes need `Authorization: Bearer <admin token>`; the data plane needs the api_key of a live
lease (a static server takes any); `/health` and the Prometheus `/metrics` are open. Every error is an OpenAI-shaped
`ErrorResponse` whose `code` is an `ErrorCode`, FastAPI's own refusals (unknown route, bad body) included.
`app.state.server` is the server object (tests look inside it).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable
from typing import Protocol

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from marl import protocol as p
from marl.protocol import EPISODE_KEY_PREFIX, EngineState, ErrorCode
from servers.errors import Refusal
from servers.serving import ChatService
from servers.static import StaticServer
from servers.trainable import TrainableServer

log = logging.getLogger("marl.server")


class SwarmServer(Protocol):
    """What every route but the training ones needs of a server: `TrainableServer` and `StaticServer` have it."""

    served_name: str
    state: EngineState
    chat: ChatService

    async def startup(self) -> None: ...
    async def shutdown(self) -> None: ...
    async def status(self) -> p.ServerStatus: ...
    async def monitor(self) -> p.MonitorSnapshot: ...
    async def metrics_text(self) -> bytes: ...


def create_app(server: TrainableServer | StaticServer, admin_token: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await server.startup()
        yield
        await server.shutdown()

    app = FastAPI(title="marl swarm server", lifespan=lifespan)
    app.state.server = server
    for error, handler in _ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
    admin = [Depends(_admin_auth(admin_token))]
    app.include_router(_open_routes(server))
    app.include_router(_monitoring_routes(server), dependencies=admin)
    app.include_router(_training_routes(server), dependencies=admin)
    app.include_router(_data_plane_routes(server.chat))
    return app


# --- routes --------------------------------------------------------------------------------------------------------


def _open_routes(server: SwarmServer) -> APIRouter:
    router = APIRouter()

    @router.get(p.ROUTE_HEALTH)
    async def health() -> dict:
        return {"ok": True, "state": server.state.value}

    @router.get(p.ROUTE_METRICS)
    async def metrics() -> Response:
        return Response(await server.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return router


def _monitoring_routes(server: SwarmServer) -> APIRouter:
    router = APIRouter()

    @router.get(p.ROUTE_STATUS)
    async def status() -> p.ServerStatus:
        return await server.status()

    @router.get(p.ROUTE_MONITOR)
    async def monitor() -> p.MonitorSnapshot:
        return await server.monitor()

    return router


def _training_routes(server: TrainableServer | StaticServer) -> APIRouter:
    """The control plane and the episode API; a static server refuses them (409 STATIC_SERVER)."""

    def trainable_or_refuse() -> TrainableServer:
        if isinstance(server, StaticServer):
            server.refuse_training()
        return server

    router = APIRouter()
    trainable = Depends(trainable_or_refuse)

    @router.post(p.ROUTE_CONFIG)
    async def sync_config(config: p.TrainConfig, srv: TrainableServer = trainable) -> p.ConfigResponse:
        return await srv.lifecycle.sync_config(config)

    @router.post(p.ROUTE_START)
    async def start_engine(srv: TrainableServer = trainable) -> p.ServerStatus:
        return await srv.start_engine()

    @router.post(p.ROUTE_STOP)
    async def stop_engine(srv: TrainableServer = trainable) -> p.ServerStatus:
        return await srv.stop_engine()

    @router.get(p.ROUTE_POOL)
    async def pool(srv: TrainableServer = trainable) -> p.PoolInfo:
        return await srv.pool.info(detailed=True)

    @router.post(p.ROUTE_BEGIN)
    async def begin(body: p.BeginEpisodeRequest, request: Request,
                    srv: TrainableServer = trainable) -> p.EpisodeLease:
        return srv.pool.begin(body.client_id, request_url=str(request.base_url))

    @router.post(p.ROUTE_END)
    async def end(episode_id: str, body: p.EndEpisodeRequest,
                  srv: TrainableServer = trainable) -> p.EndEpisodeResponse:
        return await srv.pool.end(episode_id, body)

    @router.post(p.ROUTE_ABORT)
    async def abort(episode_id: str, body: p.ClientRequest,
                    srv: TrainableServer = trainable) -> p.AbortEpisodeResponse:
        return srv.pool.abort(episode_id, body.client_id)

    @router.post(p.ROUTE_RENEW)
    async def renew(episode_id: str, body: p.ClientRequest, srv: TrainableServer = trainable) -> p.EpisodeState:
        return srv.pool.renew(episode_id, body.client_id)

    @router.get(p.ROUTE_EPISODE)
    async def episode(episode_id: str, srv: TrainableServer = trainable) -> p.EpisodeState:
        return srv.pool.episode_state(episode_id)

    return router


def _data_plane_routes(chat: ChatService) -> APIRouter:
    router = APIRouter()

    @router.get(p.ROUTE_MODELS)
    async def models() -> p.ModelList:
        return chat.models()

    @router.post(p.ROUTE_CHAT)
    async def chat_completions(body: p.ChatCompletionRequest, authorization: str | None = Header(None),
                               agent: str | None = Header(None, alias=p.AGENT_HEADER)):
        reply = await chat.create(body, _bearer(authorization), agent)
        return reply if isinstance(reply, p.ChatCompletionResponse) else StreamingResponse(
            reply, media_type="text/event-stream")

    return router


# --- authentication ------------------------------------------------------------------------------------------------


def _bearer(authorization: str | None) -> str | None:
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return None


def _admin_auth(admin_token: str) -> Callable[..., None]:
    def admin(authorization: str | None = Header(None)) -> None:
        token = _bearer(authorization)
        if token is not None and secrets.compare_digest(token.encode(), admin_token.encode()):
            return
        if token is not None and token.startswith(EPISODE_KEY_PREFIX):
            message = "an episode key cannot reach the control plane: these routes need the server's admin token"
        elif token is None:
            message = "missing 'Authorization: Bearer <admin token>' (marl serve --admin-token / MARL_ADMIN_TOKEN)"
        else:
            message = "wrong admin token for this server"
        raise Refusal(401, ErrorCode.UNAUTHORIZED, message)

    return admin


# --- errors --------------------------------------------------------------------------------------------------------


def _error_response(status: int, refusal: Refusal, headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if refusal.retry_after_s:
        headers["Retry-After"] = f"{refusal.retry_after_s:g}"
    return JSONResponse(p.ErrorResponse(error=refusal.info()).model_dump(mode="json"), status_code=status,
                        headers=headers or None)


async def _refused(_: Request, exc: Refusal) -> JSONResponse:
    return _error_response(exc.status, exc)


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    problems = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        if err.get("type") == "json_invalid":
            problems.append(f"the request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})")
        else:
            problems.append(f"{where}: {err.get('msg')}")
    first_param = ".".join(str(x) for x in exc.errors()[0].get("loc", ())[1:]) if exc.errors() else None
    return _error_response(400, Refusal(400, ErrorCode.INVALID_REQUEST, "invalid request: " + "; ".join(problems),
                                        param=first_param or None))


_HTTP_ERROR_CODES = {404: ErrorCode.ROUTE_NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = _HTTP_ERROR_CODES.get(exc.status_code, ErrorCode.HTTP_ERROR)
    message = f"{exc.detail}: {request.method} {request.url.path}"
    return _error_response(exc.status_code, Refusal(exc.status_code, code, message), exc.headers)


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    log.error("unexpected error: %r", exc)  # Starlette logs the traceback after this answer is sent
    return _error_response(500, Refusal(500, ErrorCode.INTERNAL_ERROR, f"internal server error: {exc}"))


_ERROR_HANDLERS = {Refusal: _refused, RequestValidationError: _invalid, StarletteHTTPException: _http_error,
                   Exception: _internal_error}
