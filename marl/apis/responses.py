"""OpenAI's Responses API (`POST /v1/responses`) as chat completions: request, reply and stream events.

What the OpenAI Agents SDK's default model (and Codex-style harnesses) send: `instructions`, `input` (a string, or
items: messages with text parts, the model's `function_call`s and their `function_call_output`s), function `tools`,
`tool_choice`, `max_output_tokens`. The whole conversation comes with every request: `previous_response_id` (state
kept by the server) is refused with a 400 that says so, as are hosted tools and item references. A function call
item joins the assistant message before it, so the history renders as the model wrote it and merges into one
sample. Errors keep OpenAI's shape (`marl.protocol.ErrorResponse`), which the Responses API shares.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from marl import protocol as p
from marl.apis.shapes import text_or

Event = str | p.ChatCompletionResponse | p.ErrorInfo  # a text delta, the whole reply, or a failure mid-stream


class ContentPart(BaseModel):
    """A part of a message's content or of a call's output: its `text` is read (input_text, output_text)."""

    model_config = ConfigDict(extra="allow")

    type: str = "input_text"
    text: str | None = None


class Item(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str = "message"
    role: str | None = None
    content: text_or(list[ContentPart], "parts") | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: text_or(list[ContentPart], "parts") | None = None


class Tool(BaseModel):
    """A tool: only a function tool is served (hosted tools are refused by name in `to_chat`)."""

    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ResponsesRequest(p._Request):
    # Other fields (store, include, reasoning, truncation, parallel_tool_calls, ...) are accepted and ignored.
    model_config = ConfigDict(extra="ignore")

    model: str
    input: text_or(Annotated[list[Item], Field(fail_fast=True)], "items")  # fail fast: the first bad item
    instructions: str | None = None
    tools: Annotated[list[Tool], Field(fail_fast=True)] | None = None
    tool_choice: Any = None
    max_output_tokens: p.Int | None = Field(None, ge=1)
    temperature: p.Real | None = Field(None, ge=0, le=2)
    top_p: p.Real | None = Field(None, gt=0, le=1)
    stream: p.Bool = False
    user: str | None = Field(None, max_length=p.MAX_ID_LENGTH)
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None

    def to_chat(self) -> p.ChatCompletionRequest:
        """The same request as chat completions; ValueError for what this server does not support."""
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id is not supported: this server keeps no responses; send the whole"
                             " conversation in `input` (store: false)")
        text_format = (self.text or {}).get("format") or {}
        if not isinstance(text_format, dict) or text_format.get("type", "text") != "text":
            raise ValueError("text.format other than 'text' (structured outputs) is not supported")
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [Item(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            _add_item(messages, item)
        optional = {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p)) if v is not None}
        return p.ChatCompletionRequest(model=self.model, messages=messages, max_tokens=self.max_output_tokens,
                                       tools=_chat_tools(self.tools), tool_choice=_chat_tool_choice(self.tool_choice),
                                       user=self.user, **optional)


def _add_item(messages: list[dict[str, Any]], item: Item) -> None:
    if item.type == "message":
        messages.append({"role": item.role or "user", "content": _text(item.content)})
    elif item.type == "function_call":
        call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        if not (messages and messages[-1]["role"] == "assistant"):
            messages.append({"role": "assistant", "content": ""})
        messages[-1].setdefault("tool_calls", []).append(call)
    elif item.type == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    elif item.type != "reasoning":
        raise ValueError(f"input items of type {item.type[:40]!r} are not supported (message, function_call and"
                         " function_call_output are)")


def _text(content: str | list[ContentPart] | None) -> str:
    if isinstance(content, list):
        return "".join(part.text or "" for part in content)
    return content or ""


def _chat_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    unsupported = [t.type[:40] for t in tools if t.type != "function"][:8]
    if unsupported:
        raise ValueError(f"only function tools are supported, not {unsupported}")
    return [{"type": "function", "function": t.model_dump(include={"name", "description", "parameters"},
                                                          exclude_unset=True)} for t in tools]


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "auto", "none", "required" (anything else is refused as a chat tool_choice)


# --- replies ---------------------------------------------------------------------------------------------------------


def reply(request: ResponsesRequest, response: p.ChatCompletionResponse, response_id: str | None = None,
          status: str = "completed") -> dict[str, Any]:
    """The Response object for a chat completion (`status` "in_progress" and no output: the stream's first)."""
    choice = response.choices[0]
    done = status != "in_progress"
    incomplete = done and choice.finish_reason == "length"
    return {
        "id": response_id or f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": response.created,
        "status": "incomplete" if incomplete else status, "model": response.model,
        "output": _output(choice.message) if done else [], "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "parallel_tool_calls": True, "tool_choice": request.tool_choice or "auto",
        "tools": [tool.model_dump(exclude_unset=True) for tool in request.tools or []],
        "temperature": request.temperature, "top_p": request.top_p, "previous_response_id": None,
        "usage": _usage(response.usage) if done else None, "user": request.user,
    }


def _output(message: p.AssistantMessage) -> list[dict[str, Any]]:
    items = [_message_item(message.content)] if message.content else []
    return items + [_call_item(call) for call in message.tool_calls or []]


def _message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _call_item(call: p.ToolCall) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id, "name": call.function.name,
            "arguments": call.function.arguments, "status": "completed"}


def _usage(usage: p.Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


class _Sequence:
    """Numbers the events of one stream (`sequence_number`) and writes them as server-sent events."""

    def __init__(self) -> None:
        self.number = 0

    def __call__(self, kind: str, **data: Any) -> str:
        event = {"type": kind, "sequence_number": self.number, **data}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"


async def stream(request: ResponsesRequest, model: str, events: AsyncIterator[Event]) -> AsyncIterator[str]:
    """The Responses stream for a reply: the message's text as it comes, then the function calls, then completion."""
    sse, response_id, text_id = _Sequence(), f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
    empty = p.ChatCompletionResponse(id=response_id, created=int(time.time()), model=model, usage=p.Usage(
        prompt_tokens=0, completion_tokens=0, total_tokens=0), choices=[p.Choice(
            message=p.AssistantMessage(content=None), finish_reason="stop")])
    started = reply(request, empty, response_id, status="in_progress")
    yield sse("response.created", response=started)
    yield sse("response.in_progress", response=started)
    text = ""
    async for event in events:
        if isinstance(event, p.ErrorInfo):
            yield sse("error", code=event.code, message=event.message, param=event.param)
            yield sse("response.failed", response={**started, "status": "failed", "error": {
                "code": event.code, "message": event.message}})
            return
        if isinstance(event, str):
            if not text:
                yield sse("response.output_item.added", output_index=0, item=_message_item("", "in_progress", text_id))
                yield sse("response.content_part.added", item_id=text_id, output_index=0, content_index=0,
                          part={"type": "output_text", "text": "", "annotations": []})
            text += event
            yield sse("response.output_text.delta", item_id=text_id, output_index=0, content_index=0, delta=event,
                      logprobs=[])
            continue
        for chunk in _closing_events(sse, request, event, response_id, text_id, text):
            yield chunk


def _closing_events(sse: _Sequence, request: ResponsesRequest, response: p.ChatCompletionResponse, response_id: str,
                    text_id: str, text: str) -> list[str]:
    final = reply(request, response, response_id)
    streamed = bool(text) and bool(final["output"]) and final["output"][0]["type"] == "message"
    if streamed:  # the message item streamed: it keeps its id
        final["output"][0]["id"] = text_id
    chunks = []
    if streamed:
        part = final["output"][0]["content"][0]
        chunks += [sse("response.output_text.done", item_id=text_id, output_index=0, content_index=0,
                       text=part["text"], logprobs=[]),
                   sse("response.content_part.done", item_id=text_id, output_index=0, content_index=0, part=part),
                   sse("response.output_item.done", output_index=0, item=final["output"][0])]
    for index, item in enumerate(final["output"][int(streamed):], start=int(streamed)):
        chunks += [sse("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                "status": "in_progress"}),
                   sse("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                       delta=item["arguments"]),
                   sse("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       arguments=item["arguments"]),
                   sse("response.output_item.done", output_index=index, item=item)]
    # always response.completed (its status says "incomplete" when cut at max_output_tokens): the SDKs wait for it
    return chunks + [sse("response.completed", response=final)]
