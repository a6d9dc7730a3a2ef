"""The chosen answer as server-sent events, for an app that asked to stream.

The proxy streams only once the winner is chosen (every candidate must be complete to be scored), so the events
carry the whole reply at once: the role, the text, the tool calls, the finish reason, the usage if asked, [DONE].
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from marl.protocol import ChatCompletionChunk, ChatCompletionResponse, ChunkChoice, DeltaMessage


def sse_events(response: ChatCompletionResponse, *, include_usage: bool) -> Iterator[str]:
    choice = response.choices[0]
    message = choice.message

    def event(delta: DeltaMessage | None, finish: str | None = None) -> str:
        choices = [] if delta is None else [
            ChunkChoice(delta=delta, finish_reason=finish, token_ids=choice.token_ids if finish else None)]
        chunk = ChatCompletionChunk(id=response.id, created=response.created, model=response.model, choices=choices,
                                    usage=response.usage if delta is None else None)  # the usage chunk has no choice
        return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

    yield event(DeltaMessage(role="assistant", content=""))
    if message.content:
        yield event(DeltaMessage(content=message.content))
    if message.tool_calls:
        calls = [dict(index=i, **call.model_dump()) for i, call in enumerate(message.tool_calls)]
        yield event(DeltaMessage(tool_calls=calls))
    yield event(DeltaMessage(), choice.finish_reason)
    if include_usage:
        yield event(None)
    yield "data: [DONE]\n\n"


async def reply_events(response: ChatCompletionResponse) -> AsyncIterator[str | ChatCompletionResponse]:
    """The chosen answer as the stream events `marl.apis` turns into a Responses or Messages stream: its text at
    once, then the whole reply."""
    if response.choices[0].message.content:
        yield response.choices[0].message.content
    yield response
