"""Every error code a swarm server sends is an `ErrorCode` member: in the source (no code written as a string) and
on the wire (refusals provoked over real HTTP, FastAPI's own 404/405/400 included)."""

from __future__ import annotations

import ast
from pathlib import Path

import httpx
import pytest
from conftest import admin_http, start_rolling, wait_state

from marl.protocol import ErrorCode, ErrorType
from servers.errors import Refusal

SERVERS = Path(__file__).resolve().parents[2] / "servers"
CODE_VALUES = {code.value for code in ErrorCode}


def _sources() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), filename=str(path))) for path in sorted(SERVERS.rglob("*.py"))]


def test_no_error_code_is_written_as_a_string_in_servers():
    found = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            where = f"{path.relative_to(SERVERS.parent)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in CODE_VALUES:
                found.append(f"{where}: the string {node.value!r} (use ErrorCode)")
            if isinstance(node, ast.keyword) and node.arg == "code" and isinstance(node.value, ast.Constant):
                found.append(f"{where}: code={node.value.value!r} (use ErrorCode)")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Refusal" and len(node.args) >= 2:
                code = node.args[1]  # ErrorCode.X, or a variable (Refusal checks its type when built)
                if not (isinstance(code, ast.Name) or (isinstance(code, ast.Attribute)
                                                       and getattr(code.value, "id", None) == "ErrorCode")):
                    found.append(f"{where}: a Refusal whose code is not ErrorCode.<member>")
    assert not found, "\n".join(found)


def test_every_error_code_named_in_servers_exists():
    named = {(path.name, node.attr) for path, tree in _sources() for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "ErrorCode"}
    assert len(named) >= 10  # the scan sees the refusals
    missing = sorted(f"{file}: ErrorCode.{attr}" for file, attr in named if attr not in ErrorCode.__members__)
    assert not missing, missing


def test_a_refusal_takes_only_an_error_code():
    with pytest.raises(TypeError, match="ErrorCode"):
        Refusal(400, "invalid_request", "a code written as a string")
    assert Refusal(403, ErrorCode.NOT_LEASE_HOLDER, "not yours").info().type == ErrorType.PERMISSION.value


def _refusal(response: httpx.Response, status: int, code: ErrorCode) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert ErrorCode(error["code"]) is code, error  # parses as an ErrorCode, and the expected one
    ErrorType(error["type"])
    return error


def test_refusals_over_http_carry_error_codes(local_server):
    with local_server() as srv, admin_http(srv.url) as http:
        anonymous = httpx.Client(base_url=srv.url)
        _refusal(anonymous.get("/control/status"), 401, ErrorCode.UNAUTHORIZED)
        _refusal(anonymous.get("/nowhere"), 404, ErrorCode.ROUTE_NOT_FOUND)
        _refusal(anonymous.get("/control/start"), 405, ErrorCode.METHOD_NOT_ALLOWED)
        _refusal(http.post("/control/config", json={"batch_size": "many"}), 400, ErrorCode.INVALID_REQUEST)
        _refusal(http.post("/episodes/begin", json={"client_id": "a"}), 409, ErrorCode.ENGINE_NOT_ROLLING)
        start_rolling(http, batch_size=100, max_leases=1, lease_patience_s=60)
        _refusal(http.post("/control/start"), 409, ErrorCode.ENGINE_NOT_OFFLINE)
        _refusal(http.post("/control/config", json={"batch_size": 7}), 409, ErrorCode.ENGINE_NOT_OFFLINE)

        lease = http.post("/episodes/begin", json={"client_id": "a"}).json()
        busy = http.post("/episodes/begin", json={"client_id": "b"})
        assert busy.headers["Retry-After"] == "0.5"
        assert _refusal(busy, 503, ErrorCode.NO_FREE_SLOT)["retry_after_s"] == 0.5
        as_agent = {"Authorization": f"Bearer {lease['api_key']}"}
        error = _refusal(anonymous.get("/control/status", headers=as_agent), 401, ErrorCode.UNAUTHORIZED)
        assert error["type"] == ErrorType.AUTHENTICATION.value
        error = _refusal(http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "b"}), 403,
                         ErrorCode.NOT_LEASE_HOLDER)
        assert error["type"] == ErrorType.PERMISSION.value
        _refusal(http.post("/episodes/nope/renew", json={"client_id": "a"}), 404, ErrorCode.EPISODE_NOT_FOUND)

        chat = httpx.Client(base_url=lease["base_url"], headers=as_agent, timeout=60)
        ok = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        _refusal(chat.post("/chat/completions", json={**ok, "model": "gpt-9"}), 404, ErrorCode.MODEL_NOT_FOUND)
        _refusal(chat.post("/chat/completions", json={**ok, "max_tokens": 10**6}), 400,
                 ErrorCode.CONTEXT_LENGTH_EXCEEDED)
        _refusal(chat.post("/chat/completions", json={**ok, "n": 2}), 400, ErrorCode.INVALID_REQUEST)
        assert http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "a"}).status_code == 200
        error = _refusal(chat.post("/chat/completions", json=ok), 401, ErrorCode.INVALID_API_KEY)  # a dead key
        assert "aborted" in error["message"]
        _refusal(anonymous.post("/v1/chat/completions", json=ok), 401, ErrorCode.INVALID_API_KEY)  # no key


def test_a_static_server_refuses_training_routes_with_its_code(local_server):
    with local_server(static=True) as srv, admin_http(srv.url) as http:
        wait_state(http, "STATIC")
        for method, route in [("POST", "/control/config"), ("POST", "/control/start"), ("POST", "/control/stop"),
                              ("GET", "/control/pool"), ("POST", "/episodes/begin"), ("GET", "/episodes/e1"),
                              ("POST", "/episodes/e1/end"), ("POST", "/episodes/e1/abort"),
                              ("POST", "/episodes/e1/renew")]:
            error = _refusal(http.request(method, route, json={"client_id": "a"}), 409, ErrorCode.STATIC_SERVER)
            assert error["state"] == "STATIC", route
        assert http.get("/control/status").json()["static"] is True  # status and monitor stay open
        assert http.get("/control/monitor").json()["pool"] is None
        _refusal(httpx.get(srv.url + "/control/status"), 401, ErrorCode.UNAUTHORIZED)
