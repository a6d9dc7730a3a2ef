"""HTTP for one swarm server: the control plane, the episode (lease) API and the OpenAI-compatible data plane.

Authentication: control and episode routes need `Authorization: Bearer <admin token>`; the data plane needs the
api_key of a live lease (a static server needs none); `/health` and the Prometheus `/metrics` are open. Every error is an OpenAI-shaped `ErrorResponse`.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from marl import protocol as p
from servers.chat import PromptError, StreamDecoder, parse_tool_calls
from servers.interfaces import SamplingParams
from servers.leases import Lease
from servers.metrics import ServerMetrics
from servers.samples import CallRecord
from servers.swarm import Refusal, SwarmServer


def _error(status: int, info: p.ErrorInfo) -> JSONResponse:
    headers = {"Retry-After": f"{info.retry_after_s:g}"} if info.retry_after_s else None
    return JSONResponse(p.ErrorResponse(error=info).model_dump(mode="json"), status_code=status, headers=headers)


def _bearer(authorization: str | None) -> str | None:
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return None


def create_app(server: SwarmServer, admin_token: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await server.startup()
        yield
        await server.shutdown()

    app = FastAPI(title="marl swarm server", lifespan=lifespan)

    # --- errors --------------------------------------------------------------------------------------------------

    @app.exception_handler(Refusal)
    async def refused(_: Request, exc: Refusal) -> JSONResponse:
        return _error(
            exc.status,
            p.ErrorInfo(
                message=exc.message,
                type=exc.type,
                code=exc.code,
                param=exc.param,
                state=exc.state,
                retry_after_s=exc.retry_after_s,
            ),
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
            if err.get("type") == "json_invalid":
                problems.append(f"the request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})")
            else:
                problems.append(f"{where}: {err.get('msg')}")
        first_param = ".".join(str(x) for x in exc.errors()[0].get("loc", ())[1:]) if exc.errors() else None
        return _error(400, p.ErrorInfo(message="invalid request: " + "; ".join(problems), code="invalid_request",
                                       param=first_param or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, p.ErrorInfo(message=str(exc.detail), code=f"http_{exc.status_code}"))

    # --- authentication ------------------------------------------------------------------------------------------

    def admin(authorization: str | None = Header(None)) -> None:
        token = _bearer(authorization)
        if token is not None and secrets.compare_digest(token.encode(), admin_token.encode()):
            return
        if token is not None and token.startswith("marl-ep-"):
            message = "an episode key cannot reach the control plane: these routes need the server's admin token"
        elif token is None:
            message = "missing 'Authorization: Bearer <admin token>' (marl serve --admin-token / MARL_ADMIN_TOKEN)"
        else:
            message = "wrong admin token for this server"
        raise Refusal(401, message, "unauthorized", type="authentication_error")

    guarded = [Depends(admin)]

    # --- control plane -------------------------------------------------------------------------------------------

    @app.get(p.ROUTE_HEALTH)
    async def health() -> dict:
        return {"ok": True, "state": server.state.value}

    @app.post(p.ROUTE_CONFIG, dependencies=guarded)
    async def sync_config(config: p.TrainConfig) -> p.ConfigResponse:
        return await server.sync_config(config)

    @app.post(p.ROUTE_START, dependencies=guarded)
    async def start_engine() -> p.ServerStatus:
        return await server.start_engine()

    @app.post(p.ROUTE_STOP, dependencies=guarded)
    async def stop_engine() -> p.ServerStatus:
        return await server.stop_engine()

    @app.get(p.ROUTE_STATUS, dependencies=guarded)
    async def status() -> p.ServerStatus:
        return await server.status()

    @app.get(p.ROUTE_MONITOR, dependencies=guarded)
    async def monitor() -> p.MonitorSnapshot:
        return await server.monitor()

    metrics_page = ServerMetrics(server)

    @app.get(p.ROUTE_METRICS)
    async def metrics() -> Response:
        return Response(await metrics_page.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get(p.ROUTE_POOL, dependencies=guarded)
    async def pool() -> p.PoolInfo:
        server.refuse_if_static()
        return await server.pool_info(detailed=True)

    # --- episodes ------------------------------------------------------------------------------------------------

    @app.post(p.ROUTE_BEGIN, dependencies=guarded)
    async def begin(body: p.BeginEpisodeRequest, request: Request) -> p.EpisodeLease:
        return server.begin(body.client_id, server.public_url or str(request.base_url))

    @app.post(p.ROUTE_END, dependencies=guarded)
    async def end(episode_id: str, body: p.EndEpisodeRequest) -> p.EndEpisodeResponse:
        return await server.end(episode_id, body)

    @app.post(p.ROUTE_ABORT, dependencies=guarded)
    async def abort(episode_id: str, body: p.ClientRequest) -> p.AbortEpisodeResponse:
        return p.AbortEpisodeResponse(episode_id=episode_id, disposition=server.abort(episode_id, body.client_id))

    @app.post(p.ROUTE_RENEW, dependencies=guarded)
    async def renew(episode_id: str, body: p.ClientRequest) -> p.EpisodeState:
        return server.renew(episode_id, body.client_id)

    @app.get(p.ROUTE_EPISODE, dependencies=guarded)
    async def episode(episode_id: str) -> p.EpisodeState:
        return server.episode_state(episode_id)

    # --- OpenAI-compatible data plane ----------------------------------------------------------------------------

    @app.get(p.ROUTE_MODELS)
    async def models() -> p.ModelList:
        length = server.engine.context_length if server.engine else None
        return p.ModelList(data=[p.ModelCard(id=server.served_name, max_model_len=length)])

    @app.post(p.ROUTE_CHAT)
    async def chat(
        body: p.ChatCompletionRequest,
        authorization: str | None = Header(None),
        x_marl_agent: str | None = Header(None),
    ):
        lease = server.lease_for_key(_bearer(authorization))
        if body.model != server.served_name:
            raise Refusal(404, f"model '{body.model}' is not served here; this server serves '{server.served_name}'"
                          " (see GET /v1/models)", "model_not_found", param="model")
        engine, formatter = server.engine, server.formatter
        if engine is None:
            raise Refusal(503, f"the engine is {server.state.value}; retry shortly", "engine_unavailable", 1.0,
                          server.state)
        try:
            prompt_ids = formatter.prompt_ids(body, lease.calls if lease else [])
        except PromptError as exc:
            raise Refusal(400, str(exc), "invalid_messages", param="messages") from exc
        room = engine.context_length - len(prompt_ids)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            raise Refusal(
                400,
                f"the prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens}; this model's context"
                f" limit is {engine.context_length} tokens: shorten the conversation or lower max_tokens",
                "context_length_exceeded",
                param="messages",
            )
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        params = SamplingParams(
            max_tokens=max_tokens or room, temperature=body.temperature, top_p=body.top_p, stop=stop, seed=body.seed
        )
        call = _Call(server, lease, body, prompt_ids, params, x_marl_agent or body.user or p.DEFAULT_AGENT)
        if body.stream:
            return StreamingResponse(call.stream(), media_type="text/event-stream")
        return await call.complete()

    return app


class _Call:
    """One chat completion: runs the engine, records exactly what it produced, shapes the OpenAI reply."""

    def __init__(self, server: SwarmServer, lease: Lease | None, body: p.ChatCompletionRequest,
                 prompt_ids: list[int], params: SamplingParams, agent: str):
        self.server, self.lease, self.body, self.prompt_ids, self.params, self.agent = (
            server, lease, body, prompt_ids, params, agent)
        self.engine, self.formatter = server.engine, server.formatter
        self.version = server.step
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish = "length"

    async def _chunks(self) -> AsyncIterator[list[int]]:
        """Run the engine; the lease counts as busy (never idle) meanwhile. Records the call once it finishes."""
        if self.lease:
            self.lease.inflight += 1
        try:
            async for chunk in self.engine.generate(self.prompt_ids, self.params):
                self.ids += chunk.token_ids
                self.logprobs += chunk.logprobs
                if chunk.finish_reason:
                    self.finish = chunk.finish_reason
                yield chunk.token_ids
        finally:
            if self.lease:
                self.lease.inflight -= 1
                self.lease.touch()
        self.server.record_call(
            self.lease,
            CallRecord(agent=self.agent, prompt_ids=self.prompt_ids, completion_ids=self.ids,
                       logprobs=self.logprobs, finish_reason=self.finish, policy_version=self.version),
        )

    def _usage(self) -> p.Usage:
        return p.Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.ids),
                       total_tokens=len(self.prompt_ids) + len(self.ids))

    def _logprobs(self) -> p.ChoiceLogprobs | None:
        if not self.body.logprobs:
            return None
        return p.ChoiceLogprobs(content=[
            p.TokenLogprob(token=self.formatter.decode([t]), logprob=lp) for t, lp in zip(self.ids, self.logprobs)
        ])

    def _message(self) -> tuple[p.AssistantMessage, str]:
        text = self.formatter.reply_text(self.ids, self.params.stop)
        content, tool_calls = parse_tool_calls(text) if self.body.tools else (text, [])
        finish = "tool_calls" if tool_calls else self.finish
        return p.AssistantMessage(content=content, tool_calls=tool_calls or None), finish

    async def complete(self) -> p.ChatCompletionResponse:
        try:
            async for _ in self._chunks():
                pass
        except Exception as exc:
            raise Refusal(500, f"generation failed: {exc}", "engine_error", type="server_error") from exc
        message, finish = self._message()
        return p.ChatCompletionResponse(
            id=self.id, created=self.created, model=self.server.served_name,
            choices=[p.Choice(message=message, finish_reason=finish, logprobs=self._logprobs(),
                              token_ids=self.ids if self.body.return_token_ids else None)],
            usage=self._usage(),
            prompt_token_ids=self.prompt_ids if self.body.return_token_ids else None,
        )

    def _sse(self, delta: p.DeltaMessage, finish: str | None = None, **extra) -> str:
        chunk = p.ChatCompletionChunk(id=self.id, created=self.created, model=self.server.served_name,
                                      choices=[p.ChunkChoice(delta=delta, finish_reason=finish, **extra)])
        return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

    async def stream(self) -> AsyncIterator[str]:
        yield self._sse(p.DeltaMessage(role="assistant", content=""))
        decoder = StreamDecoder(self.formatter, self.params.stop)
        try:
            async for ids in self._chunks():
                text = "" if self.body.tools else decoder.push(ids)  # tool calls are parsed from the whole reply
                if text:
                    yield self._sse(p.DeltaMessage(content=text))
        except Exception as exc:  # the status line is sent already: report in-band, as OpenAI does
            info = p.ErrorInfo(message=f"generation failed: {exc}", type="server_error", code="engine_error")
            yield f"data: {json.dumps({'error': info.model_dump(mode='json')})}\n\n"
            return
        if self.body.tools:
            message, finish = self._message()
            calls = [dict(index=i, **c.model_dump()) for i, c in enumerate(message.tool_calls or [])]
            yield self._sse(p.DeltaMessage(content=message.content, tool_calls=calls or None))
        else:
            finish = self.finish
            if rest := decoder.finish():
                yield self._sse(p.DeltaMessage(content=rest))
        yield self._sse(p.DeltaMessage(), finish, token_ids=self.ids if self.body.return_token_ids else None)
        if self.body.stream_options and self.body.stream_options.include_usage:
            usage = p.ChatCompletionChunk(id=self.id, created=self.created, model=self.server.served_name,
                                          choices=[], usage=self._usage())
            yield f"data: {usage.model_dump_json(exclude_none=True)}\n\n"
        yield "data: [DONE]\n\n"
