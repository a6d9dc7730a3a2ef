"""Malformed bodies on the translated APIs and completions get a 400 naming the field (issue 42): `logprobs: 1` on
`/v1/completions`, Responses content parts whose `text` is not a string, call outputs holding integers, arrays nested
50,000 and 200,000 deep; and the two bodies that once stalled the server keep /health under 0.5 s."""

from __future__ import annotations

import json

import httpx
import pytest

from marl.protocol import ErrorCode
from tests.servers.test_untrusted_input import begin, can_continue, refused, slowest_health_while

pytestmark = pytest.mark.serial


def post(lease: dict, route: str, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(lease["base_url"] + route, content=content.encode(), timeout=120, headers={
        "Authorization": f"Bearer {lease['api_key']}", "x-api-key": lease["api_key"],
        "Content-Type": "application/json"})


@pytest.mark.parametrize(("field", "value", "says"), [
    ("logprobs", 1, "top alternatives are not returned"), ("logprobs", 5, "logprobs 0"),
    ("n", 2, "only n=1"), ("echo", True, "not echoed")])
def test_completions_options_it_does_not_offer_are_a_400_saying_what_it_does(rolling, field, value, says):
    _, http = rolling
    lease = begin(http)
    answer = post(lease, "/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, field: value})
    error = refused(answer, 400, ErrorCode.UNSUPPORTED_VALUE)
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert says in error["message"] and f"{field}=" in error["message"] and "Input should" not in error["message"]
    served = post(lease, "/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "logprobs": 0})
    assert served.status_code == 200 and len(served.json()["choices"][0]["logprobs"]["token_logprobs"]) >= 1
    assert can_continue(http, lease["episode_id"])


def message(parts: list) -> dict:
    return {"model": "tiny", "max_output_tokens": 2, "input": [{"type": "message", "role": "user", "content": parts}]}


def call_output(output: list) -> dict:
    return {"model": "tiny", "max_output_tokens": 2, "input": [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": output}]}


@pytest.mark.parametrize(("body", "param"), [
    (message([{"type": "input_text", "text": 5}]), "input.items.0.content.parts.0.text"),
    (message([{"type": "input_text", "text": "a"}, {"type": "input_text", "text": {"x": 1}}]),
     "input.items.0.content.parts.1.text"),
    (call_output([{"type": "input_text", "text": 7}]), "input.items.1.output.parts.0.text"),
    (call_output([7]), "input.items.1.output.parts.0"),
    ({"model": "tiny", "input": "hi", "tools": [{"type": "function", "name": 3}]}, "tools.0.name"),
], ids=["text-int", "text-object", "output-part-text-int", "output-part-int", "tool-name-int"])
def test_responses_values_that_are_not_strings_are_a_400_naming_the_field(rolling, body, param):
    _, http = rolling
    lease = begin(http)
    error = refused(post(lease, "/responses", body), 400, ErrorCode.INVALID_REQUEST)
    assert error["param"] == param and param in error["message"]
    assert can_continue(http, lease["episode_id"])


def test_messages_blocks_that_are_not_strings_name_the_block(rolling):
    _, http = rolling
    lease = begin(http)
    answer = post(lease, "/messages", {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": [{"type": "text",
                                                                                               "text": 5}]}]}]})
    assert answer.status_code == 400 and answer.json()["type"] == "error"  # Anthropic's shape
    assert "messages.0.content.blocks.0.content.blocks.0.text" in answer.json()["error"]["message"]
    assert ".str" not in answer.json()["error"]["message"]  # one shape checked, not both


@pytest.mark.parametrize("depth", [50_000, 200_000])
def test_responses_arrays_nested_deep_are_refused_naming_the_field(rolling, depth):
    _, http = rolling
    lease = begin(http)
    nested = "[" * depth + "]" * depth
    body = json.dumps(message([{"type": "input_text", "text": "x"}]))[:-1] + f', "metadata": {nested}}}'
    error = refused(post(lease, "/responses", body), 400, ErrorCode.INVALID_REQUEST)
    assert "levels deep" in error["message"] and len(error["message"]) < 300
    assert error["param"] == "metadata"
    assert can_continue(http, lease["episode_id"])


STALLING = {  # the two bodies that held the event loop for seconds before issue 43's guards (issue 42, why 6)
    "responses tool schema of 3e6 integers (5.7 MiB)": lambda: json.dumps({
        "model": "tiny", "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {
            "type": "object", "properties": {"x": {"enum": "__ENUM__"}}}}]}).replace(
        '"__ENUM__"', "[" + "1," * 2_999_999 + "1]"),
    "responses tool_choice of 4e6 integers (7.6 MiB)": lambda: json.dumps({"model": "tiny", "input": "hi"})[:-1]
    + ', "tool_choice": [' + "1," * 3_999_999 + "1]}",
}


@pytest.mark.parametrize("case", list(STALLING))
def test_the_stalling_bodies_keep_health_under_half_a_second(rolling, case):
    srv, http = rolling
    lease = begin(http)
    body = STALLING[case]()
    assert 5.5 * 2**20 < len(body) < 8 * 2**20
    answer, slowest = slowest_health_while(srv, lambda: post(lease, "/responses", body))
    assert answer.status_code == 413 and len(answer.content) < 1000, answer.text[:300]
    assert slowest < 0.5, f"/health took {slowest:.2f}s while {case} was refused"
    assert can_continue(http, lease["episode_id"])
