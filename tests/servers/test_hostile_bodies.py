"""Hostile bodies on every route (issue 43): JSON nested 100,000 deep is a 4xx (it was a RecursionError 500), bodies
of millions of scalars under the size limit are refused before they are parsed while /health keeps answering
within 0.5 s (the chat route's 450,000-message guarantee, tests/servers/test_untrusted_input.py, on every API), and
an error never repeats a long value."""

from __future__ import annotations

import json

import httpx
import pytest

from marl.protocol import ErrorCode
from servers.http.guards import MAX_BODY_DEPTH, MAX_BODY_VALUES, PROMPT_IDS_FIT
from servers.http.routes import MAX_LISTED_PROBLEMS
from tests.servers.test_untrusted_input import begin, can_continue, refused, slowest_health_while

pytestmark = pytest.mark.serial

HI = [{"role": "user", "content": "hi"}]
DEEP = "[" * 100_000  # unbalanced: the parser would recurse into every one before it saw the end


def call(lease: dict, route: str, body: str) -> httpx.Response:
    """A data-plane call with a raw body; the lease's key as a bearer token and as Anthropic's x-api-key."""
    return httpx.post(lease["base_url"] + route, content=body.encode(), timeout=120, headers={
        "Authorization": f"Bearer {lease['api_key']}", "x-api-key": lease["api_key"],
        "Content-Type": "application/json"})


def with_raw(fields: dict, key: str, raw: str) -> str:
    """`fields` as JSON, with `key` set to `raw` exactly as written (raw JSON, possibly not parseable)."""
    return json.dumps(fields)[:-1] + f', "{key}": {raw}}}'


@pytest.mark.parametrize("raw", [DEEP, DEEP + "]" * 100_000, "[" * (MAX_BODY_DEPTH + 1) + "]" * (MAX_BODY_DEPTH + 1)])
def test_deep_json_is_a_400_on_chat_end_and_control(rolling, raw):
    srv, http = rolling
    lease = begin(http)
    chat = call(lease, "/chat/completions", with_raw({"model": "tiny", "messages": HI}, "extra", raw))
    end = http.post(f"/episodes/{lease['episode_id']}/end", headers={"Content-Type": "application/json"},
                    content=with_raw({"client_id": "client-h", "task_id": "t", "reward": 1.0}, "metadata", raw))
    config = http.post("/control/config", content=raw.encode(), headers={"Content-Type": "application/json"})
    for answer in (chat, end, config):  # 100,000 brackets are under the value limit: the depth refuses them
        assert "levels deep" in refused(answer, 400, ErrorCode.INVALID_REQUEST)["message"]
    assert can_continue(http, lease["episode_id"])  # nothing changed
    messages = call(lease, "/messages", with_raw({"model": "tiny", "max_tokens": 2, "messages": HI}, "metadata", raw))
    assert 400 <= messages.status_code < 500 and messages.json()["type"] == "error"  # Anthropic's shape


def test_nesting_up_to_the_limit_is_served(rolling):
    _, http = rolling
    lease = begin(http)
    nested = "[" * (MAX_BODY_DEPTH - 3) + "]" * (MAX_BODY_DEPTH - 3)  # in "metadata" of the body: 3 levels in
    r = call(lease, "/chat/completions", with_raw({"model": "tiny", "messages": HI, "max_tokens": 2}, "extra",
                                                  json.dumps({"x": json.loads(nested)})))
    assert r.status_code == 200, r.text


SCALAR_HEAVY = {  # route, the body (each under the 16 MiB limit, each far over MAX_BODY_VALUES values)
    "chat tool_choice of 4e6 integers": ("/chat/completions", lambda: with_raw(
        {"model": "tiny", "messages": HI}, "tool_choice", "[" + "1," * 3_999_999 + "1]")),
    "Messages metadata of 1e6 keys": ("/messages", lambda: json.dumps(
        {"model": "tiny", "max_tokens": 2, "messages": HI, "metadata": {str(i): 1 for i in range(1_000_000)}})),
    "completions of 7.5e6 token ids": ("/completions", lambda: with_raw(
        {"model": "tiny"}, "prompt", "[" + "1," * 7_499_999 + "1]")),
    "responses of 7.5e6 token ids": ("/responses", lambda: with_raw(
        {"model": "tiny"}, "input", "[" + "1," * 7_499_999 + "1]")),
    "chat of 4e6 short strings": ("/chat/completions", lambda: with_raw(
        {"model": "tiny", "messages": HI}, "stop", "[" + '"a",' * 3_999_999 + '"a"]')),
}


@pytest.mark.parametrize("case", list(SCALAR_HEAVY))
def test_scalar_heavy_bodies_are_refused_while_health_answers(rolling, case):
    srv, http = rolling
    lease = begin(http)
    route, make = SCALAR_HEAVY[case]
    body = make()
    assert len(body) < 16 * 2**20
    answer, slowest = slowest_health_while(srv, lambda: call(lease, route, body))
    assert answer.status_code == 413, answer.text[:300]
    assert len(answer.content) < 1000
    assert slowest < 0.5, f"/health took {slowest:.2f}s while {case} was refused"
    assert can_continue(http, lease["episode_id"])


def test_a_body_at_the_value_limit_that_fails_everywhere_is_refused_while_health_answers(rolling):
    """Just under MAX_BODY_VALUES, every one of them invalid: validated off the loop, its problems counted, not
    listed (listing 262,144 of them took seconds with the GIL held)."""
    srv, http = rolling
    lease = begin(http)
    body = with_raw({"model": "tiny"}, "input", "[" + "1," * (MAX_BODY_VALUES - 10) + "1]")
    answer, slowest = slowest_health_while(srv, lambda: call(lease, "/responses", body))
    assert answer.status_code == 400 and len(answer.content) < 1000, answer.text[:300]
    assert slowest < 0.5, f"/health took {slowest:.2f}s"
    # under 64 KiB, off the loop too; chat's tools (unlike Responses' input) list every problem, up to a cap
    small = with_raw({"model": "tiny", "messages": HI}, "tools", "[" + "1," * 3000 + "1]")
    answer = call(lease, "/chat/completions", small)
    assert answer.status_code == 400 and str(MAX_LISTED_PROBLEMS) in answer.text


def test_a_128k_token_id_prompt_with_the_usual_fields_fits_the_body_limits(rolling):
    """The value limit counts keys too: a 128k-token prompt of ids beside a completions call's usual fields passes
    the gate and reaches the route (which refuses it only for the tiny model's short context); one value more than
    the limit is a 413 at once, with /health answering meanwhile."""
    srv, http = rolling
    lease = begin(http)
    usual = {"model": "tiny", "max_tokens": 8, "temperature": 0.7, "top_p": 0.95, "seed": 3, "stop": ["\n", "END"],
             "logprobs": 0, "n": 1, "stream": False, "user": "player_0", "presence_penalty": 0.0}
    fits = with_raw(usual, "prompt", json.dumps(list(range(PROMPT_IDS_FIT))))
    r = call(lease, "/completions", fits)
    assert r.status_code == 400 and r.json()["error"]["code"] == ErrorCode.CONTEXT_LENGTH_EXCEEDED, r.text[:300]
    over = with_raw(usual, "prompt", json.dumps(list(range(MAX_BODY_VALUES))))
    answer, slowest = slowest_health_while(srv, lambda: call(lease, "/completions", over))
    assert answer.status_code == 413 and answer.json()["error"]["code"] == ErrorCode.REQUEST_TOO_LARGE
    assert slowest < 0.5, f"/health took {slowest:.2f}s"
    assert can_continue(http, lease["episode_id"])


@pytest.mark.parametrize("tool_choice", [list(range(30_000)), {"type": "function", "function": {"name": "x" * 10**6}},
                                         "x" * 10**6])
def test_a_long_invalid_tool_choice_gets_a_short_error(rolling, tool_choice):
    _, http = rolling
    lease = begin(http)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = call(lease, "/chat/completions", json.dumps({"model": "tiny", "messages": HI, "tools": tools,
                                                     "tool_choice": tool_choice}))
    assert 400 <= r.status_code < 500 and len(r.content) < 1024, (r.status_code, len(r.content))


def test_a_long_model_name_gets_a_short_error(rolling):
    _, http = rolling
    lease = begin(http)
    r = call(lease, "/chat/completions", json.dumps({"model": "m" * 10**6, "messages": HI}))
    assert r.status_code == 404 and len(r.content) < 1024
