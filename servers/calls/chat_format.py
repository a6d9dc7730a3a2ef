"""From OpenAI chat messages to prompt token ids, and from generated ids back to an OpenAI reply.

Invariant: the model trained on is the model sampled from. An agent sends its history back as *text*; re-tokenizing
that text may not give the ids the model generated (tokenizers are not injective across merges). So when a new
prompt's rendered text starts with the decoded text of an earlier call of the same lease (its prompt + completion),
the prompt is spliced: those exact earlier ids, then the tokenized remainder. That is also what makes timeline
merging (servers.episodes.samples) find the earlier call as a token prefix.

Text is text: only the chat template makes control tokens; a message that spells out "<|im_end|>" gets the tokens
of that text (`servers.calls.control_tokens`). And a prompt that cannot fit the context is refused before it is
tokenized: its character count alone proves it (`PromptTooLong`), so a huge prompt costs no tokenizer time or memory.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from marl.protocol import ChatCompletionRequest, FunctionCall, ToolCall
from servers.calls.control_tokens import Control, ControlTokens, ControlTokenText
from servers.calls.lead_texts import Lead, LeadVocabulary
from servers.calls.tool_choice import ToolCallFormat
from servers.episodes.samples import CallRecord


class PromptError(ValueError):
    """The request cannot be rendered into a prompt (bad template input); a 400 for the caller."""


class PromptTooLong(ValueError):
    """The prompt has at least `tokens` tokens, known without tokenizing it: over the context length."""

    def __init__(self, tokens: int):
        super().__init__(f"the prompt has at least {tokens} tokens")
        self.tokens = tokens


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    controls: tuple[Control, ...]  # the control tokens the template put in `text`


class ChatFormatter:
    """Thread-safe: the server renders and tokenizes prompts in worker threads, off its event loop."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.control_tokens = ControlTokens(tokenizer)

    # --- prompts ---------------------------------------------------------------------------------------------

    def render(self, request: ChatCompletionRequest) -> RenderedPrompt:
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        for message in messages:
            message["content"] = _text_content(message.get("content"))

        def template(inputs: tuple[list[dict], list[dict] | None]) -> str:
            messages, tools = inputs
            try:
                return self._apply_template(messages, tools, generation_prompt=True)
            except Exception as exc:  # jinja errors: the messages do not fit the model's template
                raise PromptError(f"the model's chat template rejected these messages: {exc}") from exc

        try:
            text, controls = self.control_tokens.render(template, (messages, request.tools))
        except ControlTokenText as exc:
            raise PromptError(str(exc)) from exc
        return RenderedPrompt(text, controls)

    def _apply_template(self, messages: list[dict], tools: list[dict] | None, *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                                  tokenize=False)

    @functools.cached_property
    def tool_call_format(self) -> ToolCallFormat | None:
        """How this template writes a tool call (what a forced `tool_choice` prefills); None: no Hermes blocks."""
        return ToolCallFormat.probe(lambda messages, tools: self._apply_template(messages, tools,
                                                                                 generation_prompt=False))

    @functools.cached_property
    def lead_vocabulary(self) -> LeadVocabulary:
        """The vocabulary by token text (built at the first forced call that needs it: 0.1-0.5 s)."""
        return LeadVocabulary(self.tokenizer)

    def text_lead(self, texts: list[str]) -> Lead:
        """`SamplingParams.lead` for a reply that must begin with one of `texts`: each text's tokens (text, never
        control tokens), widened by the tokens that finish one and go on (`LeadVocabulary.crossing`); none without."""
        if not texts:
            return ()
        return self.lead_vocabulary.crossing(tuple(tuple(self.control_tokens.encode(text, ())) for text in texts))

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def prompt_ids(self, request: ChatCompletionRequest, history: list[CallRecord], context_length: int,
                   prefill: str = "") -> list[int]:
        """Token ids of the prompt, reusing the exact ids of the longest earlier call the prompt extends.

        `prefill` is text the reply starts with, written for the model (a forced tool call's opening): it is
        tokenized as text at the end of the prompt. Raises `PromptTooLong` when the prompt provably has
        `context_length` tokens or more, before tokenizing it.
        """
        prompt = self.render(request)
        return self.spliced_ids(RenderedPrompt(prompt.text + prefill, prompt.controls), history, context_length)

    def text_prompt_ids(self, text: str, history: list[CallRecord], context_length: int) -> list[int]:
        """Token ids of a raw text prompt (`/v1/completions`): text is text, so it holds no control tokens."""
        return self.spliced_ids(RenderedPrompt(text, ()), history, context_length)

    def spliced_ids(self, prompt: RenderedPrompt, history: list[CallRecord], context_length: int) -> list[int]:
        best: CallRecord | None = None
        for call in history:
            if not call.text:
                call.text = self.decode(call.prompt_ids + call.completion_ids)
            if prompt.text.startswith(call.text) and (best is None or len(call.text) > len(best.text)):
                best = call
        prefix = best.prompt_ids + best.completion_ids if best else []
        start = len(best.text) if best else 0
        at_least = len(prefix) + -(-(len(prompt.text) - start) // self.control_tokens.max_chars_per_token)
        if at_least >= context_length:
            raise PromptTooLong(at_least)
        return prefix + self.control_tokens.encode(prompt.text, prompt.controls, start)

    # --- replies ---------------------------------------------------------------------------------------------

    def reply_text(self, completion_ids: list[int], stop: tuple[str, ...]) -> str:
        """The reply: the generated text without its closing end-of-turn token, cut before the first stop string.

        Special tokens the model emitted mid-reply stay in the text (unlike vLLM's default): the agent then sends
        back exactly what was generated, the template re-renders it to the same ids, and the next prompt is spliced
        onto this call (see `prompt_ids`) instead of silently diverging from what the model saw.
        """
        if completion_ids and completion_ids[-1] in self.eos_token_ids:
            completion_ids = completion_ids[:-1]
        return cut_at_stop(self.decode(completion_ids), stop)


def _text_content(content: Any) -> Any:
    """Flatten OpenAI content parts ([{"type": "text", "text": ...}, ...]) into plain text."""
    if isinstance(content, list):
        return "".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return content


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=-1)
    return text if cut < 0 else text[:cut]


_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Split Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks out of a reply.

    Blocks that are not valid JSON with a name stay in the text: the model's mistake is the agent's to see.
    """
    calls: list[ToolCall] = []

    def take(match: re.Match[str]) -> str:
        try:
            body = json.loads(match.group(1))
            name = body["name"]
        except (ValueError, KeyError, TypeError):
            return match.group(0)
        arguments = body.get("arguments", {})
        calls.append(
            ToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}",
                function=FunctionCall(
                    name=str(name), arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)
                ),
            )
        )
        return ""

    rest = _TOOL_CALL.sub(take, text).strip()
    return (rest or None) if calls else text, calls


class StreamDecoder:
    """Turns a growing list of generated ids into safe text deltas for SSE.

    Holds back a possibly incomplete UTF-8 character (decoded as U+FFFD) and the tail that could still become a
    stop string, so the streamed text always equals the final non-streamed reply.
    """

    def __init__(self, formatter: ChatFormatter, stop: tuple[str, ...]):
        self.formatter = formatter
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.formatter.reply_text(self.ids, ())
        if self.stop and cut_at_stop(text, self.stop) != text:
            return ""  # the stop string has appeared; finish() emits the text before it
        safe = len(text) - self.holdback
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        delta, self.sent = text[self.sent : max(safe, self.sent)], max(safe, self.sent)
        return delta

    def finish(self) -> str:
        text = self.formatter.reply_text(self.ids, self.stop)
        delta = text[self.sent :]
        self.sent = len(text)
        return delta
