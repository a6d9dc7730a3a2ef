"""Anthropic's Messages API (`POST /v1/messages`) as chat completions: request, reply, stream events, errors.

What the `anthropic` SDK (and Claude-Code-style harnesses) send: `system`, messages whose content is a string or
blocks (`text`, `tool_use`, `tool_result`), `tools` with an `input_schema`, `tool_choice` (`auto`, `any`, `tool`,
`none`), `stop_sequences`, `max_tokens`. A request becomes a chat request (tool results become tool messages, tool
uses the assistant's tool calls, their `input` its JSON arguments as `json.dumps` writes them, which is how the
server parsed them: the history sent back renders to the same text, so its calls merge into one sample). Errors are
Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, plus marl's `code` (an `ErrorCode`).
The SDK appends `/v1/messages` to its base URL: give it a lease's `base_url` without the trailing `/v1`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from marl import protocol as p
from marl.apis.shapes import text_or

Event = str | p.ChatCompletionResponse | p.ErrorInfo  # a text delta, the whole reply, or a failure mid-stream


class Block(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: text_or(list[Block], "blocks") | None = None
    is_error: p.Bool | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: text_or(list[Block], "blocks")


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class MessagesRequest(p._Request):
    # Other fields (metadata, thinking, service_tier, ...) are accepted and ignored, as for chat completions.
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: p.Int = Field(ge=1)
    messages: list[Message] = Field(min_length=1, fail_fast=True)
    system: text_or(list[Block], "blocks") | None = None
    tools: Annotated[list[Tool], Field(fail_fast=True)] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: p.Real = Field(1.0, ge=0, le=2)
    top_p: p.Real = Field(1.0, gt=0, le=1)
    top_k: p.Int | None = Field(None, description="Not supported: refused unless absent.")
    stream: p.Bool = False
    metadata: dict[str, Any] | None = None

    def to_chat(self) -> p.ChatCompletionRequest:
        """The same request as chat completions (token ids asked back: the reply's usage counts them)."""
        if self.top_k is not None:
            raise ValueError("top_k is not supported by this server (it samples with temperature and top_p only);"
                             " omit it")
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": _text(self.system)})
        for message in self.messages:
            messages += _chat_messages(message)
        user = (self.metadata or {}).get("user_id")
        return p.ChatCompletionRequest(
            model=self.model, messages=messages, max_tokens=self.max_tokens, temperature=self.temperature,
            top_p=self.top_p, stop=self.stop_sequences, tools=_chat_tools(self.tools),
            tool_choice=_chat_tool_choice(self.tool_choice), user=user if isinstance(user, str) else None)


def _text(content: str | list[Block] | None) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    return "".join(block.text or "" for block in content if block.type == "text")


def _chat_messages(message: Message) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results are tool messages (before its text)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    for block in message.content:
        if block.type not in ("text", "tool_use", "tool_result", "thinking", "redacted_thinking"):
            raise ValueError(f"content blocks of type {block.type[:40]!r} are not supported (text, tool_use and"
                             " tool_result are)")
    text = _text(message.content)
    if message.role == "assistant":
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input or {})}}
                 for b in message.content if b.type == "tool_use"]
        return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
    results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
               for b in message.content if b.type == "tool_result"]
    has_text = any(b.type == "text" for b in message.content)
    return results + ([{"role": "user", "content": text}] if has_text or not results else [])


def _chat_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in tools]


def _chat_tool_choice(choice: ToolChoice | None) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


# --- replies ---------------------------------------------------------------------------------------------------------


_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


def reply(response: p.ChatCompletionResponse, message_id: str | None = None) -> dict[str, Any]:
    """The Anthropic message for a chat completion."""
    choice = response.choices[0]
    content: list[dict[str, Any]] = [{"type": "text", "text": choice.message.content}] if choice.message.content else []
    content += [_tool_use(call) for call in choice.message.tool_calls or []]
    return {"id": message_id or _message_id(), "type": "message", "role": "assistant", "model": response.model,
            "content": content, **_stop(choice), "usage": _usage(response.usage)}


def _tool_use(call: p.ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    # Anthropic's input is an object: arguments that are not one (a forced call the model botched) go as they are
    return {"type": "tool_use", "id": call.id, "name": call.function.name,
            "input": arguments if isinstance(arguments, dict) else {"arguments": call.function.arguments}}


def _stop(choice: p.Choice) -> dict[str, Any]:
    if choice.stop_reason is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": choice.stop_reason}
    return {"stop_reason": _STOP_REASONS[choice.finish_reason], "stop_sequence": None}


def _usage(usage: p.Usage) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


async def stream(model: str, input_tokens: int, events: AsyncIterator[Event]) -> AsyncIterator[str]:
    """Anthropic's stream events for a reply: text blocks as the text comes, then tool uses, then the stop."""
    message_id = _message_id()
    yield _sse("message_start", {"message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}})
    index, text_open = 0, False
    async for event in events:
        if isinstance(event, p.ErrorInfo):
            yield _sse("error", error_body(500, event))
            return
        if isinstance(event, str):
            if not text_open:
                yield _sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                text_open = True
            yield _sse("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": event}})
            continue
        if text_open:
            yield _sse("content_block_stop", {"index": 0})
            index = 1
        for block in reply(event, message_id)["content"]:
            if block["type"] == "tool_use":
                for chunk in _tool_use_events(index, block):
                    yield chunk
                index += 1
        stop = _stop(event.choices[0])
        yield _sse("message_delta", {"delta": stop, "usage": {"output_tokens": event.usage.completion_tokens}})
        yield _sse("message_stop", {})


def _tool_use_events(index: int, block: dict[str, Any]) -> list[str]:
    return [_sse("content_block_start", {"index": index, "content_block": {**block, "input": {}}}),
            _sse("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                   "partial_json": json.dumps(block["input"])}}),
            _sse("content_block_stop", {"index": index})]


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


# --- errors ----------------------------------------------------------------------------------------------------------


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, error: p.ErrorInfo) -> dict[str, Any]:
    """Anthropic's error body for a marl error (its `code` kept, for clients that branch on marl's codes)."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message, "code": error.code},
            "request_id": f"req_{int(time.time() * 1000)}"}


class AnthropicErrors:
    """ASGI middleware: an error answer on `/v1/messages` (a refusal, a validation error, an auth failure before the
    body was read) in Anthropic's shape; the OpenAI-shaped body is what every other route answers."""

    def __init__(self, app: Any, path: str = p.ROUTE_MESSAGES) -> None:
        self.app, self.path = app, path

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def reshape(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start.update(message)
                return
            if not start:
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                await _send_reshaped(send, start, b"".join(chunks))

        await self.app(scope, receive, reshape)


async def _send_reshaped(send: Any, start: dict[str, Any], body: bytes) -> None:
    try:
        info = p.ErrorResponse.model_validate_json(body).error
    except ValueError:
        info = p.ErrorInfo(message=body.decode(errors="replace")[:300] or f"HTTP {start['status']}")
    payload = json.dumps(error_body(start["status"], info)).encode()
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length", b"content-type")]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": start["status"], "headers": headers})
    await send({"type": "http.response.body", "body": payload})
