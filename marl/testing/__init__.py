"""Tools for testing an env (or anything else) against real marl parts, offline and on a CPU.

- `build_tiny_model(dir)`: a randomly initialised Llama of about 0.1M parameters with a real byte-level BPE tokenizer
  and a ChatML chat template, written to `dir` in a second or two, nothing downloaded (`marl.testing.tiny_model`;
  `python -m marl.testing.tiny_model DIR`). A swarm server serves and trains it like any model dir.
- `server_process(model, data_dir)`: `marl serve` on it as a subprocess on a free 127.0.0.1 port, yielding the
  `ServerProcess` (`.url`, `.admin_token`), stopped on the way out (`marl.testing.serving`).
- `marl check-env MODULE:CLASS`: an env played end to end through such a server, with a verdict
  (`marl.testing.check_env`; docs/envs.md, "Try your env in a minute").

Importing it imports neither pytest nor torch (the builder imports torch when called).
"""

from marl.testing.serving import server_process
from marl.testing.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tiny_model, build_tokenizer

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_tiny_model", "build_tokenizer", "server_process"]
