"""The tokens that finish a lead and go on: a forced tool call's `SamplingParams.lead` as the model may spell it.

A lead is token ids (each declared name and the text before its arguments, tokenized alone), but a model writes
the call in the tokens it learned from whole calls, and a vocabulary holds tokens that cross the lead's end: `": {"`
where the lead ends in `":`, or one token for a name and all that follows it. Masked, such a token forces the model
into a split it never writes, and the call comes back broken. So a lead is widened once per set of sequences
(`LeadVocabulary.crossing`): wherever a sequence's first k ids have been written, a token whose text starts with the
text of the rest of the sequence is allowed too, as the sequence's first k ids and that token. Such a sequence is
complete once written, so the constraint lifts after it, as after any sequence.

The engines' masking (`servers/engines/lead_tokens.py`, the torch sampler's and vLLM's logits processors alike) reads
the widened lead as any other, so the rule lives here only. A token's text is what it adds to the text before it
(decoded after a plain anchor token, so a SentencePiece word's leading space stays); special and added tokens
(control tokens, markers) are never candidates. Timed on this project's CPU: the index of a 49k vocabulary (SmolLM2)
builds in 0.1 s, of a 152k one (Qwen) in 0.5 s, once per server, at its first forced call with several tools; a
lead set's widening then takes under a millisecond (ten tools) and is cached.
"""

from __future__ import annotations

import bisect
from typing import Any

Lead = tuple[tuple[int, ...], ...]

#: Lead sets whose widening is kept (a run's agents send a handful of tool sets).
_CACHED_LEADS = 256


class LeadVocabulary:
    """A tokenizer's ordinary tokens by their text, sorted: the tokens whose text starts with a given string."""

    def __init__(self, tokenizer: Any) -> None:
        backend = tokenizer.backend_tokenizer
        skipped = set(tokenizer.added_tokens_decoder)  # special and added tokens: control tokens and markers
        ids = [i for i in range(backend.get_vocab_size(with_added_tokens=False)) if i not in skipped]
        anchor = backend.encode("a", add_special_tokens=False).ids[:1]
        before = backend.decode(anchor, skip_special_tokens=False)
        decoded = backend.decode_batch([anchor + [i] for i in ids], skip_special_tokens=False)
        self._texts: list[str | None] = [None] * backend.get_vocab_size(with_added_tokens=True)
        for i, text in zip(ids, decoded):
            if text.startswith(before) and len(text) > len(before):
                self._texts[i] = text[len(before):]
        entries = sorted((text, i) for i, text in enumerate(self._texts) if text is not None)
        self._sorted_texts = [text for text, _ in entries]
        self._sorted_ids = [i for _, i in entries]
        self._crossed: dict[Lead, Lead] = {}

    def text(self, token_id: int) -> str | None:
        """What the token adds to the text before it; None for a special or added token."""
        return self._texts[token_id] if 0 <= token_id < len(self._texts) else None

    def starting_with(self, prefix: str) -> list[int]:
        """The ordinary tokens whose text starts with `prefix` (a non-empty string)."""
        at = bisect.bisect_left(self._sorted_texts, prefix)
        end = at
        while end < len(self._sorted_texts) and self._sorted_texts[end].startswith(prefix):
            end += 1
        return self._sorted_ids[at:end]

    def crossing(self, lead: Lead) -> Lead:
        """`lead`'s sequences, then for each one and each of its positions k, the sequence's first k ids and each
        token (other than its own k-th) whose text starts with the text of its ids from k on. Cached per lead."""
        if (widened := self._crossed.get(lead)) is None:
            widened = tuple(dict.fromkeys(lead + tuple(seq for each in lead for seq in self._crossing_one(each))))
            if len(self._crossed) >= _CACHED_LEADS:
                self._crossed.clear()
            self._crossed[lead] = widened
        return widened

    def _crossing_one(self, seq: tuple[int, ...]) -> list[tuple[int, ...]]:
        rest = ""
        found = []
        for k in range(len(seq) - 1, -1, -1):
            text = self.text(seq[k])
            if text is None or "\ufffd" in text:  # a piece of a character: the rest's text is not its bytes
                break
            rest = text + rest
            found += [seq[:k] + (token,) for token in self.starting_with(rest) if token != seq[k]]
        return found
