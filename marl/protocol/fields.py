"""The types every body is made of: strict numbers, ids, policy and frozen names, and the base request models that
refuse text no tokenizer takes and nesting deeper than `MAX_NESTING`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from marl.protocol.routes import MAX_ID_LENGTH

# Numbers on the wire are numbers: no `true` for 1, no "yes" for true, no 1.0 for an int (floats do take ints).
Int = StrictInt
Bool = StrictBool
#: A finite number (raw JSON may say NaN or Infinity; a reward like that would poison a whole GRPO group).
Real = Annotated[float, Field(strict=True, allow_inf_nan=False)]
#: The range of a seed (torch and every other RNG take 64 bits).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH)]
#: A policy's name: it is the lease's `model`, and part of its episode ids and keys (`POLICY_SEPARATOR`).
PolicyName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
#: Between a policy's name and the rest of its episode ids and keys on a server of several policies: the server finds
#: an episode's or a key's policy from it (no policy name holds it).
POLICY_SEPARATOR = "."
#: Between a policy's name and its version in a frozen policy's name (`speaker@3`: policy speaker's adapter at version
#: 3, served unrecorded and never trained): no policy name holds it, so a frozen name never is a policy's.
FROZEN_SEPARATOR = "@"
#: A frozen policy's name: `<policy>@<label>`.
FrozenName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}@[A-Za-z0-9_-]{1,64}$")]
#: Every key of a server's frozen policies starts with this (one key per server, handed out by the load route).
FROZEN_KEY_PREFIX = "marl-frozen-"


def frozen_name(policy: str, version: int) -> str:
    """The frozen policy of `policy` at policy version `version`: `speaker@3`."""
    return f"{policy}{FROZEN_SEPARATOR}{version}"


#: Deepest nesting of lists and objects a request may have (deeper JSON would exhaust the recursion of whoever
#: serializes it next: the ledger's json.dumps, a template).
MAX_NESTING = 64


def check_text_and_nesting(value: Any) -> None:
    """Raise ValueError if a string anywhere in `value` is not encodable text (JSON's "\\udfff" escape decodes to a
    lone surrogate, which no tokenizer or database takes), or if it nests deeper than MAX_NESTING."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise ValueError(f"{where or 'a string'} is not valid Unicode text (a lone surrogate at"
                                     f" character {exc.start}); send UTF-8 text") from None
            continue
        if depth > MAX_NESTING:
            raise ValueError(f"{where or 'the body'} nests lists and objects deeper than {MAX_NESTING} levels")
        if isinstance(item, dict):
            for key, inner in item.items():
                path = f"{where}.{key}" if where else str(key)
                stack += [(key, f"a key of {where or 'the body'}", depth + 1), (inner, path, depth + 1)]
        elif isinstance(item, (list, tuple)):
            stack += [(inner, f"{where}.{i}" if where else str(i), depth + 1) for i, inner in enumerate(item)]


class _Request(BaseModel):
    """Every request body: its text must be encodable (checked before anything is stored or tokenized)."""

    @model_validator(mode="before")
    @classmethod
    def _encodable_text(cls, data: Any) -> Any:
        check_text_and_nesting(data)
        return data


class _Strict(_Request):
    """Requests reject unknown fields: a typo in a config key must fail loudly, not be ignored."""

    model_config = ConfigDict(extra="forbid")
