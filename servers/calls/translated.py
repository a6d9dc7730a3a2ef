"""The Responses and Messages APIs on a swarm server: translated to chat completions and run as one.

The translations are `marl.apis.responses` and `marl.apis.messages` (shared with `marl proxy`); here each request
becomes a `ChatCall` (`ChatService.start`: the same prompt splicing, tool choice, engine path and exact recording as
a chat completion) and its reply, whole or streamed, goes back in the API's own shape. `servers.http.routes` routes
to these.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from marl import protocol as p
from marl.apis import messages, responses
from marl.protocol import ErrorCode
from servers.calls.chat import CallSession, ChatCall, ChatService
from servers.errors import Refusal


async def create_response(chat: ChatService, body: responses.ResponsesRequest, session: CallSession,
                          agent: str | None) -> Any:
    call = await chat.start(_translated(body), session, agent)
    if not body.stream:
        return JSONResponse(responses.reply(body, await call.complete()))
    return _sse(responses.stream(body, call.model_name, _events(call)))


async def create_message(chat: ChatService, body: messages.MessagesRequest, session: CallSession,
                         agent: str | None) -> Any:
    call = await chat.start(_translated(body), session, agent)
    if not body.stream:
        return JSONResponse(messages.reply(await call.complete()))
    return _sse(messages.stream(call.model_name, len(call.prompt_ids), _events(call)))


def _translated(body: responses.ResponsesRequest | messages.MessagesRequest) -> p.ChatCompletionRequest:
    try:
        return body.to_chat()
    except ValueError as exc:  # what the API allows but this server does not do, or what chat cannot carry
        raise Refusal(400, ErrorCode.INVALID_REQUEST, str(exc)) from exc


async def _events(call: ChatCall) -> AsyncIterator[str | p.ChatCompletionResponse | p.ErrorInfo]:
    """The call's stream events; a failure once the status line is sent is the last event (reported in-band)."""
    try:
        async for event in call.events():
            yield event
    except Exception as exc:
        yield call.failed(exc).info()


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")
