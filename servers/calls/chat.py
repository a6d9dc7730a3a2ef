"""The OpenAI chat-completions service of a swarm server (the data plane), apart from its HTTP route.

`ChatService.admit` turns the caller's key into the session the call runs under (a lease on a trainable server,
nothing on a static one); `servers.http.routes` asks it once, from the headers, before the body is read.
`ChatService.start` prepares a chat call from there: it checks the model name and the tool choice
(`servers.calls.tool_choice`: a forced tool call prefills the reply's opening), renders the prompt into token ids
(spliced onto the lease's earlier calls, see `servers.calls.chat_format`) and checks the context length. A long prompt
renders in a worker thread, so that it never stalls the event loop; a short one (`INLINE_PROMPT_MESSAGES`,
`INLINE_PROMPT_CHARS`) on the loop itself, because the hop to a thread and back, each side waiting for the GIL while
the other works, cost more: the server's own time per call at 64 leases fell from 6.6 to 2.0 ms at p50 and from 64 to
14 ms at p99 (docs/scale.md). The `ChatCall` runs the engine and records exactly what it produced
(`servers.calls.engine_call`), and shapes the OpenAI response or its SSE chunks; its `events` (text as it comes, then
the whole response) are what the Responses and Messages APIs stream in their own shapes (`servers.calls.translated`).
`ChatService.create` is a chat completion in one call (the route starts the `ChatCall` itself, to report its engine
time as a `Server-Timing` header). `servers.http.routes` only routes to these.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from marl import protocol as p
from marl.protocol import EngineState, ErrorCode
from servers.backends import InferenceEngine, SamplingParams
from servers.calls import tool_choice
from servers.calls.chat_format import ChatFormatter, PromptError, PromptTooLong, StreamDecoder, parse_tool_calls
from servers.calls.engine_call import CallSession, EngineCall, ServedModel  # CallSession: re-exported
from servers.calls.tool_choice import ToolChoice, ToolChoiceError, ToolTextHoldback
from servers.episodes.samples import CallRecord
from servers.errors import Refusal, excerpt
from servers.metrics.telemetry import Telemetry


class Unleased:
    """The session of a call that no lease holds (a static server's, a frozen policy's): no history, nothing kept."""

    @property
    def calls(self) -> list[CallRecord]:
        return []

    def busy(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def record(self, call: CallRecord) -> bool:
        return True


#: Admits a data-plane key: the session the call runs under, or a `Refusal`.
Admission = Callable[[str | None], CallSession]


class ChatService:
    def __init__(self, model: ServedModel, admit: Admission, telemetry: Telemetry):
        self.model = model
        self.admit = admit
        self.telemetry = telemetry

    def route(self, admitted: CallSession, model: str) -> tuple[ChatService, CallSession]:
        """The service and session a call for `model` runs under, from what `admit` gave: here, this one service."""
        return self, admitted

    def models(self) -> p.ModelList:
        engine = self.model.engine
        length = engine.context_length if engine is not None else None
        return p.ModelList(data=[p.ModelCard(id=self.model.served_name, max_model_len=length)])

    async def create(self, body: p.ChatCompletionRequest, session: CallSession,
                     agent: str | None) -> p.ChatCompletionResponse | AsyncIterator[str]:
        """The completion, or (with `stream`) its server-sent events.

        `session`: what `admit` gave for the call's key (`servers.http.routes` admits it once, from the headers,
        before the body is read); a lease that dies while the call runs keeps nothing of it (`CallSession.record`).
        `agent` (the `X-Marl-Agent` header) tags the call; without it, the body's `user`; else `DEFAULT_AGENT`.
        """
        call = await self.start(body, session, agent)
        return call.stream() if body.stream else await call.complete()

    async def start(self, body: p.ChatCompletionRequest, session: CallSession, agent: str | None) -> ChatCall:
        """The call, its prompt rendered into ids, ready to run: the one way every chat-shaped API reaches the
        engine (the Responses and Messages APIs are translated into `body`)."""
        engine, formatter = self.ready_engine()
        self.check_model(body.model)
        choice = _tool_choice(body)
        history = list(session.calls)
        render = (formatter, body, choice, history, engine.context_length)
        try:
            if _renders_in_moments(body, history):  # a worker thread costs more than the render (module docstring)
                prefill, prompt_ids, lead = _prompt(*render)
            else:
                prefill, prompt_ids, lead = await asyncio.to_thread(_prompt, *render)
        except PromptError as exc:
            raise Refusal(400, ErrorCode.INVALID_MESSAGES, str(exc), param="messages") from exc
        except PromptTooLong as exc:
            raise _too_long(f"at least {exc.tokens}", body, engine.context_length) from exc
        params = replace(_sampling_params(body, len(prompt_ids), engine.context_length), lead=lead)
        return ChatCall(self, session, body, prompt_ids, params, agent or body.user or p.DEFAULT_AGENT, choice,
                        prefill)

    def check_model(self, model: str) -> None:
        if model not in (self.model.served_name, self.model.model):
            raise Refusal(404, ErrorCode.MODEL_NOT_FOUND, f"model {excerpt(model)} is not served here; this server"
                          f" serves '{self.model.served_name}' (see GET /v1/models)", param="model")

    def ready_engine(self) -> tuple[InferenceEngine, ChatFormatter]:
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
                          seed=body.seed, stream=bool(body.stream))


def _too_long(prompt_tokens: str, body: p.ChatCompletionRequest, context_length: int) -> Refusal:
    max_tokens = body.max_completion_tokens or body.max_tokens
    return Refusal(400, ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                   f"the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}; this model's context limit"
                   f" is {context_length} tokens: shorten the conversation or lower max_tokens", param="messages")


class ChatCall(EngineCall):
    """One chat completion: its prompt, the tool choice it honours, and the OpenAI reply it shapes."""

    def __init__(self, service: ChatService, session: CallSession, body: p.ChatCompletionRequest,
                 prompt_ids: list[int], params: SamplingParams, agent: str, choice: ToolChoice, prefill: str):
        super().__init__(service, session, prompt_ids, params, agent)
        self.body, self.choice, self.prefill = body, choice, prefill
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    async def complete(self) -> p.ChatCompletionResponse:
        await self.run()
        return self.response()

    async def events(self) -> AsyncIterator[str | p.ChatCompletionResponse]:
        """The reply's text as it comes (str deltas), then the whole response. Text that may belong to a tool call
        is held back (`ToolTextHoldback`); a forced tool call streams no text. Raises what the engine raised."""
        decoder = StreamDecoder(self.formatter, self.params.stop)
        holdback = ToolTextHoldback() if self.body.tools and self.choice.mode == "auto" else None
        sent = ""
        async for ids in self.chunks():
            text = decoder.push(ids)
            if holdback is not None:
                text = holdback.push(text)
            if text and not self.choice.forced:
                sent += text
                yield text
        response = self.response()
        content = response.choices[0].message.content or ""
        if len(content) > len(sent) and content.startswith(sent):
            yield content[len(sent):]
        yield response

    async def stream(self) -> AsyncIterator[str]:
        """The chat completion's server-sent events."""
        yield self._sse(p.DeltaMessage(role="assistant", content=""))
        try:
            async for event in self.events():
                if isinstance(event, str):
                    yield self._sse(p.DeltaMessage(content=event))
                else:
                    choice = event.choices[0]
        except Exception as exc:  # the status line is sent already: report in-band, as OpenAI does
            yield f"data: {json.dumps({'error': self.failed(exc).info().model_dump(mode='json')})}\n\n"
            return
        if choice.message.tool_calls:
            calls = [dict(index=i, **c.model_dump()) for i, c in enumerate(choice.message.tool_calls)]
            yield self._sse(p.DeltaMessage(tool_calls=calls))
        yield self._sse(p.DeltaMessage(), choice.finish_reason, token_ids=choice.token_ids)
        if self.body.stream_options and self.body.stream_options.include_usage:
            usage = p.ChatCompletionChunk(id=self.id, created=self.created, model=self.model_name, choices=[],
                                          usage=self.usage())
            yield f"data: {usage.model_dump_json(exclude_none=True)}\n\n"
        yield "data: [DONE]\n\n"

    def response(self) -> p.ChatCompletionResponse:
        message, finish = self._message()
        token_ids = self.body.return_token_ids
        return p.ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model_name,
            choices=[p.Choice(message=message, finish_reason=finish, logprobs=self._logprobs(),
                              token_ids=self.ids if token_ids else None, stop_reason=self._stop_string())],
            usage=self.usage(), prompt_token_ids=self.prompt_ids if token_ids else None)

    def _stop_string(self) -> str | None:
        """The stop string the reply was cut at, if any (the Messages API reports it)."""
        if not self.params.stop:
            return None
        whole = self.formatter.reply_text(self.ids, ())
        cut = len(self.formatter.reply_text(self.ids, self.params.stop))
        return next((s for s in self.params.stop if whole.startswith(s, cut)), None) if cut < len(whole) else None

    def _logprobs(self) -> p.ChoiceLogprobs | None:
        if not self.body.logprobs:
            return None
        return p.ChoiceLogprobs(content=[
            p.TokenLogprob(token=self.formatter.decode([t]), logprob=lp) for t, lp in zip(self.ids, self.logprobs)])

    def _message(self) -> tuple[p.AssistantMessage, str]:
        text = self.formatter.reply_text(self.ids, self.params.stop)
        if self.choice.forced:  # the reply is the prefilled opening plus what the model wrote after it
            content, tool_calls = parse_tool_calls(self.prefill + text)
            if not tool_calls:
                content, tool_calls = None, self.formatter.tool_call_format.parse_forced(self.prefill + text)
        elif self.body.tools and self.choice.parses_calls:
            content, tool_calls = parse_tool_calls(text)
        else:
            content, tool_calls = text, []
        finish = "tool_calls" if tool_calls else self.finish
        return p.AssistantMessage(content=content, tool_calls=tool_calls or None), finish

    def _sse(self, delta: p.DeltaMessage, finish: str | None = None, **extra) -> str:
        chunk = p.ChatCompletionChunk(id=self.id, created=self.created, model=self.model_name,
                                      choices=[p.ChunkChoice(delta=delta, finish_reason=finish, **extra)])
        return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


def _tool_choice(body: p.ChatCompletionRequest) -> ToolChoice:
    try:
        return tool_choice.resolve(body)
    except ToolChoiceError as exc:
        raise Refusal(400, ErrorCode.INVALID_REQUEST, str(exc), param="tool_choice") from exc


#: A prompt of at most this many messages and characters of text (and earlier calls of at most this many tokens not
#: yet decoded for splicing) renders on the event loop: 0.3 ms for 2 short messages, 0.5 ms for 6, on this project's
#: CPU. A bigger one renders in a worker thread.
INLINE_PROMPT_MESSAGES, INLINE_PROMPT_CHARS = 16, 4096


def _renders_in_moments(body: p.ChatCompletionRequest, history: list[CallRecord]) -> bool:
    if body.tools or len(body.messages) > INLINE_PROMPT_MESSAGES:
        return False
    texts = [m.content for m in body.messages if m.content is not None]
    undecoded = sum(len(c.prompt_ids) + len(c.completion_ids) for c in history if not c.text)
    return (all(isinstance(t, str) for t in texts) and sum(map(len, texts)) <= INLINE_PROMPT_CHARS
            and undecoded <= INLINE_PROMPT_CHARS)


def _prompt(formatter: ChatFormatter, body: p.ChatCompletionRequest, choice: ToolChoice, history: list[CallRecord],
            context_length: int) -> tuple[str, list[int], tuple[tuple[int, ...], ...]]:
    """(the text prefilled for a forced tool call, the prompt's ids, the token sequences the reply must begin with
    one of: a "required" call's declared names, `SamplingParams.lead`): in a worker thread, or on the event loop
    for a short prompt (`_renders_in_moments`)."""
    prefill, lead = "", ()
    if choice.forced:
        if formatter.tool_call_format is None:
            raise Refusal(400, ErrorCode.UNSUPPORTED_VALUE, f"tool_choice {excerpt(body.tool_choice)} is not"
                          " supported for this model: its chat template writes no <tool_call> blocks, so a tool"
                          " call cannot be forced; use 'auto'", param="tool_choice")
        prefill = formatter.tool_call_format.forced_prefix(choice)
        lead = formatter.text_lead(formatter.tool_call_format.name_leads(choice))
    if body.structured_outputs is not None:
        if choice.forced:
            raise Refusal(400, ErrorCode.UNSUPPORTED_VALUE, "structured_outputs and a forced tool call cannot both"
                          " hold the reply: send one of them", param="structured_outputs")
        lead = choice_leads(formatter, body.structured_outputs.choice)
    return prefill, formatter.prompt_ids(body, history, context_length, prefill), lead


def choice_leads(formatter: ChatFormatter, choices: list[str]) -> tuple[tuple[int, ...], ...]:
    """`structured_outputs.choice` as `SamplingParams.lead`: each string's tokens (text, never control tokens), then
    one of the tokens that end a reply, so that the reply is the whole string and nothing after it."""
    ends = sorted(formatter.eos_token_ids)
    return tuple(tuple(formatter.control_tokens.encode(text, ())) + (end,) for text in choices for end in ends)
