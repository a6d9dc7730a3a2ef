"""The OpenAI chat-completions service of a swarm server (the data plane), apart from its HTTP route.

`ChatService.admit` turns the caller's key into the session the call runs under (a lease on a trainable server,
nothing on a static one); `servers.http_routes` asks it once, from the headers, before the body is read.
`ChatService.create` owns the chat completion from there to the reply: it checks the model name, renders the prompt
into token ids (spliced onto the lease's earlier calls, see `servers.chat_format`) in a worker thread, so that a long
prompt never stalls the event loop, checks the context length, runs the engine, records exactly what the engine
produced on the lease, and shapes the OpenAI response or its SSE chunks. `servers.http_routes` only routes to it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from typing import Protocol

from marl import protocol as p
from marl.protocol import EngineState, ErrorCode
from servers.chat_format import ChatFormatter, PromptError, PromptTooLong, StreamDecoder, parse_tool_calls
from servers.errors import Refusal
from servers.interfaces import InferenceEngine, SamplingParams
from servers.samples import CallRecord
from servers.telemetry import Telemetry


class ServedModel(Protocol):
    """What the data plane reads of whatever serves the model (the engine lifecycle, or a static server)."""

    model: str  # as configured (an alias or a path): accepted as a request's `model` too, never shown
    served_name: str
    state: EngineState
    policy_version: int
    engine: InferenceEngine | None
    formatter: ChatFormatter | None


class CallSession(Protocol):
    """What a call runs under: its lease on a trainable server (`servers.leases.Lease`), nothing on a static one."""

    calls: list[CallRecord]  # earlier calls, for prompt splicing

    def busy(self) -> AbstractContextManager[None]:
        """Entered while the engine generates for the call."""

    def record(self, call: CallRecord) -> bool:
        """Keep the finished call; False if it came too late (the lease died meanwhile)."""


#: Admits a data-plane key: the session the call runs under, or a `Refusal`.
Admission = Callable[[str | None], CallSession]


class ChatService:
    def __init__(self, model: ServedModel, admit: Admission, telemetry: Telemetry):
        self.model = model
        self.admit = admit
        self.telemetry = telemetry

    def models(self) -> p.ModelList:
        engine = self.model.engine
        length = engine.context_length if engine is not None else None
        return p.ModelList(data=[p.ModelCard(id=self.model.served_name, max_model_len=length)])

    async def create(self, body: p.ChatCompletionRequest, session: CallSession,
                     agent: str | None) -> p.ChatCompletionResponse | AsyncIterator[str]:
        """The completion, or (with `stream`) its server-sent events.

        `session`: what `admit` gave for the call's key (`servers.http_routes` admits it once, from the headers,
        before the body is read); a lease that dies while the call runs keeps nothing of it (`CallSession.record`).
        `agent` (the `X-Marl-Agent` header) tags the call; without it, the body's `user`; else `DEFAULT_AGENT`.
        """
        engine, formatter = self._ready_engine()
        if body.model not in (self.model.served_name, self.model.model):
            raise Refusal(404, ErrorCode.MODEL_NOT_FOUND, f"model '{body.model}' is not served here; this server"
                          f" serves '{self.model.served_name}' (see GET /v1/models)", param="model")
        try:
            prompt_ids = await asyncio.to_thread(formatter.prompt_ids, body, list(session.calls),
                                                 engine.context_length)
        except PromptError as exc:
            raise Refusal(400, ErrorCode.INVALID_MESSAGES, str(exc), param="messages") from exc
        except PromptTooLong as exc:
            raise _too_long(f"at least {exc.tokens}", body, engine.context_length) from exc
        params = _sampling_params(body, len(prompt_ids), engine.context_length)
        call = ChatCall(self, session, body, prompt_ids, params, agent or body.user or p.DEFAULT_AGENT)
        return call.stream() if body.stream else await call.complete()

    def _ready_engine(self) -> tuple[InferenceEngine, ChatFormatter]:
        engine, formatter, state = self.model.engine, self.model.formatter, self.model.state
        if engine is None or formatter is None:
            if state == EngineState.BOOTING:
                raise Refusal(503, ErrorCode.ENGINE_BOOTING, "the model is still loading; retry shortly",
                              retry_after_s=2.0, state=state)
            raise Refusal(503, ErrorCode.ENGINE_UNAVAILABLE, f"the engine is {state.value}; retry shortly",
                          retry_after_s=1.0, state=state)
        return engine, formatter

    def finished(self, session: CallSession, call: CallRecord) -> None:
        """Count a finished call and record it on its session (unless the lease died meanwhile)."""
        counters = self.telemetry.counters
        counters.calls += 1
        counters.tokens_prompt += len(call.prompt_ids)
        counters.tokens_generated += len(call.completion_ids)
        self.telemetry.generated.add(len(call.completion_ids))
        if not session.record(call):
            counters.calls_discarded += 1


def _sampling_params(body: p.ChatCompletionRequest, prompt_tokens: int, context_length: int) -> SamplingParams:
    room = context_length - prompt_tokens
    max_tokens = body.max_completion_tokens or body.max_tokens
    if room <= 0 or (max_tokens is not None and max_tokens > room):
        raise _too_long(str(prompt_tokens), body, context_length)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(max_tokens=max_tokens or room, temperature=body.temperature, top_p=body.top_p, stop=stop,
                          seed=body.seed)


def _too_long(prompt_tokens: str, body: p.ChatCompletionRequest, context_length: int) -> Refusal:
    max_tokens = body.max_completion_tokens or body.max_tokens
    return Refusal(400, ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                   f"the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}; this model's context limit"
                   f" is {context_length} tokens: shorten the conversation or lower max_tokens", param="messages")


class ChatCall:
    """One chat completion: runs the engine, records exactly what it produced, shapes the OpenAI reply."""

    def __init__(self, service: ChatService, session: CallSession, body: p.ChatCompletionRequest,
                 prompt_ids: list[int], params: SamplingParams, agent: str):
        self.service, self.session, self.body = service, session, body
        self.prompt_ids, self.params, self.agent = prompt_ids, params, agent
        model = service.model
        self.engine, self.formatter, self.model_name = model.engine, model.formatter, model.served_name
        self.version = model.policy_version  # weights change only once the leases drained: one version per call
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish = "length"

    async def _chunks(self) -> AsyncIterator[list[int]]:
        """Run the engine (the session counts as busy meanwhile); record the call once it finishes."""
        with self.session.busy():
            async for chunk in self.engine.generate(self.prompt_ids, self.params):
                self.ids += chunk.token_ids
                self.logprobs += chunk.logprobs
                if chunk.finish_reason:
                    self.finish = chunk.finish_reason
                yield chunk.token_ids
        self.service.finished(self.session, CallRecord(
            agent=self.agent, prompt_ids=self.prompt_ids, completion_ids=self.ids, logprobs=self.logprobs,
            policy_version=self.version))

    async def complete(self) -> p.ChatCompletionResponse:
        try:
            async for _ in self._chunks():
                pass
        except Exception as exc:
            raise self._failed(exc) from exc
        message, finish = self._message()
        token_ids = self.body.return_token_ids
        return p.ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model_name,
            choices=[p.Choice(message=message, finish_reason=finish, logprobs=self._logprobs(),
                              token_ids=self.ids if token_ids else None)],
            usage=self._usage(), prompt_token_ids=self.prompt_ids if token_ids else None)

    def _failed(self, exc: Exception) -> Refusal:
        """A failed generation, kept in the server's error log too: `last_error` then says why (a dead engine)."""
        refusal = _generation_failed(exc)
        self.service.telemetry.errors.report(refusal.message)
        return refusal

    async def stream(self) -> AsyncIterator[str]:
        yield self._sse(p.DeltaMessage(role="assistant", content=""))
        decoder = StreamDecoder(self.formatter, self.params.stop)
        try:
            async for ids in self._chunks():
                text = "" if self.body.tools else decoder.push(ids)  # tool calls are parsed from the whole reply
                if text:
                    yield self._sse(p.DeltaMessage(content=text))
        except Exception as exc:  # the status line is sent already: report in-band, as OpenAI does
            yield f"data: {json.dumps({'error': self._failed(exc).info().model_dump(mode='json')})}\n\n"
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
            usage = p.ChatCompletionChunk(id=self.id, created=self.created, model=self.model_name, choices=[],
                                          usage=self._usage())
            yield f"data: {usage.model_dump_json(exclude_none=True)}\n\n"
        yield "data: [DONE]\n\n"

    def _usage(self) -> p.Usage:
        return p.Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.ids),
                       total_tokens=len(self.prompt_ids) + len(self.ids))

    def _logprobs(self) -> p.ChoiceLogprobs | None:
        if not self.body.logprobs:
            return None
        return p.ChoiceLogprobs(content=[
            p.TokenLogprob(token=self.formatter.decode([t]), logprob=lp) for t, lp in zip(self.ids, self.logprobs)])

    def _message(self) -> tuple[p.AssistantMessage, str]:
        text = self.formatter.reply_text(self.ids, self.params.stop)
        content, tool_calls = parse_tool_calls(text) if self.body.tools else (text, [])
        finish = "tool_calls" if tool_calls else self.finish
        return p.AssistantMessage(content=content, tool_calls=tool_calls or None), finish

    def _sse(self, delta: p.DeltaMessage, finish: str | None = None, **extra) -> str:
        chunk = p.ChatCompletionChunk(id=self.id, created=self.created, model=self.model_name,
                                      choices=[p.ChunkChoice(delta=delta, finish_reason=finish, **extra)])
        return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


def _generation_failed(exc: Exception) -> Refusal:
    return Refusal(500, ErrorCode.ENGINE_ERROR, f"generation failed: {exc}")
