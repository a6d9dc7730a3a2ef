"""The tiny test models, now `marl.testing.tiny_model` (an installed marl builds them too); the tests import them
from here as they always did. `python tests/tiny_model.py DIR` still writes one to DIR."""

from __future__ import annotations

import sys

from marl.testing.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tiny_model, build_tokenizer

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_tiny_model", "build_tokenizer"]

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/tiny_model.py DIR")
    print(build_tiny_model(sys.argv[1]))
