"""Tools for testing an env (or anything else) against real marl parts, offline and on a CPU.

- `build_tiny_model(dir)`: a randomly initialised Llama of about 0.1M parameters with a real byte-level BPE tokenizer
  and a ChatML chat template, written to `dir` in a second or two, nothing downloaded (`marl.testing.tiny_model`;
  `python -m marl.testing.tiny_model DIR`). A swarm server serves and trains it like any model dir.
- `server_process(model, data_dir)`: `marl serve` on it as a subprocess on a free 127.0.0.1 port, yielding the
  `ServerProcess` (`.url`, `.admin_token`), stopped on the way out (`marl.testing.serving`).
- `marl check-env MODULE:CLASS`: an env played end to end through such a server, with a verdict
  (`marl.testing.check_env`; docs/envs.md, "Try your env in a minute").

Importing it imports neither pytest nor torch (the builder imports torch when called); its names load on first use,
so `python -m marl.testing.tiny_model` runs the module once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"CHAT_TEMPLATE": "marl.testing.tiny_model", "SPECIAL_TOKENS": "marl.testing.tiny_model",
            "build_tiny_model": "marl.testing.tiny_model", "build_tokenizer": "marl.testing.tiny_model",
            "server_process": "marl.testing.serving"}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from marl.testing.serving import server_process  # noqa: F401
    from marl.testing.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tiny_model, build_tokenizer  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'marl.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: the next lookup skips __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
