"""`marl proxy` answering the Responses and Messages APIs, with unmodified clients: the anthropic SDK (plain,
streamed, a tool round trip) and the OpenAI Agents SDK's default Responses model (a tool-calling run).

Each request is N chat-completion candidates on the swarm server, scored, and the winner translated back; the
winner's tokens are what the client was told, and a conversation's next turn continues on the winner's lease from
its exact tokens. The server runs the tiny model trained to always answer with a tool call (`tests/tool_model.py`).
"""

from __future__ import annotations

import asyncio
from array import array

import anthropic
import pytest
from conftest import LocalServer, admin_http, ledger_samples, start_rolling
from test_proxy import APP_KEY, LengthReward, N, Proxy, new_rows, running_leases, wait_for
from tool_model import TOOL_ARGUMENTS, TOOL_NAME, TOOL_REPLY, WEATHER_TOOL, agents_weather_tool, tool_model_dir

# The first test of a run builds the tool-calling model (tests/tool_model.py: about 25 s alone on 2 cores, more on a
# busy machine; shared by the test processes) inside its fixture, which counts against the test's timeout.
pytestmark = pytest.mark.timeout(900)

COLUMNS = "e.episode_id, s.agent, s.token_ids, s.loss_mask"
#: The anthropic SDK has no temperature parameter any more; the API still takes one, sent as an extra field.
GREEDY = {"temperature": 0}
ANTHROPIC_WEATHER = {"name": TOOL_NAME, "input_schema": WEATHER_TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def tool_swarm(tmp_path_factory):
    model = tool_model_dir(tmp_path_factory)
    with LocalServer(model, tmp_path_factory.mktemp("tool-swarm")) as server, admin_http(server.url) as http:
        start_rolling(http, batch_size=1000, num_repeat=N, save_freq=0, lease_patience_s=120)
        yield server


def prefer_tool_calls(request, candidates) -> list[float]:
    """Tool calls win (the first of equals: a conversation's held branch)."""
    return [float(c.finish_reason == "tool_calls") for c in candidates]


def decoded_turns(server: LocalServer, rows: list[tuple]) -> dict[str, dict[str, tuple[list[int], str]]]:
    """episode -> agent tag (turn) -> (its sample's token ids, the text of its last generated span)."""
    formatter = server.server.chat.model.formatter
    turns: dict[str, dict[str, tuple[list[int], str]]] = {}
    for episode, agent, ids, mask in rows:
        ids, mask = array("i", ids).tolist(), array("b", mask).tolist()
        start = max(i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1]))
        turns.setdefault(episode, {})[agent] = (ids, formatter.reply_text(ids[start:], ()))
    return turns


def carried_conversation(server: LocalServer, before: set) -> tuple[tuple[list[int], str], tuple[list[int], str]]:
    """The episode that answered both turns of a conversation: (turn 1, turn 2), each (token ids, reply text)."""
    rows = new_rows(server, before, 2 * N, COLUMNS)
    (carried,) = [t for t in decoded_turns(server, rows).values() if len(t) == 2]
    return carried["turn-1"], carried["turn-2"]


def test_anthropic_sdk_through_the_proxy_plain_streamed_and_a_tool_round_trip(tool_swarm):
    hello = [{"role": "user", "content": "hello"}]
    with Proxy(tool_swarm.url, LengthReward()) as proxy:
        client = anthropic.Anthropic(base_url=proxy.url, api_key=APP_KEY, max_retries=0)
        plain = client.messages.create(model="claude-whatever", max_tokens=48, extra_body=GREEDY, messages=hello)
        assert [b.text for b in plain.content] == [TOOL_REPLY] and plain.stop_reason == "end_turn"
        with client.messages.stream(model="tiny", max_tokens=48, extra_body=GREEDY, messages=hello) as stream:
            assert "".join(stream.text_stream) == TOOL_REPLY
            assert stream.get_final_message().usage.output_tokens == plain.usage.output_tokens
    wait_for(lambda: running_leases(tool_swarm) == 0, what="the ends")
    before = set(ledger_samples(tool_swarm.data_dir))
    with Proxy(tool_swarm.url, prefer_tool_calls, conversation_idle_s=60.0) as proxy:
        client = anthropic.Anthropic(base_url=proxy.url, api_key=APP_KEY, max_retries=0)
        asked = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = client.messages.create(model="tiny", max_tokens=48, extra_body=GREEDY, messages=asked,
                                       tools=[ANTHROPIC_WEATHER])
        (use,) = first.content
        assert (use.name, use.input) == (TOOL_NAME, TOOL_ARGUMENTS)
        result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}
        second = client.messages.create(model="tiny", max_tokens=48, extra_body=GREEDY, tools=[ANTHROPIC_WEATHER],
                                        messages=[*asked, {"role": "assistant", "content": first.content}, result])
        assert second.stop_reason == "tool_use"
        assert proxy.metric("marl_proxy_turns_total", kind="continued") >= 1
        with pytest.raises(anthropic.AuthenticationError) as refused:
            anthropic.Anthropic(base_url=proxy.url, api_key="wrong", max_retries=0).messages.create(
                model="tiny", max_tokens=8, messages=hello)
        assert refused.value.body["error"]["type"] == "authentication_error"
    (ids_1, told_1), (ids_2, told_2) = carried_conversation(tool_swarm, before)
    assert told_1 == told_2 == TOOL_REPLY  # the tokens trained on are the tool use the client was told
    assert ids_2[:len(ids_1)] == ids_1  # turn 2 went on from turn 1's exact tokens


def test_openai_agents_sdk_default_model_through_the_proxy(tool_swarm):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner
    from openai import AsyncOpenAI, OpenAI

    before, asked = set(ledger_samples(tool_swarm.data_dir)), []

    get_weather, after_two_calls = agents_weather_tool(asked)

    with Proxy(tool_swarm.url, prefer_tool_calls, conversation_idle_s=60.0) as proxy:
        client = AsyncOpenAI(base_url=proxy.url + "/v1", api_key=APP_KEY, max_retries=0)
        agent = Agent(name="forecaster", instructions="Answer with the weather.", tools=[get_weather],
                      model=OpenAIResponsesModel(model="tiny", openai_client=client),
                      model_settings=ModelSettings(max_tokens=48, temperature=0), tool_use_behavior=after_two_calls)
        result = asyncio.run(Runner.run(agent, "Weather in Paris?", run_config=RunConfig(tracing_disabled=True)))
        assert asked == ["Paris", "Paris"] and result.final_output == "sunny in Paris"
        assert proxy.metric("marl_proxy_turns_total", kind="continued") == 1
    assert running_leases(tool_swarm) == 0
    (ids_1, told_1), (ids_2, told_2) = carried_conversation(tool_swarm, before)
    assert told_1 == told_2 == TOOL_REPLY
    assert ids_2[:len(ids_1)] == ids_1

    with Proxy(tool_swarm.url, LengthReward()) as proxy:  # a streamed Responses request, answered by the winner
        app = OpenAI(base_url=proxy.url + "/v1", api_key=APP_KEY, max_retries=0)
        with app.responses.stream(model="tiny", input="hello", max_output_tokens=48, temperature=0) as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            assert "".join(deltas) == stream.get_final_response().output_text == TOOL_REPLY
