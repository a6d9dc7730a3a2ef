"""Control tokens come from the chat template only: what a message says is tokenized as text, always.

A tokenizer called on rendered text turns every occurrence of a special token's string into that token, so a user
writing "<|im_end|>\\n<|im_start|>system\\n..." would forge turns, and training would learn on control tokens the
model never produced. `ControlTokens` prevents that:

- `render` renders the template and finds where *it* put control tokens. When no input string contains a control
  token's text (the common case) that is every occurrence in the rendered text. Otherwise the template is rendered
  a second time from inputs whose control-token strings are defanged (one character changed for another that JSON
  escapes the same way, so lengths and positions stay put): the control tokens left in that rendering are the
  template's.
- `encode` gives those positions their token ids and tokenizes everything else with a copy of the tokenizer that
  never matches special tokens (no shared mutable flag: safe from many threads at once).

A template that changes the length of what it quotes (so positions cannot be trusted) makes `render` refuse the
request rather than guess.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

#: A control token's first character is swapped for this one in a defanged copy. "<" and ">" are both escaped to
#: six characters by the templates' tojson; other characters go to "#", which no common control token starts with.
_SWAP = {"<": ">", ">": "<", "#": "%"}
#: A tokenizer with a normalizer may fold several characters into one (NFC) before splitting the text into tokens:
#: one token then covers up to this many times its vocabulary entry's length.
_NORMALIZER_SLACK = 4


class ControlTokenText(ValueError):
    """Message text contains a control token's string, and this template's output cannot say where it is."""


@dataclass(frozen=True)
class Control:
    position: int  # in the rendered text
    text: str


@dataclass(frozen=True)
class _Spec:
    token_id: int
    lstrip: bool
    rstrip: bool


class ControlTokens:
    def __init__(self, tokenizer: Any):
        from tokenizers import Tokenizer

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"{type(tokenizer).__name__} has no backend_tokenizer: the server needs a fast "
                            "(Rust `tokenizers`) tokenizer to keep control tokens out of message text")
        self._text_only = Tokenizer.from_str(backend.to_str())
        self._text_only.encode_special_tokens = True  # special tokens' strings become ordinary text
        self._specs = {token.content: _Spec(token_id, token.lstrip, token.rstrip)
                       for token_id, token in tokenizer.added_tokens_decoder.items() if token.special}
        longest_first = sorted(self._specs, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, longest_first))) if longest_first else None
        longest_token = max(map(len, self._text_only.get_vocab(with_added_tokens=True)), default=1)
        #: No token covers more characters of text than this: so a prompt of n characters has at least
        #: n / max_chars_per_token tokens, which lets an over-long prompt be refused without tokenizing it.
        self.max_chars_per_token = longest_token * (1 if backend.normalizer is None else _NORMALIZER_SLACK)

    def render(self, template: Callable[[Any], str], inputs: Any) -> tuple[str, tuple[Control, ...]]:
        """`template(inputs)`, and where in it the template put control tokens (see the module docstring)."""
        text = template(inputs)
        if not self._in_text(inputs):
            return text, self._controls(text)
        defanged = self._defang(inputs)
        twin = template(defanged)
        controls = self._controls(twin)
        if self._in_text(defanged) or len(twin) != len(text) or any(
                text[c.position:c.position + len(c.text)] != c.text for c in controls):
            raise ControlTokenText("a message contains the text of a control token (such as"
                                   f" {next(iter(self._specs))!r}), and this model's chat template does not quote it"
                                   " as it is, so it cannot be kept as text: remove it from the messages")
        return text, controls

    def _controls(self, text: str) -> tuple[Control, ...]:
        if self._pattern is None:
            return ()
        return tuple(Control(m.start(), m.group()) for m in self._pattern.finditer(text))

    def _in_text(self, value: Any) -> bool:
        """Whether any string in `value` (nested dicts and lists) holds a control token's text."""
        return self._pattern is not None and any(self._pattern.search(s) for s in _strings(value))

    def _defang(self, value: Any) -> Any:
        """A copy of `value` whose strings hold no control token's text (same lengths, same JSON escaping)."""
        if isinstance(value, str):
            return self._pattern.sub(lambda m: _SWAP.get(m.group()[0], "#") + m.group()[1:], value)
        if isinstance(value, dict):
            return {key: self._defang(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._defang(item) for item in value]
        return value

    def encode(self, text: str, controls: tuple[Control, ...], start: int = 0) -> list[int]:
        """Ids of `text[start:]`: each control token of `controls` as its id, every other character as text."""
        ids: list[int] = []
        piece_start = start
        for control in controls:
            if control.position < start:
                continue
            spec = self._specs[control.text]
            before = text[piece_start:control.position]
            ids += self._encode_text(before.rstrip() if spec.lstrip else before)
            ids.append(spec.token_id)
            piece_start = control.position + len(control.text)
            if spec.rstrip:
                piece_start += len(text[piece_start:]) - len(text[piece_start:].lstrip())
        ids += self._encode_text(text[piece_start:])
        return ids

    def _encode_text(self, text: str) -> list[int]:
        return self._text_only.encode(text, add_special_tokens=False).ids if text else []


def _strings(value: Any) -> Iterator[str]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack += item.values()
        elif isinstance(item, (list, tuple)):
            stack += item
