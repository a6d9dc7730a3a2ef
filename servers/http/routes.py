"""HTTP for one swarm server: routes, authentication and error bodies; every route is one call into the server.

Control and episode routes need `Authorization: Bearer <admin token>`; a trainable server's model calls (chat
completions, Responses, Anthropic Messages, completions: `DATA_PLANE_CALL_ROUTES`) need the api_key of a live lease,
as a bearer token or Anthropic's `x-api-key` (a static server takes any); `/health`, `/metrics` and `/v1/models` are
open. Both are checked from the headers alone, before the body is read, and a body over the limit is refused with 413
before it is parsed (`servers.http.guards`). Every error is an OpenAI-shaped `ErrorResponse` whose `code` is an
`ErrorCode` (Anthropic's shape on `/v1/messages`, `marl.apis.messages.AnthropicErrors`), FastAPI's own refusals
(unknown route, bad body) and unexpected exceptions included; the OpenAPI document lists the
errors each route really sends (`servers.http.openapi`). `app.state.server` is the server object (tests look inside it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import Any, Protocol

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from marl import protocol as p
from marl.apis.messages import AnthropicErrors, MessagesRequest
from marl.apis.responses import ResponsesRequest
from marl.protocol import EPISODE_KEY_PREFIX, EngineState, ErrorCode
from servers.calls import translated
from servers.calls.chat import ChatService
from servers.calls.completions import CompletionRequest, create_completion
from servers.errors import Refusal, refusal_response
from servers.http import openapi
from servers.http.guards import PARSED_JSON, RECEIVED_AT, Authorize, CatchUnexpected, RequestGate, Scope
from servers.http.openapi import BEARER, errors
from servers.policies.frozen import FrozenPolicies
from servers.policies.server import PolicyServer
from servers.static_server import StaticServer
from servers.trainable_server import TrainableServer

log = logging.getLogger("marl.server")


#: What the training routes see: a server's learners (one; or one per policy), each a `TrainableServer`.
Learners = TrainableServer | PolicyServer
#: The control routes' `?policy=`: one policy of a server of several (left out: the whole server, or its only one).
_POLICY = Query(None, alias=p.POLICY_PARAM, description="One policy of a server of several.")


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


def create_app(server: Learners | StaticServer, admin_token: str, *,
               max_body_mb: float = p.DEFAULT_MAX_BODY_MB) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await server.startup()
        yield
        await server.shutdown()

    app = FastAPI(title="marl swarm server", lifespan=lifespan)
    app.state.server = server
    for error, handler in _ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
    # Routes are matched in this order, one after the other: the busiest first (a chat call, a begin, an end).
    data_plane, episodes = _data_plane_routes(server.chat), _episode_routes(server)
    app.include_router(data_plane)
    app.include_router(episodes, dependencies=[BEARER])
    app.include_router(_control_routes(server), dependencies=[BEARER])
    app.include_router(_monitoring_routes(server), dependencies=[BEARER])
    app.include_router(_open_routes(server))
    fixed = _fixed_paths(data_plane.routes + episodes.routes)
    # The last added runs first: unexpected errors are caught around the gate too.
    app.add_middleware(RequestGate, authorize=_authorizer(server, admin_token, app.router.routes, fixed),
                       max_body_bytes=int(max_body_mb * 2**20))
    app.add_middleware(CatchUnexpected)
    app.add_middleware(AnthropicErrors)  # outermost: every error on /v1/messages in Anthropic's shape
    openapi.install(app)
    return app


# --- routes --------------------------------------------------------------------------------------------------------


class _PreParsedRequest(Request):
    async def json(self) -> Any:
        return self.scope[PARSED_JSON] if PARSED_JSON in self.scope else await super().json()


class _PreParsedRoute(APIRoute):
    """A route that takes a large body as the gate parsed it in a worker thread (`RequestGate`) and validates it in
    one too (8,192 messages take ~0.1 s), so FastAPI neither parses nor validates it on the event loop: it is
    handed the validated model, which pydantic takes as it is."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            scope = request.scope
            if PARSED_JSON in scope and self.body_field is not None and not self._embed_body_fields:
                value, problems = await asyncio.to_thread(_validated, self.body_field, scope[PARSED_JSON])
                if problems:
                    raise RequestValidationError(problems)
                scope[PARSED_JSON] = value
            return await handler(_PreParsedRequest(scope, request.receive))

        return handle


#: A body that fails validation in more places than this is refused without listing them: turning 262,144 pydantic
#: errors into Python took 3 s (one call, the GIL held).
MAX_LISTED_PROBLEMS = 64


def _validated(field: Any, value: Any) -> tuple[Any, list[dict[str, Any]]]:
    """FastAPI's `ModelField.validate` (the validated body, or its problems), which lists the problems only when they
    are few (MAX_LISTED_PROBLEMS)."""
    adapter = getattr(field, "_type_adapter", None)
    if adapter is None:  # another FastAPI: its own way
        return field.validate(value, loc=("body",))
    try:
        return adapter.validate_python(value, from_attributes=True), []
    except ValidationError as exc:
        count = exc.error_count()
        if count > MAX_LISTED_PROBLEMS:
            return None, [{"type": "too_many_errors", "loc": ("body",), "msg": f"{count} values fail validation"
                           f" (more than {MAX_LISTED_PROBLEMS}: not listed)"}]
        return None, [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]


def _open_routes(server: SwarmServer) -> APIRouter:
    router = APIRouter(route_class=_PreParsedRoute)

    @router.get(p.ROUTE_HEALTH)
    async def health() -> dict:
        return {"ok": True, "state": server.state.value}

    @router.get(p.ROUTE_METRICS, response_class=PlainTextResponse, responses={200: {
        "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(await server.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return router


def _monitoring_routes(server: SwarmServer) -> APIRouter:
    router = APIRouter(route_class=_PreParsedRoute, responses=errors(401))

    @router.get(p.ROUTE_STATUS, responses=errors(400, 404))
    async def status(policy: str | None = _POLICY) -> p.ServerStatus:
        return await (_learner(server, policy).status() if policy else server.status())

    @router.get(p.ROUTE_MONITOR)
    async def monitor(policy: str | None = _POLICY) -> p.MonitorSnapshot:
        return await (_learner(server, policy).monitor() if policy else server.monitor())

    return router


def _learner(server: Learners | StaticServer, policy: str | None) -> TrainableServer:
    if isinstance(server, StaticServer):
        server.refuse_training()
    return server.for_policy(policy)


def _trainable_or_refuse(server: Learners | StaticServer):
    """A dependency: the trainable server, or a 409 STATIC_SERVER refusal on a static one."""

    async def trainable() -> Learners:  # async: FastAPI would run a plain def in a worker thread per request
        if isinstance(server, StaticServer):
            server.refuse_training()
        return server

    return Depends(trainable)


def _control_routes(server: Learners | StaticServer) -> APIRouter:
    router = APIRouter(route_class=_PreParsedRoute, responses=errors(401, 409, 413))
    trainable = _trainable_or_refuse(server)

    @router.post(p.ROUTE_CONFIG, responses=errors(400))
    async def sync_config(config: p.TrainConfig, policy: str | None = _POLICY,
                          srv: Learners = trainable) -> p.ConfigResponse:
        return await srv.for_policy(policy).lifecycle.sync_config(config)

    @router.post(p.ROUTE_START)
    async def start_engine(policy: str | None = _POLICY, srv: Learners = trainable) -> p.ServerStatus:
        return await (srv.for_policy(policy) if policy else srv).start_engine()

    @router.post(p.ROUTE_STOP)
    async def stop_engine(policy: str | None = _POLICY, srv: Learners = trainable) -> p.ServerStatus:
        return await (srv.for_policy(policy) if policy else srv).stop_engine()

    @router.get(p.ROUTE_POOL)
    async def pool(policy: str | None = _POLICY, srv: Learners = trainable) -> p.PoolInfo:
        return await srv.for_policy(policy).pool.info(detailed=True)

    @router.post(p.ROUTE_FROZEN, responses=errors(400, 503))
    async def load_frozen(body: p.LoadFrozenPolicyRequest, srv: Learners = trainable) -> p.FrozenPolicy:
        return await _frozen(srv).load(body)

    @router.get(p.ROUTE_FROZEN)
    async def frozen(srv: Learners = trainable) -> p.FrozenPolicyList:
        return _frozen(srv).listed()

    @router.delete(p.ROUTE_FROZEN_ONE, responses=errors(404))
    async def unload_frozen(name: str, srv: Learners = trainable) -> p.FrozenPolicyList:
        return await _frozen(srv).unload(name)

    return router


def _frozen(server: Learners) -> FrozenPolicies:
    """A server of policies' frozen policies; 409 on a server without LoRA policies (its weights are no adapter)."""
    if isinstance(server, TrainableServer):
        raise Refusal(409, ErrorCode.NO_POLICIES, "this server trains one full-weight model, no LoRA policies:"
                      " frozen policies are past adapters of a server of policies (marl serve --policy)")
    return server.frozen


#: End's and commit's opt-in to the pool's progress in their reply (it costs three ledger reads).
_INCLUDE_POOL = Query(False, alias=p.INCLUDE_POOL_PARAM, description="Include the pool's progress in the reply.")


def _episode_routes(server: Learners | StaticServer) -> APIRouter:
    """The episode API; a static server refuses it (409 STATIC_SERVER)."""
    router = APIRouter(route_class=_PreParsedRoute, responses=errors(400, 401, 403, 404, 409, 413))
    trainable = _trainable_or_refuse(server)

    @router.post(p.ROUTE_BEGIN, responses=errors(503))
    async def begin(body: p.BeginEpisodeRequest, request: Request,
                    srv: Learners = trainable) -> p.EpisodeLease:
        return srv.for_policy(body.policy).pool.begin(body.client_id, request_url=str(request.base_url))

    @router.post(p.ROUTE_END, responses=errors(503))
    async def end(episode_id: str, body: p.EndEpisodeRequest, include_pool: bool = _INCLUDE_POOL,
                  srv: Learners = trainable) -> p.EndEpisodeResponse:
        return await srv.for_episode(episode_id).recorder.end(episode_id, body, include_pool=include_pool)

    @router.post(p.ROUTE_PREPARE, responses=errors(503))
    async def prepare(episode_id: str, body: p.PrepareEpisodeRequest,
                      srv: Learners = trainable) -> p.PrepareEpisodeResponse:
        return await srv.for_episode(episode_id).recorder.prepare(episode_id, body)

    @router.post(p.ROUTE_COMMIT)
    async def commit(episode_id: str, body: p.ClientRequest, include_pool: bool = _INCLUDE_POOL,
                     srv: Learners = trainable) -> p.EndEpisodeResponse:
        return await srv.for_episode(episode_id).recorder.commit(episode_id, body.client_id,
                                                                 include_pool=include_pool)

    @router.post(p.ROUTE_ABORT)
    async def abort(episode_id: str, body: p.ClientRequest,
                    srv: Learners = trainable) -> p.AbortEpisodeResponse:
        return await srv.for_episode(episode_id).recorder.abort(episode_id, body.client_id)

    @router.post(p.ROUTE_RENEW)
    async def renew(episode_id: str, body: p.ClientRequest, srv: Learners = trainable) -> p.EpisodeState:
        return srv.for_episode(episode_id).pool.renew(episode_id, body.client_id)

    @router.get(p.ROUTE_EPISODE)
    async def episode(episode_id: str, srv: Learners = trainable) -> p.EpisodeState:
        return await srv.for_episode(episode_id).recorder.episode_state(episode_id)

    return router


def _data_plane_routes(chat: ChatService) -> APIRouter:
    router = APIRouter(route_class=_PreParsedRoute)

    @router.get(p.ROUTE_MODELS)
    async def models() -> p.ModelList:
        return chat.models()

    @router.post(p.ROUTE_CHAT, dependencies=[BEARER], responses={
        200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
              "description": "The completion (JSON), or its server-sent events with `stream: true`.",
              "headers": {p.SERVER_TIMING_HEADER: {
                  "description": "Without `stream`: `engine;dur=<ms>, marl;dur=<ms>`, the engine's wall time for the"
                                 " call and the server's own (the rest of its latency is the network's).",
                  "schema": {"type": "string"}}}},
        **errors(400, 401, 404, 413, 500, 503)})
    async def chat_completions(body: p.ChatCompletionRequest, request: Request, response: Response,
                               agent: str | None = Header(None, alias=p.AGENT_HEADER)):
        service, session = chat.route(request.scope[_CHAT_SESSION], body.model)
        call = await service.start(body, session, agent)
        if body.stream:
            return StreamingResponse(call.stream(), media_type="text/event-stream")
        reply = await call.complete()
        response.headers[p.SERVER_TIMING_HEADER] = call.server_timing(request.scope[RECEIVED_AT])  # whose time
        return reply

    @router.post(p.ROUTE_RESPONSES, dependencies=[BEARER], responses=_CALL_RESPONSES)
    async def responses(body: ResponsesRequest, request: Request,
                        agent: str | None = Header(None, alias=p.AGENT_HEADER)):
        service, session = chat.route(request.scope[_CHAT_SESSION], body.model)
        return await translated.create_response(service, body, session, agent)

    @router.post(p.ROUTE_MESSAGES, dependencies=[BEARER], responses=_CALL_RESPONSES)
    async def messages(body: MessagesRequest, request: Request,
                       agent: str | None = Header(None, alias=p.AGENT_HEADER)):
        service, session = chat.route(request.scope[_CHAT_SESSION], body.model)
        return await translated.create_message(service, body, session, agent)

    @router.post(p.ROUTE_COMPLETIONS, dependencies=[BEARER], responses=_CALL_RESPONSES)
    async def completions(body: CompletionRequest, request: Request,
                          agent: str | None = Header(None, alias=p.AGENT_HEADER)):
        service, session = chat.route(request.scope[_CHAT_SESSION], body.model)
        reply = await create_completion(service, body, session, agent)
        return reply if isinstance(reply, dict) else StreamingResponse(reply, media_type="text/event-stream")

    return router


_CALL_RESPONSES = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                         "description": "The reply (JSON), or its server-sent events with `stream: true`."},
                   **errors(400, 401, 404, 413, 500, 503)}


# --- authentication ------------------------------------------------------------------------------------------------


def _fixed_paths(routes: list[BaseRoute]) -> frozenset[tuple[str, str]]:
    """(method, path) of every route in `routes` without path parameters: taken without matching every route."""
    return frozenset((method, route.path) for route in routes if isinstance(route, APIRoute)
                     and not route.param_convertors for method in route.methods)  # fmt: skip


def _authorizer(server: SwarmServer, admin_token: str, routes: list[BaseRoute],
                fixed: frozenset[tuple[str, str]]) -> Authorize:  # fmt: skip
    """Who may go on, from the request line and the bearer token alone (`RequestGate` asks before reading the body).
    A request no route takes goes on unasked: the router answers it 404 or 405 without reading its body. `fixed`:
    (method, path) pairs known to be taken (`_fixed_paths`), which skip the walk over every route."""

    def authorize(scope: Scope, token: str | None) -> Refusal | None:
        if (scope["method"], scope["path"]) not in fixed and not any(
                route.matches(scope)[0] is Match.FULL for route in routes):
            return None
        path = scope["path"]
        if path.startswith(p.ADMIN_ROUTE_PREFIXES):
            return _admin_refusal(token, admin_token)
        if path in p.DATA_PLANE_CALL_ROUTES:
            token = token if token is not None else _anthropic_key(scope)
            try:
                scope[_CHAT_SESSION] = server.chat.admit(token)  # the key's one check: the route runs under this
            except Refusal as refusal:
                return refusal
        return None

    return authorize


def _anthropic_key(scope: Scope) -> str | None:
    """The key the anthropic SDK sends (`x-api-key`) where no bearer token came."""
    return Headers(scope=scope).get("x-api-key")


#: Where the gate leaves the session a chat call was admitted under (its lease), for the route: the key is looked up
#: once, from the headers, before the body is read.
_CHAT_SESSION = "marl.chat_session"


def _admin_refusal(token: str | None, admin_token: str) -> Refusal | None:
    if token is not None and secrets.compare_digest(token.encode(), admin_token.encode()):
        return None
    if token is not None and token.startswith(EPISODE_KEY_PREFIX):
        message = "an episode key cannot reach the control plane: these routes need the server's admin token"
    elif token is None:
        message = "missing 'Authorization: Bearer <admin token>' (marl serve --admin-token / MARL_ADMIN_TOKEN)"
    else:
        message = "wrong admin token for this server"
    return Refusal(401, ErrorCode.UNAUTHORIZED, message)


# --- errors --------------------------------------------------------------------------------------------------------


async def _refused(_: Request, exc: Refusal) -> JSONResponse:
    return refusal_response(exc)


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    problems = []
    for err in exc.errors()[:_SHOWN_PROBLEMS]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        if err.get("type") == "json_invalid":
            problems.append(f"the request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})")
        else:
            problems.append(f"{where}: {err.get('msg')}")
    if len(exc.errors()) > _SHOWN_PROBLEMS:
        problems.append(f"and {len(exc.errors()) - _SHOWN_PROBLEMS} more")
    first_param = ".".join(str(x) for x in exc.errors()[0].get("loc", ())[1:]) if exc.errors() else None
    message = "invalid request: " + "; ".join(problems)
    message = message if len(message) <= 1000 else message[:997] + "..."  # a message may quote what was sent
    return refusal_response(Refusal(400, ErrorCode.INVALID_REQUEST, message, param=(first_param or None) and
                                    first_param[:200]))


#: Problems of an invalid body named in the error message (the rest are counted).
_SHOWN_PROBLEMS = 5


_HTTP_ERROR_CODES = {404: ErrorCode.ROUTE_NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = _HTTP_ERROR_CODES.get(exc.status_code, ErrorCode.HTTP_ERROR)
    message = f"{exc.detail}: {request.method} {request.url.path}"
    return refusal_response(Refusal(exc.status_code, code, message), exc.headers)  # 405 keeps its Allow header


_ERROR_HANDLERS = {Refusal: _refused, RequestValidationError: _invalid, StarletteHTTPException: _http_error}
