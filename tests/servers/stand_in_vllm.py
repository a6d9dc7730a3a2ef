"""A stand-in for a vLLM subprocess, for tests of the vLLM engine's replicas, routing and weight-sync gate without
vLLM: `stand_in_python(dir)` writes an interpreter the engine starts (`VLLMEngine(python=...)`) in place of vLLM's,
which runs this file with vLLM's command line (only `--port` is read).

It answers `GET /health`, `/v1/completions` (two token ids, streamed or whole; the usage reports no cached tokens)
and every other POST with 200, and records (path, query, JSON body), which `GET /calls` returns. As vLLM 0.33 does
(read in its wheel: `v1/engine/core.py` `_reject_add_while_paused`, `entrypoints/serve/exception_handling/
error_response.py`), a `/pause` makes it refuse new completions until `/resume`: a whole one with 503 and
`PAUSED_BODY`, a streamed one with HTTP 200, then `PAUSED_BODY` as an SSE event and `[DONE]`. A
`/collective_rpc` (the weight reload) waits, while `/hold_reloads` is on, until `/release_reloads`.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

PAUSED_BODY = {"error": {"message": "Generation is paused. Please retry after it resumes.",
                         "type": "ServiceUnavailableError", "param": None, "code": 503}}
CONTROL = ("/hold_reloads", "/release_reloads")


def stand_in_python(directory: Path) -> Path:
    """An executable that runs this stand-in with the arguments vLLM's python would get."""
    path = directory / "stand-in-python"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} \"$@\"\n")
    path.chmod(0o755)
    return path


class StandIn(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int) -> None:
        self.calls: list[tuple[str, list[tuple[str, str]], dict | None]] = []
        self.paused = False
        self.reloads = threading.Event()  # cleared: a reload waits
        self.reloads.set()
        super().__init__(("127.0.0.1", port), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: StandIn

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        if self.path == "/calls":
            return self._json(200, self.server.calls)
        return self._json(200, {})

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        if parts.path not in CONTROL:
            self.server.calls.append((parts.path, parse_qsl(parts.query), body))
        if parts.path == "/hold_reloads":
            self.server.reloads.clear()
        elif parts.path == "/release_reloads":
            self.server.reloads.set()
        elif parts.path == "/pause":
            self.server.paused = True
        elif parts.path == "/resume":
            self.server.paused = False
        elif parts.path == "/collective_rpc":
            self.server.reloads.wait(60)
        elif parts.path == "/v1/completions":
            return self._completion(body or {})
        return self._json(200, {})

    def _completion(self, body: dict) -> None:
        if self.server.paused and body.get("stream"):
            return self._send(200, f"data: {json.dumps(PAUSED_BODY)}\n\ndata: [DONE]\n\n".encode(), "text/event-stream")
        if self.server.paused:
            return self._json(503, PAUSED_BODY)
        choice = {"index": 0, "text": "", "token_ids": [5, 6], "logprobs": {"token_logprobs": [-1.0, -2.0]},
                  "finish_reason": "length"}
        usage = {"prompt_tokens": len(body.get("prompt") or []), "completion_tokens": 2,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        if not body.get("stream"):
            return self._json(200, {"choices": [choice], "usage": usage})
        events = [{"choices": [choice]}, {"choices": [], "usage": usage}]
        data = "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"
        self._send(200, data.encode(), "text/event-stream")

    def _json(self, status: int, payload: object) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _send(self, status: int, data: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


if __name__ == "__main__":
    StandIn(int(sys.argv[sys.argv.index("--port") + 1])).serve_forever()
