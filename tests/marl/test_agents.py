"""LLMAgent against a real swarm server over HTTP (tiny random model), and ScriptedAgent."""

from __future__ import annotations

import json
import types

import httpx
import openai
import pytest
from conftest import LocalServer, admin_http, start_rolling, wait_state

from envs.base import play
from envs.signalling import SignallingGame
from marl.agents import LLMAgent, ScriptedAgent
from marl.games.table import Seat, default_player
from marl.protocol import AGENT_HEADER, ErrorCode
from servers.episodes.ledger import Ledger


@pytest.fixture(scope="module")
def static_server(tiny_model, tmp_path_factory):
    """One static server (a frozen tiny random model, served as "tiny") shared by this module's tests."""
    with LocalServer(tiny_model, tmp_path_factory.mktemp("static"), static=True) as srv, admin_http(srv.url) as http:
        wait_state(http, "STATIC")
        yield srv


@pytest.fixture
def static_client(static_server):
    return openai.OpenAI(base_url=static_server.url + "/v1", api_key="any", max_retries=0)


def spy_on(client):
    """Record the JSON body of every request `client` (or a copy of it: they share its HTTP client) sends."""
    bodies: list[dict] = []
    client._client.event_hooks["request"].append(lambda request: bodies.append(json.loads(request.content)))
    return bodies


def test_conversation_grows_turn_by_turn(static_client):
    agent = LLMAgent(static_client, "tiny", system_prompt="You are a test.", max_tokens=8, agent_tag="speaker")
    calls = spy_on(agent.client)
    replies = [agent.act(f"Turn {i}: say yes.") for i in range(3)]
    assert all(isinstance(r, str) for r in replies)
    assert agent.messages[0] == {"role": "system", "content": "You are a test."}
    assert [m["role"] for m in agent.messages] == ["system"] + ["user", "assistant"] * 3
    assert [m["content"] for m in agent.messages[2::2]] == replies  # replies kept verbatim
    # each call sends everything before it: the previous call's prompt + reply, then the new observation
    assert [len(c["messages"]) for c in calls] == [2, 4, 6]
    assert calls[2]["messages"][:4] == agent.messages[:4]
    # the tag is the agent's client's default header, set once; the calls send nothing more (no `user`)
    assert agent.client.default_headers[AGENT_HEADER] == "speaker" and AGENT_HEADER not in static_client.default_headers
    assert "user" not in calls[0] and "extra_headers" not in calls[0]
    assert (calls[0]["max_tokens"], calls[0]["temperature"], calls[0]["model"]) == (8, 1.0, "tiny")
    agent.reset()
    assert agent.messages == [{"role": "system", "content": "You are a test."}]
    agent.reset(system_prompt="New role.")
    assert agent.messages == [{"role": "system", "content": "New role."}]


def test_an_sdk_client_sends_the_body_without_the_sdks_type_walk(static_client, monkeypatch):
    """`chat.completions.create` walks every message through the SDK's type transform (milliseconds per call in a
    long game); the agent posts the same body itself, and what it gets back is the SDK's ChatCompletion."""
    def unused(*args, **kwargs):
        raise AssertionError("chat.completions.create was called")

    monkeypatch.setattr(openai.resources.chat.completions.Completions, "create", unused)
    calls = spy_on(static_client)
    agent = LLMAgent(static_client, "tiny", system_prompt="s", max_tokens=3, temperature=0.5, top_p=0.9, stop="\n")
    reply = agent.act("hi")
    sent = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    assert calls == [{"model": "tiny", "messages": sent, "max_tokens": 3, "temperature": 0.5, "top_p": 0.9,
                      "stop": ["\n"]}]
    assert agent.messages[-1] == {"role": "assistant", "content": reply}


def test_the_agent_tag_is_sent_once_as_its_clients_header(static_server):
    """One way, once per client: the `X-Marl-Agent` header on the agent's client; no `user`, no per-call header."""
    sent: list[httpx.Request] = []
    http = httpx.Client(event_hooks={"request": [sent.append]})
    client = openai.OpenAI(base_url=static_server.url + "/v1", api_key="any", max_retries=0, http_client=http)
    agent = LLMAgent(client, "tiny", system_prompt="s", max_tokens=2, agent_tag="seer")
    agent.act("hi")
    agent.act("again")
    assert [request.headers.get_list(AGENT_HEADER) for request in sent] == [["seer"], ["seer"]]
    assert not any("user" in json.loads(request.content) for request in sent)
    assert AGENT_HEADER not in client.default_headers  # a client shared by several agents stays untagged
    seat = Seat("player_2", "seer", "srv", base_url=static_server.url + "/v1", model="tiny", trainable=True)
    player = default_player(seat)
    assert player.client.default_headers[AGENT_HEADER] == "seer" and player.client.max_retries == 0
    with pytest.raises(TypeError, match="X-Marl-Agent"):
        LLMAgent(RefusingClient(), "m", system_prompt="s", agent_tag="seer")  # no OpenAI SDK client: say so


def test_the_seats_own_clients_share_one_connection_pool(static_server):
    """Each leased seat gets an OpenAI client of its own (its base URL, its tag, no retries), all on one connection
    pool: a client with a pool of its own costs ~65 ms of CPU to make (its SSL context), and a game makes several."""
    seats = [Seat(f"player_{i}", role, "srv", base_url=static_server.url + "/v1", model="tiny", trainable=True,
                  max_tokens=2) for i, role in enumerate(("seer", "witch"))]
    first, second = (default_player(seat) for seat in seats)
    assert first.client is not second.client and first.client._client is second.client._client
    assert [player.client.default_headers[AGENT_HEADER] for player in (first, second)] == ["seer", "witch"]
    replies = [player.act("hi") for player in (first, second)]  # both call through the shared pool
    assert all(isinstance(reply, str) for reply in replies) and len(second.messages) == 3


def test_untagged_agent_sends_no_tag_and_failed_call_keeps_conversation(static_client):
    calls = spy_on(static_client)
    agent = LLMAgent(static_client, "tiny", system_prompt="s", max_tokens=4)
    agent.act("hi")
    assert "user" not in calls[0] and "extra_headers" not in calls[0]
    wrong = LLMAgent(static_client, "no-such-model", system_prompt="s", max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        wrong.act("hi")
    assert wrong.messages == [{"role": "system", "content": "s"}]


def test_a_conversation_over_the_context_is_cut_from_the_front(static_client):
    """The tiny model's context is 2048 tokens; 3 observations of ~800 tokens do not fit together, 2 do."""
    calls = spy_on(static_client)
    agent = LLMAgent(static_client, "tiny", system_prompt="Rules.", max_tokens=4)
    for i in range(3):
        agent.act(f"Turn {i}: " + "news " * 200)
    assert agent.messages[0] == {"role": "system", "content": "Rules."}
    assert [m["content"][:7] for m in agent.messages if m["role"] == "user"] == ["Turn 1:", "Turn 2:"]
    assert [m["role"] for m in agent.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert [len(c["messages"]) for c in calls] == [2, 4, 6, 4]  # the refused call, retried without turn 0
    alone = LLMAgent(static_client, "tiny", system_prompt="Rules.", max_tokens=4)
    with pytest.raises(openai.BadRequestError) as refused:  # a single observation too long: nothing to cut
        alone.act("news " * 1000)
    assert refused.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert alone.messages == [{"role": "system", "content": "Rules."}]


class Refused(Exception):
    """What an OpenAI-compatible SDK raises for a refused call: the server's error code, and a message."""

    def __init__(self, message: str, code: str | None = None, body: dict | None = None):
        super().__init__(message)
        self.code, self.body, self.status_code = code, body, 400


class RefusingClient:
    """An OpenAI-shaped client whose first calls raise the given errors (to pin down what LLMAgent branches on)."""

    def __init__(self, *errors: Exception):
        self.errors, self.sent = list(errors), []
        self.chat = self.completions = self

    def create(self, **kwargs):
        self.sent.append(len(kwargs["messages"]))
        if self.errors:
            raise self.errors.pop(0)
        return types.SimpleNamespace(choices=[types.SimpleNamespace(message=types.SimpleNamespace(content="ok"))])


@pytest.mark.parametrize("error", [
    Refused("too long", code=ErrorCode.CONTEXT_LENGTH_EXCEEDED.value),  # the SDK's exc.code
    Refused("too long", body={"code": "context_length_exceeded"}),  # only in the body (exc.body is the error)
    Refused("too long", body={"error": {"code": "context_length_exceeded"}}),  # the whole response body
])
def test_the_context_is_cut_on_the_error_code(error):
    client = RefusingClient(error)
    agent = LLMAgent(client, "m", system_prompt="s")
    agent.messages += [{"role": "user", "content": "old"}, {"role": "assistant", "content": "reply"}]
    assert agent.act("new") == "ok"
    assert client.sent == [4, 2] and [m["content"] for m in agent.messages] == ["s", "new", "ok"]


def test_a_message_that_mentions_the_context_is_not_a_context_error():
    client = RefusingClient(Refused("the context limit of this model is 2048 tokens", code="invalid_messages"))
    agent = LLMAgent(client, "m", system_prompt="s")
    agent.messages += [{"role": "user", "content": "old"}, {"role": "assistant", "content": "reply"}]
    with pytest.raises(Refused):
        agent.act("new")
    assert client.sent == [4] and len(agent.messages) == 3  # nothing cut, the failed turn taken back


def test_llm_agents_play_a_full_signalling_game(static_client):
    env = SignallingGame()
    agents = {a: LLMAgent(static_client, "tiny", system_prompt=env.system_prompt(a), max_tokens=12, agent_tag=a)
              for a in env.possible_agents}
    outcome = play(env, agents, seed=0)
    assert set(outcome) == {"speaker", "listener"} and outcome["speaker"] == outcome["listener"] in (0.0, 1.0)
    assert env.agents == []  # the game ran to its end
    # a random model mostly fails the listener's format: the env asked again, then fell back; every ask is a turn
    for name, agent in agents.items():
        turns = len(agent.messages[1::2])
        assert 1 <= turns <= env.max_invalid_retries + 1
        assert turns == env.invalid_actions[name] + 1 - env.fallbacks[name]


def test_a_game_is_one_sample_per_agent_on_a_training_server(local_server):
    """The point of LLMAgent's conversation: a game's calls merge into one sample per agent, under its tag."""
    with local_server() as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=100, num_repeat=4, lease_patience_s=60)
        lease = http.post("/episodes/begin", json={"client_id": "c"}).json()
        client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"], max_retries=0)
        env = SignallingGame()
        agents = {a: LLMAgent(client, "tiny", system_prompt=env.system_prompt(a), max_tokens=12, agent_tag=a)
                  for a in env.possible_agents}
        outcome = play(env, agents, seed=3)
        r = http.post(f"/episodes/{lease['episode_id']}/end",
                      json={"client_id": "c", "task_id": "signal-3", "reward": 0.0, "agent_rewards": outcome})
        assert r.status_code == 200, r.text
        ledger = Ledger(srv.data_dir / "ledger.sqlite")
        try:
            samples = {s.agent: s for s in ledger.samples_of(lease["episode_id"])}
        finally:
            ledger.close()
    assert set(samples) == {"speaker", "listener"}
    for name, agent in agents.items():
        assert samples[name].num_calls == len(agent.messages[1::2])
        assert samples[name].reward == outcome[name]


def test_scripted_agents_win_and_llm_vs_scripted_completes(static_client):
    env = SignallingGame(num_items=5)
    scripted = {a: ScriptedAgent(env, a) for a in env.possible_agents}
    for seed in range(10):
        assert play(env, scripted, seed=seed) == {"speaker": 1.0, "listener": 1.0}
    listener = LLMAgent(static_client, "tiny", system_prompt=env.system_prompt("listener"), max_tokens=8,
                        agent_tag="listener")
    outcome = play(env, {"speaker": scripted["speaker"], "listener": listener}, seed=1)
    assert outcome["speaker"] == outcome["listener"] and env.agents == []
