"""The OpenAI-compatible data plane's bodies: chat completions (whole and streamed) and the model list."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from marl.protocol.fields import SEED_MAX, SEED_MIN, Bool, Int, Real, _Request
from marl.protocol.routes import AGENT_HEADER, MAX_ID_LENGTH


class ContentPart(BaseModel):
    """One part of a message's content (`{"type": "text", "text": ...}`); parts of other types carry no text."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: Bool = False


#: The most strings a `structured_outputs.choice` may list, and the longest one (a move's name, a label).
MAX_CHOICES, MAX_CHOICE_CHARS = 64, 256


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extension, its `choice` form only: the reply is exactly one of these strings
    (each spelled as the tokenizer spells it alone, then the end of the reply). The logprobs recorded stay the
    model's own, as for a forced tool call (docs/design.md, "The other APIs, tool choice")."""

    model_config = ConfigDict(extra="forbid")

    choice: list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]] = Field(
        min_length=1, max_length=MAX_CHOICES)

    @model_validator(mode="before")
    @classmethod
    def _choice_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and (other := sorted(k for k in data if k != "choice")):
            raise ValueError(f"structured_outputs {other} is not supported here: only choice (a list of strings)")
        return data


class ChatCompletionRequest(_Request):
    # Unknown OpenAI parameters (frequency_penalty, ...) are accepted and ignored, as vLLM does.
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    temperature: Real = Field(1.0, ge=0, le=2)
    top_p: Real = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = Field(None, max_length=16)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    seed: Int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: Int = Field(1, ge=1, le=1, description="Only n=1: each sample must be its own recorded call.")
    user: str | None = Field(None, max_length=MAX_ID_LENGTH, description="Tags the call with an agent when the"
                             f" {AGENT_HEADER} header does not.")
    logprobs: Bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=0, description="Not supported: the server records and returns"
                                     " the sampled token's logprob only (omit it, or send 0).")
    return_token_ids: Bool = Field(False, description="vLLM extension: include prompt and completion token ids.")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM extension, `choice` only: the"
                                                         " reply is exactly one of the strings listed.")

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _no_top_logprobs(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            raise ValueError("top_logprobs is not supported by this server: it returns the logprob of each sampled"
                             " token only (logprobs: true); omit top_logprobs or send 0")
        return value


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids
    stop_reason: str | None = None  # vLLM extension: the stop string that ended the reply, if one did


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None



class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "marl"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
