"""`tool_choice` honoured: which tool call a reply must be, forced the way Anthropic forces it (a prefilled reply).

A request may ask for any tool call (`"required"`) or for one function by name; `"none"` and `"auto"` ask for none
in particular. A required call is made certain without touching the sampler: the prompt ends with the opening of a
tool call as the chat template writes one (and, for a named function or a single tool, the name and the text
before the arguments), so the model can only continue a tool call. That opening is found by rendering a probe
conversation with the model's own template (`ToolCallFormat.probe`); a template that renders no Hermes
`<tool_call>` block gets a 400 saying forcing is not supported, never a silently ignored `tool_choice`.

Under `"required"` with several tools the model writes the name itself, and the engine holds it to the declared
ones (`name_leads`, `SamplingParams.lead`: until the name and the text before the arguments are written, only tokens
that continue a declared name are sampled, a token that finishes one and goes on included: `servers.calls.lead_texts`;
then sampling is free), so it never names a function the request did not declare, as OpenAI's API never does. The
tokens and logprobs recorded are still the engine's (raw logprobs).

The forced text is prompt (recorded as context, mask 0): the model sampled only what follows it. The reply is then
parsed as a tool call whatever the model wrote: a well-formed block as usual, else its name and its arguments text
as they are (OpenAI's own API may return arguments that are not valid JSON; the agent sees the model's mistake).

`ToolTextHoldback` is the streaming half of tool calls: text streams as it comes, and only what may be the start of
a tool call (a `<tool_call>` marker, or a tail that could begin one, and whitespace before it) is held back.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from marl.protocol import ChatCompletionRequest, FunctionCall, ToolCall
from servers.errors import excerpt

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_PROBE_NAME = "marl_probe_tool_name"
_PROBE_ARGUMENTS = '{"marl_probe_argument": 0}'


class ToolChoiceError(ValueError):
    """`tool_choice` is malformed, names no tool of the request, or cannot be forced with this template."""


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "auto", "none", "required" or "function"
    name: str | None = None  # the function a "function" choice names
    names: tuple[str, ...] = ()  # the functions a "required" choice may call: the request's tools

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"


def resolve(request: ChatCompletionRequest) -> ToolChoice:
    """The request's `tool_choice` (chat shape), checked against its tools. Raises `ToolChoiceError`."""
    value, names = request.tool_choice, [_tool_name(t) for t in request.tools or []]
    if value in (None, "auto"):
        return ToolChoice("auto")
    if value == "none":
        return ToolChoice("none")
    if value == "required":
        choice = (ToolChoice("function", names[0]) if len(names) == 1
                  else ToolChoice("required", names=tuple(dict.fromkeys(names))))
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(
            (value.get("function") or {}).get("name"), str):
        choice = ToolChoice("function", value["function"]["name"])
    else:
        raise ToolChoiceError(f"tool_choice {excerpt(value)} is not one of 'auto', 'none', 'required' or"
                              " {'type': 'function', 'function': {'name': ...}}")
    if not names:
        raise ToolChoiceError(f"tool_choice asks for a tool call ({excerpt(value)}) but the request lists no tools")
    if not all(isinstance(name, str) and name for name in names):
        raise ToolChoiceError(f"tool_choice asks for a tool call ({excerpt(value)}) but a tool has no function name")
    if choice.name is not None and choice.name not in names:
        raise ToolChoiceError(f"tool_choice names {excerpt(choice.name)}, which is not one of the request's tools"
                              f" {excerpt(names)}")
    return choice


def _tool_name(tool: dict[str, Any]) -> str | None:
    function = tool.get("function")
    return function.get("name") if isinstance(function, dict) else tool.get("name")


@dataclass(frozen=True)
class ToolCallFormat:
    """How the chat template writes a call: `opening` NAME `middle` ARGUMENTS `closing`."""

    opening: str
    middle: str
    closing: str

    @classmethod
    def probe(cls, render: Callable[[list[dict], list[dict]], str]) -> ToolCallFormat | None:
        """Render a conversation holding one probe call (`render(messages, tools)`, no generation prompt); None
        when the template writes no Hermes block around the name and the arguments as they are."""
        call = {"id": "call_probe", "type": "function",
                "function": {"name": _PROBE_NAME, "arguments": _PROBE_ARGUMENTS}}
        tool = {"type": "function", "function": {"name": _PROBE_NAME, "parameters": {"type": "object"}}}
        try:
            text = render([{"role": "user", "content": "probe"},
                           {"role": "assistant", "content": "", "tool_calls": [call]}], [tool])
        except Exception:  # a template that takes no tool calls in the history: nothing to force
            return None
        name_at = text.rfind(_PROBE_NAME)
        arguments_at = text.find(_PROBE_ARGUMENTS, name_at)
        open_at = text.rfind(TOOL_CALL_OPEN, 0, name_at)
        close_at = text.find(TOOL_CALL_CLOSE, arguments_at)
        if min(name_at, arguments_at, open_at, close_at) < 0:
            return None
        return cls(opening=text[open_at:name_at], middle=text[name_at + len(_PROBE_NAME):arguments_at],
                   closing=text[arguments_at + len(_PROBE_ARGUMENTS):close_at + len(TOOL_CALL_CLOSE)])

    def forced_prefix(self, choice: ToolChoice) -> str:
        """The reply's first characters, written for the model: a call's opening (and the named function's name)."""
        # Without trailing whitespace: the model writes it itself, in the token it would have used (" {" is one
        # token where a prefilled " " would leave a lone "{").
        if choice.mode == "function":
            return (self.opening + choice.name + self.middle).rstrip()
        return self.opening.rstrip() if choice.mode == "required" else ""

    def name_leads(self, choice: ToolChoice) -> list[str]:
        """What a "required" reply may write right after its prefilled opening, one text per declared function: its
        name and the text before the arguments (the engine holds the reply to one of them: `SamplingParams.lead`)."""
        if choice.mode != "required":
            return []
        gap = self.opening[len(self.opening.rstrip()):]  # the opening's whitespace, which forced_prefix leaves out
        return [(gap + name + self.middle).rstrip() for name in choice.names]

    def parse_forced(self, reply: str) -> list[ToolCall]:
        """The call a forced reply (`reply` starts with the forced prefix) makes, whatever the model wrote after."""
        rest = reply[len(self.opening.rstrip()):].removeprefix(self.opening[len(self.opening.rstrip()):])
        name, found, arguments = rest.partition(self.middle)
        if not found:
            name, arguments = name.partition('"')[0], ""
        cut = arguments.find(self.closing)
        arguments = (arguments[:cut] if cut >= 0 else arguments).strip() or "{}"
        return [ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=arguments))]


class ToolTextHoldback:
    """Streams a reply's text that may contain tool calls: everything before the first `<tool_call>`, except a tail
    that may begin one, and the whitespace before it (a parsed reply's text leaves that out)."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0
        self.blocked = False

    def push(self, delta: str) -> str:
        self.text += delta
        if self.blocked:
            return ""
        at = self.text.find(TOOL_CALL_OPEN)
        if at >= 0:
            self.blocked = True
            safe = self.text[:at]
        else:
            safe = self.text[:len(self.text) - _partial_marker(self.text)]
        safe = safe.rstrip()
        out = safe[self.sent:]
        self.sent = max(self.sent, len(safe))
        return out


def _partial_marker(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `<tool_call>`."""
    for n in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
