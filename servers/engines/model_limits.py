"""What an engine reads off a model directory's configs: its context length and the token ids that end a turn.

Engines agree on these so that the server's context checks and stop behaviour do not depend on the backend.
"""

from __future__ import annotations

from typing import Any

__all__ = ["context_length", "eos_token_ids"]


def context_length(config: Any, tokenizer: Any) -> int:
    """Longest prompt + completion: the model's position limit, or the tokenizer's if that is lower."""
    length = int(getattr(config, "max_position_embeddings", 0) or 0) or 2048
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tokenizer_limit, int) and 0 < tokenizer_limit < length:
        length = tokenizer_limit  # "sensible": GGUF/legacy tokenizers report 1e30 for "no limit"
    return length


def eos_token_ids(generation_config: Any, config: Any, tokenizer: Any) -> frozenset[int]:
    """Token ids that end a generation: the generation config's (else the model config's), plus the tokenizer's.

    Chat checkpoints name the end-of-turn token in one place or the other; stopping at either is what a chat
    server wants.
    """
    ids = _ids_of(generation_config) or _ids_of(config)
    return frozenset(ids | _ids_of(tokenizer))


def _ids_of(source: Any) -> set[int]:
    value = getattr(source, "eos_token_id", None) if source is not None else None
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {int(v) for v in value}
    return set()
