"""A forced tool call keeps every token that some declared function's call allows (issue 54): under `tool_choice:
"required"` the reply is held to a lead (each declared name and the text before its arguments, `get_weather",
"arguments":`), and a token that finishes the lead and goes on (`": {"`, where the lead's own tokens end in `":`) is
allowed too (`servers/calls/lead_texts.py`), so the call keeps its arguments. Here on the torch engine, with a model
whose vocabulary holds that token and which writes it; vLLM's processors: tests/servers/test_lead_processors.py."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
from conftest import LocalServer, admin_http, start_rolling
from tiny_model import build_tokenizer
from tool_model import CROSSING_MERGE, TIME_TOOL, TOOL_ARGUMENTS, TOOL_NAME, WEATHER_TOOL, build_tool_model
from transformers import AutoModelForCausalLM

from servers.calls.chat_format import ChatFormatter
from servers.calls.lead_texts import LeadVocabulary
from servers.calls.tool_choice import ToolChoice
from servers.engines.lead_tokens import allowed_next
from servers.trainers.grpo import token_logprobs

# The module's fixture trains its model (about 10 s alone on 2 cores, more on a busy machine).
pytestmark = pytest.mark.timeout(600)

CROSSING = '": {"'  # CROSSING_MERGE's token: the tiny tokenizer's text then tokenizes `"arguments": {"city"` with it
NAMES = (TOOL_NAME, TIME_TOOL["function"]["name"])
ASKED = [{"role": "user", "content": "What is the weather in Paris?"}]


def crossing_formatter() -> ChatFormatter:
    tokenizer = build_tokenizer(extra_merges=(CROSSING_MERGE,))
    return ChatFormatter(tokenizer, frozenset({tokenizer.eos_token_id}))


def name_leads(formatter: ChatFormatter) -> list[str]:
    return formatter.tool_call_format.name_leads(ToolChoice("required", names=NAMES))


def test_the_lead_holds_each_token_that_finishes_a_sequence_and_goes_on():
    formatter = crossing_formatter()
    vocabulary = formatter.lead_vocabulary
    crossing = formatter.tokenizer.convert_tokens_to_ids("".join(CROSSING_MERGE))
    assert vocabulary.text(crossing) == CROSSING and crossing in vocabulary.starting_with('":')
    texts = name_leads(formatter)
    assert texts == [f'{name}", "arguments":' for name in NAMES]
    weather, time = (tuple(formatter.control_tokens.encode(text, ())) for text in texts)
    assert "".join(map(vocabulary.text, weather)) == texts[0] and vocabulary.text(weather[-1]) == '":'
    lead = formatter.text_lead(texts)
    assert weather in lead and time in lead and weather[:-1] + (crossing,) in lead and time[:-1] + (crossing,) in lead
    for seq in lead:  # every widening: a sequence's first k ids, then a token whose text starts with the rest's
        own = next(s for s in (weather, time) if s[:len(seq) - 1] == seq[:-1])
        rest = "".join(vocabulary.text(t) for t in own[len(seq) - 1:])
        assert seq in (weather, time) or vocabulary.text(seq[-1]).startswith(rest)
    assert allowed_next(lead, weather[:-1]) == sorted({weather[-1], crossing})
    assert allowed_next(lead, weather[:-1] + (crossing,)) is None  # the lead is spelled: free from here
    assert allowed_next(lead, []) == [weather[0]]  # only what a declared name allows: both start with "get"
    assert formatter.text_lead(texts) is lead and formatter.text_lead([]) == ()  # cached per lead set
    eos = formatter.tokenizer.eos_token_id
    assert vocabulary.text(eos) is None and eos not in vocabulary.starting_with("<|")  # never a control token


@pytest.fixture(scope="module")
def crossing_model(tmp_path_factory) -> Path:
    """The tool-calling model (tests/tool_model.py) on the crossing tokenizer, trained on forced replies: after
    `<tool_call>{"name": "` it writes `get_weather", "arguments` and then the one token `": {"`."""
    return build_tool_model(tmp_path_factory.mktemp("crossing-model"), steps=50, forced=True,
                            extra_merges=(CROSSING_MERGE,))


@pytest.fixture(scope="module")
def served(crossing_model, tmp_path_factory):
    with LocalServer(crossing_model, tmp_path_factory.mktemp("crossing") / "server") as srv, \
            admin_http(srv.url) as http:
        start_rolling(http, batch_size=1000, num_repeat=4, lease_patience_s=120)
        yield srv, http


def forced_calls(http: httpx.Client) -> list[dict]:
    lease = http.post("/episodes/begin", json={"client_id": "c"}).json()
    client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"], max_retries=0)
    bodies = [client.chat.completions.create(
        model="tiny", messages=ASKED, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", max_tokens=32,
        temperature=1.0, seed=seed, logprobs=True, extra_body={"return_token_ids": True}).model_dump()
        for seed in range(4)]
    http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "c"})
    return bodies


def calls(bodies: list[dict]) -> list[tuple[str, str]]:
    return [(call["function"]["name"], call["function"]["arguments"])
            for body in bodies for call in body["choices"][0]["message"]["tool_calls"]]


def test_a_forced_call_written_with_a_token_that_crosses_the_leads_end_keeps_its_arguments(served, crossing_model):
    _, http = served
    bodies = forced_calls(http)
    assert [(name, json.loads(arguments)) for name, arguments in calls(bodies)] == [(TOOL_NAME, TOOL_ARGUMENTS)] * 4
    crossing = crossing_formatter().tokenizer.convert_tokens_to_ids("".join(CROSSING_MERGE))
    assert all(crossing in body["choices"][0]["token_ids"] for body in bodies)  # the model's own token
    model = AutoModelForCausalLM.from_pretrained(crossing_model, dtype=torch.float32).eval()
    for body in bodies[:2]:  # raw: log softmax of the model's logits, not renormalised over what the lead allows
        prompt, choice = body["prompt_token_ids"], body["choices"][0]
        ids = torch.tensor([prompt + choice["token_ids"]])
        with torch.no_grad():
            expected = token_logprobs(model, ids, torch.ones_like(ids))[0, len(prompt):].tolist()
        assert [t["logprob"] for t in choice["logprobs"]["content"]] == pytest.approx(expected, abs=1e-3)


def test_a_lead_of_its_own_tokens_only_breaks_the_call(served, monkeypatch):
    _, http = served
    monkeypatch.setattr(LeadVocabulary, "crossing", lambda self, lead: lead)  # as before issue 54
    broken = calls(forced_calls(http))
    assert all(arguments != json.dumps(TOOL_ARGUMENTS) for _, arguments in broken), broken  # what the above prevents
