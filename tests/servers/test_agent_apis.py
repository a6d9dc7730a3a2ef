"""The data plane's other APIs on a lease, with unmodified clients: the anthropic SDK (`/v1/messages`), the OpenAI
Agents SDK's default Responses model (`/v1/responses`), token-in/token-out `/v1/completions`; `tool_choice` honoured
or refused; streaming with tools that streams text as it comes.

Every reply must be recorded exactly (the tokens trained on decode to what the client was told, its usage counts
them), and a conversation that sends its history back must merge into one sample. The tool-calling tests run a tiny
model trained to always answer with a tool call (`tests/tool_model.py`), so their turns are real tool calls.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest
from conftest import LocalServer, admin_http, start_rolling
from tool_model import TOOL_ARGUMENTS, TOOL_NAME, TOOL_REPLY, WEATHER_TOOL, agents_weather_tool, tool_model_dir

from servers.calls.tool_choice import ToolCallFormat, ToolTextHoldback
from servers.episodes.ledger import Ledger

# The first test of a run builds the tool-calling model (tests/tool_model.py: about 25 s alone on 2 cores, more on a
# busy machine; shared by the test processes) inside its fixture, which counts against the test's timeout.
pytestmark = pytest.mark.timeout(900)

CLIENT = "client-a"
#: The anthropic SDK has no temperature parameter any more; the API still takes one, sent as an extra field.
GREEDY = {"temperature": 0}
ANTHROPIC_WEATHER = {"name": TOOL_NAME, "description": "The weather in a city.",
                     "input_schema": WEATHER_TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """A ROLLING server on the tool-calling model; its batch never fills."""
    model = tool_model_dir(tmp_path_factory)
    with LocalServer(model, tmp_path_factory.mktemp("tool-server")) as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=1000, num_repeat=4, lease_patience_s=120)
        yield srv, http


@pytest.fixture(scope="module")
def tiny_server(tiny_model, tmp_path_factory):
    """A ROLLING server on the tiny random model (replies are arbitrary text)."""
    with LocalServer(tiny_model, tmp_path_factory.mktemp("tiny-server")) as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=1000, num_repeat=4, lease_patience_s=120)
        yield srv, http


def begin(http: httpx.Client) -> dict:
    r = http.post("/episodes/begin", json={"client_id": CLIENT})
    assert r.status_code == 200, r.text
    return r.json()


def end(srv: LocalServer, http: httpx.Client, lease: dict) -> list:
    r = http.post(f"/episodes/{lease['episode_id']}/end", json={"client_id": CLIENT, "task_id": "t", "reward": 1.0})
    assert r.status_code == 200, r.text
    ledger = Ledger(srv.data_dir / "ledger.sqlite")
    try:
        return ledger.samples_of(lease["episode_id"])
    finally:
        ledger.close()


def generated_spans(sample) -> list[list[int]]:
    """The sample's generated runs of tokens (loss mask 1), one per call merged into it."""
    spans, inside = [], False
    for token, mask in zip(sample.token_ids, sample.loss_mask):
        if mask and not inside:
            spans.append([])
        if mask:
            spans[-1].append(token)
        inside = bool(mask)
    return spans


def told(srv: LocalServer, ids: list[int]) -> str:
    """What a client is told for generated `ids`: their text without the closing end-of-turn token."""
    return srv.server.chat.model.formatter.reply_text(ids, ())


def anthropic_client(lease: dict) -> anthropic.Anthropic:
    # The anthropic SDK appends /v1/messages to its base URL: the lease's, without its /v1.
    return anthropic.Anthropic(base_url=lease["base_url"].removesuffix("/v1"), api_key=lease["api_key"],
                               max_retries=0)


# --- Anthropic Messages --------------------------------------------------------------------------------------------


def test_anthropic_sdk_plain_streamed_and_a_tool_round_trip_recorded_exactly_and_merged(tool_server):
    srv, http = tool_server
    lease = begin(http)
    client = anthropic_client(lease)
    hello = [{"role": "user", "content": "hello"}]
    plain = client.messages.create(model="tiny", max_tokens=48, extra_body=GREEDY, messages=hello, system="Be brief.")
    assert plain.content[0].type == "text" and plain.stop_reason == "end_turn"
    with client.messages.stream(model="tiny", max_tokens=48, extra_body=GREEDY, messages=hello) as stream:
        deltas = list(stream.text_stream)
        streamed = stream.get_final_message()
    assert len(deltas) > 1 and "".join(deltas) == streamed.content[0].text == TOOL_REPLY  # no tools: it is text

    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model="tiny", max_tokens=48, extra_body=GREEDY, messages=asked,
                                   tools=[ANTHROPIC_WEATHER])
    (use,) = first.content
    assert (first.stop_reason, use.type, use.name, use.input) == ("tool_use", "tool_use", TOOL_NAME, TOOL_ARGUMENTS)
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21C"}]}
    second = client.messages.create(model="tiny", max_tokens=48, extra_body=GREEDY, tools=[ANTHROPIC_WEATHER],
                                    messages=[*asked, {"role": "assistant", "content": first.content}, result])
    assert second.stop_reason == "tool_use"

    samples = end(srv, http, lease)
    assert sorted(s.num_calls for s in samples) == [1, 1, 2]  # the round trip is one sample
    (round_trip,) = [s for s in samples if s.num_calls == 2]
    spans = generated_spans(round_trip)
    assert [told(srv, span) for span in spans] == [TOOL_REPLY, TOOL_REPLY]  # what the SDK parsed, token for token
    assert [len(span) for span in spans] == [first.usage.output_tokens, second.usage.output_tokens]
    assert {told(srv, generated_spans(s)[0]) for s in samples if s.num_calls == 1} == {plain.content[0].text}


def test_anthropic_tool_choice_and_errors_in_anthropics_shape(tiny_server):
    srv, http = tiny_server
    lease = begin(http)
    client = anthropic_client(lease)
    asked = [{"role": "user", "content": "weather?"}]
    forced = client.messages.create(model="tiny", max_tokens=24, messages=asked, tools=[ANTHROPIC_WEATHER],
                                    tool_choice={"type": "tool", "name": TOOL_NAME})
    assert forced.stop_reason == "tool_use" and [b.name for b in forced.content] == [TOOL_NAME]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="tiny", max_tokens=8, messages=asked, tools=[ANTHROPIC_WEATHER],
                               tool_choice={"type": "tool", "name": "no_such_tool"})
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        anthropic_client({**lease, "api_key": "marl-ep-dead"}).messages.create(model="tiny", max_tokens=8,
                                                                               messages=asked)
    assert unauthorized.value.body["error"] == {"type": "authentication_error", "code": "invalid_api_key",
                                                "message": unauthorized.value.body["error"]["message"]}
    r = httpx.post(lease["base_url"] + "/messages", headers={"x-api-key": lease["api_key"]},
                   json={"model": "tiny", "messages": asked})  # no max_tokens
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    end(srv, http, lease)


def test_tool_choice_none_returns_the_reply_as_text(tool_server):
    srv, http = tool_server
    lease = begin(http)
    chat = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"], max_retries=0)
    asked = [{"role": "user", "content": "weather?"}]
    reply = chat.chat.completions.create(model="tiny", messages=asked, tools=[WEATHER_TOOL], tool_choice="none",
                                         max_tokens=48, temperature=0).choices[0]
    assert (reply.message.tool_calls, reply.message.content, reply.finish_reason) == (None, TOOL_REPLY, "stop")
    message = anthropic_client(lease).messages.create(model="tiny", max_tokens=48, extra_body=GREEDY, messages=asked,
                                                      tools=[ANTHROPIC_WEATHER], tool_choice={"type": "none"})
    assert [(b.type, b.text) for b in message.content] == [("text", TOOL_REPLY)]
    end(srv, http, lease)


# --- OpenAI Responses (the Agents SDK's default model) --------------------------------------------------------------


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_sdk_runs_a_tool_calling_turn_recorded_and_merged(tool_server, api):
    """Its default model (Responses), and its Chat Completions model."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        RunConfig,
        Runner,
    )

    srv, http = tool_server
    lease = begin(http)
    asked: list[str] = []

    get_weather, after_two_calls = agents_weather_tool(asked)

    client = openai.AsyncOpenAI(base_url=lease["base_url"], api_key=lease["api_key"], max_retries=0)
    agent = Agent(name="forecaster", instructions="Answer with the weather.", tools=[get_weather],
                  model=(OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel)(
                      model="tiny", openai_client=client),
                  model_settings=ModelSettings(max_tokens=48, temperature=0), tool_use_behavior=after_two_calls)
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?",
                                    run_config=RunConfig(tracing_disabled=True)))
    assert asked == ["Paris", "Paris"] and result.final_output == "sunny in Paris"

    (sample,) = end(srv, http, lease)  # both model calls of the run, merged: the history went back unchanged
    assert sample.num_calls == 2
    assert [told(srv, span) for span in generated_spans(sample)] == [TOOL_REPLY, TOOL_REPLY]
    usage = [r.usage.output_tokens for r in result.raw_responses]
    assert [len(span) for span in generated_spans(sample)] == usage


def test_responses_stream_and_refusals(tiny_server):
    srv, http = tiny_server
    lease = begin(http)
    client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"], max_retries=0)
    whole = client.responses.create(model="tiny", input="hello", max_output_tokens=12, temperature=0)
    with client.responses.stream(model="tiny", input="hello", max_output_tokens=12, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    forced = client.responses.create(model="tiny", input="weather?", max_output_tokens=24,
                                     tools=[{"type": "function", **WEATHER_TOOL["function"]}], tool_choice="required")
    assert [(item.type, item.name) for item in forced.output] == [("function_call", TOOL_NAME)]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_1")
    assert refused.value.code == "invalid_request"
    end(srv, http, lease)


# --- tool_choice and streaming with tools on chat completions --------------------------------------------------------


def test_tool_choice_required_or_named_yields_a_tool_call_and_bad_choices_get_a_400(tiny_server):
    srv, http = tiny_server
    lease = begin(http)
    client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"], max_retries=0)
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    asked = [{"role": "user", "content": "hi"}]
    for choice, name in [("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")]:
        reply = client.chat.completions.create(model="tiny", messages=asked, tools=[WEATHER_TOOL, other],
                                               tool_choice=choice, max_tokens=16)
        assert reply.choices[0].finish_reason == "tool_calls"
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == name or choice == "required"  # required: the model picks (a random model)
    for choice, tools in [("required", None), ({"type": "function", "function": {"name": "nope"}}, [WEATHER_TOOL]),
                          ("sometimes", [WEATHER_TOOL])]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=asked, tools=tools, tool_choice=choice, max_tokens=4)
        assert (refused.value.code, refused.value.param) == ("invalid_request", "tool_choice")
    samples = end(srv, http, lease)
    assert len(samples) == 2  # the refused requests recorded nothing


def test_a_template_without_tool_call_blocks_refuses_a_forced_choice(tiny_server, monkeypatch):
    srv, http = tiny_server
    assert ToolCallFormat.probe(lambda messages, tools: "no tool calls here") is None
    monkeypatch.setitem(vars(srv.server.chat.model.formatter), "tool_call_format", None)
    lease = begin(http)
    client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"], max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       tools=[WEATHER_TOOL], tool_choice="required", max_tokens=4)
    assert (refused.value.code, refused.value.param) == ("unsupported_value", "tool_choice")
    end(srv, http, lease)


def test_streaming_with_tools_delivers_text_before_the_end(tiny_server):
    srv, http = tiny_server
    lease = begin(http)
    client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"], max_retries=0)
    request = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story."}], tools=[WEATHER_TOOL],
                   max_tokens=24, seed=7)
    whole = client.chat.completions.create(**request).choices[0].message.content
    chunks = list(client.chat.completions.create(**request, stream=True))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    finish_at = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].finish_reason)
    first_text_at = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content)
    assert "<tool_call>" not in whole and len(texts) > 2 and first_text_at < finish_at - 2
    assert "".join(texts) == whole
    end(srv, http, lease)


def test_tool_text_holdback_keeps_back_only_what_may_start_a_call():
    holdback = ToolTextHoldback()
    assert holdback.push("Sure, ") == "Sure,"
    assert holdback.push("here <tool") == " here"
    assert holdback.push("s are") == " <tools are"  # it was not a call after all
    assert holdback.push(".\n<tool_call>{") == "."
    assert holdback.push('"name": "x"}</tool_call> more') == ""


# --- completions: token ids in, token ids out -----------------------------------------------------------------------


def test_completions_with_token_ids_return_ids_the_ledger_holds_and_merge(tiny_server):
    srv, http = tiny_server
    lease = begin(http)
    tokenizer = srv.server.chat.model.formatter.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           return_dict=False)
    url, headers = lease["base_url"] + "/completions", {"Authorization": f"Bearer {lease['api_key']}"}
    first = httpx.post(url, headers=headers, json={"model": "tiny", "prompt": prompt, "max_tokens": 6}).json()
    ids, logprobs = first["choices"][0]["token_ids"], first["choices"][0]["logprobs"]["token_logprobs"]
    assert first["prompt_token_ids"] == prompt and len(ids) == len(logprobs) == first["usage"]["completion_tokens"]
    more = prompt + ids + tokenizer.encode("\nok", add_special_tokens=False)
    second = httpx.post(url, headers=headers, json={"model": "tiny", "prompt": more, "max_tokens": 4}).json()
    as_text = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"]).completions.create(
        model="tiny", prompt="<|im_start|>system", max_tokens=2)
    bad = httpx.post(url, headers=headers, json={"model": "tiny", "prompt": [len(tokenizer)], "max_tokens": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"

    samples = end(srv, http, lease)
    merged = next(s for s in samples if s.num_calls == 2)
    assert merged.token_ids == more + second["choices"][0]["token_ids"]
    assert generated_spans(merged)[0] == ids
    assert merged.logprobs[len(prompt):len(prompt) + len(ids)] == pytest.approx(logprobs)
    text_sample = next(s for s in samples if s.num_calls == 1)
    control = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert control not in text_sample.token_ids[:as_text.usage.prompt_tokens]  # text is text
    assert json.loads(json.dumps(first))["object"] == "text_completion"


@pytest.mark.parametrize(("path", "body"), [
    ("/completions", {"prompt": ""}),
    ("/completions", {"prompt": []}),
    ("/responses", {"input": "x", "text": {"format": "json"}}),
    ("/responses", {"input": "x", "tools": [{"type": "web_search"}]}),
    ("/responses", {"input": [{"type": "item_reference", "id": "x"}]}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}],
                           "tool_choice": "required"}),
    ("/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
])
def test_what_an_api_does_not_support_is_a_400_not_a_500(tiny_server, path, body):
    _, http = tiny_server
    lease = begin(http)
    r = httpx.post(lease["base_url"] + path, headers={"Authorization": f"Bearer {lease['api_key']}"},
                   json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": CLIENT})
