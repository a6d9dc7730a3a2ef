"""A stand-in for vLLM's HTTP server in tests of the calls marl makes to it (sleep mode, weight syncs, the weight-
transfer engine's routes): it answers every POST with 200 (`{}`, or the next of the JSON answers it was given for
the path, the last one repeating), or 500 on the paths it is told to fail, and records (path, query, JSON body). The
`recording` fixture (tests/conftest.py) starts them on free loopback ports and stops them after the test."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit


class RecordingVLLM(ThreadingHTTPServer):
    """Answers every POST with 200 (or 500 on `failing` paths) and records (path, query, JSON body)."""

    def __init__(self, failing: tuple[str, ...] = (), answers: dict[str, list[object]] | None = None):
        self.calls: list[tuple[str, list[tuple[str, str]], dict | None]] = []
        self.failing = failing
        self.answers = {path: list(queue) for path, queue in (answers or {}).items()}
        super().__init__(("127.0.0.1", 0), _Recorder)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def paths(self) -> list[str]:
        return [path + ("?" + "&".join(f"{k}={v}" for k, v in query) if query else "")
                for path, query, _ in self.calls]

    def bodies(self) -> list[dict | None]:
        return [body for _, _, body in self.calls]


class _Recorder(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.calls.append((parts.path, parse_qsl(parts.query), body))
        status = 500 if parts.path in self.server.failing else 200
        queue = self.server.answers.get(parts.path) or [{}]
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "failed"}' if status == 500 else json.dumps(answer).encode())

    def log_message(self, *args) -> None:
        pass
