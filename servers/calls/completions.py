"""`POST /v1/completions`: token-in/token-out completions, for harnesses that keep the token ids themselves.

The prompt is text or a list of token ids. Token ids are taken as they are (the caller rendered its own template,
control tokens included; ids outside the vocabulary are refused); text is text, as message text is on the chat path:
a control token's string in it stays those characters (send ids for control tokens). A text prompt that extends an
earlier call of the lease is spliced onto that call's exact ids, as a chat prompt is. The reply carries the generated
`token_ids` (and the prompt's, `prompt_token_ids`) and each token's logprob, exactly what the ledger records; the
call is recorded like any other (agent tag, merging into one sample when the next prompt extends it).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from pydantic import ConfigDict, Field

from marl import protocol as p
from marl.protocol import ErrorCode
from servers.backends import SamplingParams
from servers.calls.chat import CallSession, ChatService
from servers.calls.chat_format import PromptTooLong, StreamDecoder
from servers.calls.engine_call import EngineCall
from servers.errors import Refusal

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for completions


class CompletionRequest(p._Request):
    model_config = ConfigDict(extra="ignore")  # other OpenAI parameters are accepted and ignored, as vLLM does

    model: str
    prompt: str | Annotated[list[p.Int], Field(fail_fast=True)] = Field(
        description="Text, or token ids taken as they are.")
    max_tokens: p.Int | None = Field(None, ge=1)
    temperature: p.Real = Field(1.0, ge=0, le=2)
    top_p: p.Real = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = Field(None, max_length=16)
    seed: p.Int | None = Field(None, ge=p.SEED_MIN, le=p.SEED_MAX)
    n: p.Int = Field(1, ge=1, description="Only n=1: each sample must be its own recorded call.")
    stream: p.Bool = False
    logprobs: p.Int | None = Field(None, ge=0, description="Only 0 (or absent): every reply carries the sampled"
                                   " tokens' logprobs; top alternatives are not supported.")
    echo: p.Bool = Field(False, description="Not supported: the prompt is not echoed.")
    user: str | None = Field(None, max_length=p.MAX_ID_LENGTH)


async def create_completion(chat: ChatService, body: CompletionRequest, session: CallSession,
                            agent: str | None) -> dict[str, Any] | AsyncIterator[str]:
    engine, formatter = chat.ready_engine()
    chat.check_model(body.model)
    _check_supported(body)
    context = engine.context_length
    if body.prompt in ("", []):
        raise Refusal(400, ErrorCode.INVALID_REQUEST, "the prompt is empty: send text or at least one token id",
                      param="prompt")
    if isinstance(body.prompt, str):
        try:
            prompt_ids = await asyncio.to_thread(formatter.text_prompt_ids, body.prompt, list(session.calls), context)
        except PromptTooLong as exc:
            raise _too_long(exc.tokens, context) from exc
    else:
        if len(body.prompt) >= context:  # before each id is looked at
            raise _too_long(len(body.prompt), context)
        prompt_ids = _checked_ids(body.prompt, len(formatter.tokenizer))
    room = context - len(prompt_ids)
    max_tokens = body.max_tokens or min(DEFAULT_MAX_TOKENS, room)
    if room <= 0 or max_tokens > room:
        raise _too_long(len(prompt_ids), context)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, stop=stop,
                            seed=body.seed, stream=bool(body.stream))
    call = CompletionCall(chat, session, prompt_ids, params, agent or body.user or p.DEFAULT_AGENT)
    if body.stream:
        return call.stream()
    await call.run()
    return call.reply()


def _check_supported(body: CompletionRequest) -> None:
    """OpenAI options this route does not offer, refused with what it does offer (a 400 naming the field)."""
    if body.logprobs:
        raise Refusal(400, ErrorCode.UNSUPPORTED_VALUE, f"logprobs={body.logprobs} is not supported: top"
                      " alternatives are not returned. Send logprobs 0 or leave it out: every choice carries the"
                      " sampled tokens' logprobs anyway (logprobs.token_logprobs)", param="logprobs")
    if body.n != 1:
        raise Refusal(400, ErrorCode.UNSUPPORTED_VALUE, f"n={body.n} is not supported: only n=1 (each sample is its"
                      " own recorded call); send n requests instead", param="n")
    if body.echo:
        raise Refusal(400, ErrorCode.UNSUPPORTED_VALUE, "echo=true is not supported: the prompt is not echoed (its"
                      " ids are in prompt_token_ids); leave echo out", param="echo")


def _checked_ids(ids: list[int], vocabulary: int) -> list[int]:
    bad = next((i for i in ids if not 0 <= i < vocabulary), None)
    if bad is not None:
        raise Refusal(400, ErrorCode.INVALID_REQUEST, f"token id {bad} is not in this model's vocabulary (0 to"
                      f" {vocabulary - 1})", param="prompt")
    return list(ids)


def _too_long(prompt_tokens: int, context_length: int) -> Refusal:
    return Refusal(400, ErrorCode.CONTEXT_LENGTH_EXCEEDED, f"the prompt has at least {prompt_tokens} tokens, and"
                   f" with max_tokens it passes this model's context limit of {context_length} tokens",
                   param="prompt")


class CompletionCall(EngineCall):
    """One completion: the engine's ids and logprobs, and the text they decode to (cut at a stop string)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def reply(self) -> dict[str, Any]:
        choice = {"index": 0, "text": self.formatter.reply_text(self.ids, self.params.stop),
                  "finish_reason": self.finish, "logprobs": self._logprobs(), "token_ids": self.ids}
        return self._body([choice], usage=self.usage().model_dump(), prompt_token_ids=self.prompt_ids)

    def _logprobs(self) -> dict[str, Any]:
        tokens = [self.formatter.decode([t]) for t in self.ids]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {"tokens": tokens, "token_logprobs": self.logprobs, "top_logprobs": None, "text_offset": offsets}

    async def stream(self) -> AsyncIterator[str]:
        decoder = StreamDecoder(self.formatter, self.params.stop)
        try:
            async for ids in self.chunks():
                if text := decoder.push(ids):
                    yield self._sse([{"index": 0, "text": text, "finish_reason": None}])
        except Exception as exc:  # the status line is sent already: report in-band
            yield f"data: {json.dumps({'error': self.failed(exc).info().model_dump(mode='json')})}\n\n"
            return
        last = {**self.reply()["choices"][0], "text": decoder.finish()}
        yield self._sse([last], usage=self.usage().model_dump(), prompt_token_ids=self.prompt_ids)
        yield "data: [DONE]\n\n"

    def _body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_name,
                "choices": choices, **extra}

    def _sse(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        return f"data: {json.dumps(self._body(choices, **extra))}\n\n"
