"""Wire shapes the Responses and Messages APIs share."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Tag

__all__ = ["text_or"]


def text_or(parts: Any, tag: str) -> Any:
    """A string or a list of `parts` (a message's content: text, or parts or blocks). A value that is not a string is
    checked as the list only, so that an error names where in the list it is (`input.items.0.content.parts.1.text`)
    rather than both shapes at once (`content.str: Input should be a valid string` first)."""
    return Annotated[Annotated[str, Tag("text")] | Annotated[parts, Tag(tag)],
                     Discriminator(lambda value: "text" if isinstance(value, str) else tag)]
