"""`marl proxy` against a real swarm server (tiny model, in this process), with the unmodified openai SDK as the app.

Each request must become N episodes with one task id in the ledger, the app must get the candidate with the highest
reward (streamed or not), the app's key must not reach the swarm's control plane, a failing reward function must
leave nothing on the server, a conversation's next turn must continue on the winner's lease, and a request must wait
(bounded, then 503 with Retry-After) while the server grants no lease.
"""

from __future__ import annotations

import asyncio
import threading
import time
from array import array
from collections import Counter

import httpx
import openai
import pytest
import uvicorn
from conftest import (
    ADMIN,
    LocalServer,
    admin_http,
    ledger_samples,
    play_episode,
    start_rolling,
    wait_state,
    wait_version,
)
from fastapi import FastAPI, Header

from marl.protocol import AssistantMessage, ChatCompletionRequest, ChatCompletionResponse, Choice, ErrorCode, Usage
from marl.proxy.app import ProxyOptions, build_app
from marl.proxy.cli import StartupError, check_server
from marl.proxy.conversations import message_digests
from marl.proxy.rewards import Candidate, load_reward, parse_scores, rule_reward, score
from marl.runner.launch import free_port

APP_KEY = "proxy-test-app-key"
N = 3
HELLO = [{"role": "user", "content": "hello there"}]


class LengthReward:
    """Deterministic from the text: longer is better. Records what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], list[float]]] = []

    def __call__(self, request: ChatCompletionRequest, candidates: list[Candidate]) -> list[float]:
        texts = [c.text for c in candidates]
        rewards = [float(len(t)) for t in texts]
        self.calls.append((texts, rewards))
        return rewards


class FailingReward(LengthReward):
    def __call__(self, request, candidates):
        super().__call__(request, candidates)
        raise RuntimeError("the reward function broke")


class Proxy:
    """The proxy app (`marl.proxy.app.build_app`) served by uvicorn in a thread, on a free port."""

    def __init__(self, swarm_url: str, reward, **options) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = dict(num_repeat=N, served_model="tiny", max_wait_s=30.0, conversation_idle_s=0.0) | options
        self.app = build_app(ProxyOptions(server_url=swarm_url, admin_token=ADMIN, api_key=APP_KEY, reward=reward,
                                          **settings))
        self.service = self.app.state.service
        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> Proxy:
        self._thread.start()
        wait_for(lambda: self._server.started, what="the proxy to start")
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)

    def app_client(self, api_key: str = APP_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)

    def metric(self, name: str, **labels: str) -> float:
        return self.service.metrics.registry.get_sample_value(name, labels) or 0.0


def wait_for(condition, timeout: float = 60.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


def new_rows(server: LocalServer, before: set, count: int, columns: str | None = None) -> list[tuple]:
    """Wait until the ledger holds exactly `count` samples beyond `before`; return them."""
    def rows():
        found = [r for r in ledger_samples(server.data_dir) if r not in before]
        assert len(found) <= count, found
        return found if len(found) == count else None

    found = wait_for(rows, what=f"{count} new samples in the ledger")
    if columns is None:
        return found
    ids = {episode for episode, *_ in found}
    return [r for r in ledger_samples(server.data_dir, columns) if r[0] in ids]


def running_leases(server: LocalServer) -> int:
    with admin_http(server.url) as http:
        return http.get("/control/pool").json()["running_leases"]


@pytest.fixture(scope="module")
def swarm(tiny_model, tmp_path_factory):
    """One ROLLING server for the tests that leave its engine alone; its batch never fills (no training)."""
    with LocalServer(tiny_model, tmp_path_factory.mktemp("swarm")) as server, admin_http(server.url) as http:
        start_rolling(http, batch_size=1000, num_repeat=N, save_freq=0, lease_patience_s=120)
        yield server


# --- one request, one group ----------------------------------------------------------------------------------------


def test_a_request_is_n_episodes_of_one_task_and_the_app_gets_the_best(swarm):
    reward, before = LengthReward(), set(ledger_samples(swarm.data_dir))
    with Proxy(swarm.url, reward) as proxy:
        reply = proxy.app_client().chat.completions.create(model="whatever-the-app-says", messages=HELLO, max_tokens=8)
        texts, rewards = reward.calls[-1]
        assert len(texts) == N
        assert reply.model == "tiny"
        assert rewards[texts.index(reply.choices[0].message.content)] == max(rewards)
        rows = new_rows(swarm, before, N)
        assert len({episode for episode, *_ in rows}) == N
        assert len({task for _, task, _, _ in rows}) == 1
        assert {agent for _, _, agent, _ in rows} == {"turn-1"}
        assert sorted(r for *_, r in rows) == pytest.approx(sorted(rewards))
        assert proxy.metric("marl_proxy_requests_total", outcome="best") == 1
        wait_for(lambda: proxy.metric("marl_proxy_episodes_total", disposition="ended") == N, what="the ends")
        assert proxy.metric("marl_proxy_candidate_reward_count", policy_version="0") == N
    assert running_leases(swarm) == 0


def test_streaming_sends_the_best_candidate_once_chosen(swarm):
    reward, before = LengthReward(), set(ledger_samples(swarm.data_dir))
    with Proxy(swarm.url, reward) as proxy:
        stream = proxy.app_client().chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=8, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        texts, rewards = reward.calls[-1]
        assert rewards[texts.index(text)] == max(rewards)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
        rows = new_rows(swarm, before, N)
        assert len({task for _, task, _, _ in rows}) == 1


def test_the_apps_key_and_the_admin_token_stay_apart(swarm):
    with Proxy(swarm.url, LengthReward()) as proxy:
        assert proxy.app_client().models.list().data[0].id == "tiny"
        with pytest.raises(openai.AuthenticationError) as refused:
            proxy.app_client(api_key=ADMIN).models.list()
        assert refused.value.body["code"] == ErrorCode.INVALID_API_KEY
        with pytest.raises(openai.AuthenticationError):
            proxy.app_client(api_key=ADMIN).chat.completions.create(model="tiny", messages=HELLO, max_tokens=4)
        assert httpx.get(proxy.url + "/metrics").status_code == 200  # counts only, open like the server's
    as_app = {"Authorization": f"Bearer {APP_KEY}"}
    for route in ("/control/status", "/control/pool"):
        response = httpx.get(swarm.url + route, headers=as_app)
        assert response.status_code == 401 and response.json()["error"]["code"] == ErrorCode.UNAUTHORIZED
    response = httpx.post(swarm.url + "/episodes/begin", json={"client_id": "app"}, headers=as_app)
    assert response.status_code == 401
    with pytest.raises(ValueError, match="admin token"):
        ProxyOptions(server_url=swarm.url, admin_token=ADMIN, api_key=ADMIN, reward=LengthReward(), num_repeat=N,
                     served_model="tiny")


# --- failures ------------------------------------------------------------------------------------------------------


def test_a_failing_reward_function_records_nothing_and_the_app_gets_the_first_candidate(swarm):
    reward, before = FailingReward(), set(ledger_samples(swarm.data_dir))
    with admin_http(swarm.url) as http:
        counts = http.get("/control/status").json()["metrics"]
        with Proxy(swarm.url, reward) as proxy:
            reply = proxy.app_client().chat.completions.create(model="tiny", messages=HELLO, max_tokens=8)
            assert reply.choices[0].message.content == reward.calls[-1][0][0]
            # The aborts happen before the answer: nothing of this request is left on the server when the app has it.
            assert running_leases(swarm) == 0
            after = http.get("/control/status").json()["metrics"]
            assert after["leases_aborted"] - counts["leases_aborted"] == N
            assert after["episodes_ended"] == counts["episodes_ended"]
            assert proxy.metric("marl_proxy_requests_total", outcome="unscored") == 1
            assert proxy.metric("marl_proxy_episodes_total", disposition="aborted") == N
    assert set(ledger_samples(swarm.data_dir)) == before


class FailsOnSecondTurn(LengthReward):
    def __call__(self, request, candidates):
        rewards = super().__call__(request, candidates)
        if len(self.calls) == 2:
            raise RuntimeError("the reward function broke on turn 2")
        return rewards


def test_a_failing_reward_on_a_continued_turn_aborts_the_held_lease_too(swarm):
    reward, before = FailsOnSecondTurn(), set(ledger_samples(swarm.data_dir))
    with Proxy(swarm.url, reward, conversation_idle_s=60.0) as proxy:
        app = proxy.app_client()
        first = app.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6).choices[0].message.content
        history = [*HELLO, {"role": "assistant", "content": first}, {"role": "user", "content": "and then?"}]
        second = app.chat.completions.create(model="tiny", messages=history, max_tokens=6).choices[0].message.content
        assert second == reward.calls[1][0][0]  # candidate 0: the one played on the held lease
        assert proxy.metric("marl_proxy_conversations_held") == 0
        rows = new_rows(swarm, before, N - 1)  # turn 1's losers; the held branch held turn 2's unscored call
        assert {agent for _, _, agent, _ in rows} == {"turn-1"}
        wait_for(lambda: running_leases(swarm) == 0, what="the turn's leases to be aborted")


def test_a_refused_candidate_reaches_the_app_and_its_leases_are_aborted(swarm):
    before = set(ledger_samples(swarm.data_dir))
    with Proxy(swarm.url, LengthReward()) as proxy:
        with pytest.raises(openai.BadRequestError) as refused:
            proxy.app_client().chat.completions.create(model="tiny", messages=HELLO, max_tokens=10**7)
        assert refused.value.body["code"] == ErrorCode.CONTEXT_LENGTH_EXCEEDED
        assert running_leases(swarm) == 0  # aborted before the app heard of it
        assert proxy.metric("marl_proxy_requests_total", outcome="error") == 1
    assert set(ledger_samples(swarm.data_dir)) == before


# --- conversations -------------------------------------------------------------------------------------------------


def test_the_next_turn_continues_on_the_winners_lease_with_one_group_per_turn(swarm):
    reward, before = LengthReward(), set(ledger_samples(swarm.data_dir))
    columns = "e.episode_id, e.task_id, s.agent, s.reward, s.token_ids"
    with Proxy(swarm.url, reward, conversation_idle_s=60.0) as proxy:
        app = proxy.app_client()
        first = app.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6).choices[0].message.content
        history = [*HELLO, {"role": "assistant", "content": first}, {"role": "user", "content": "tell me more"}]
        app.chat.completions.create(model="tiny", messages=history, max_tokens=6)
        assert proxy.metric("marl_proxy_turns_total", kind="continued") == 1
        assert proxy.metric("marl_proxy_conversations_held") == 1
        wait_for(lambda: running_leases(swarm) == 1, what="the losers to end")  # the winner of turn 2 is held
    # Shutting the proxy down ends the held conversation with its rewards: nothing is left on the server.
    assert running_leases(swarm) == 0
    rows = new_rows(swarm, before, 2 * N, columns)
    assert len({task for _, task, *_ in rows}) == 1
    assert Counter(agent for _, _, agent, *_ in rows) == {"turn-1": N, "turn-2": N}
    assert len({episode for episode, *_ in rows}) == 2 * N - 1
    by_episode = {}
    for episode, _, agent, sample_reward, ids in rows:
        by_episode.setdefault(episode, {})[agent] = (sample_reward, array("i", ids).tolist())
    carried = [turns for turns in by_episode.values() if len(turns) == 2]
    assert len(carried) == 1, "one episode answered both turns: the winner of turn 1"
    (reward_1, ids_1), (reward_2, ids_2) = carried[0]["turn-1"], carried[0]["turn-2"]
    assert reward_1 == pytest.approx(max(reward.calls[0][1]))  # it won turn 1
    assert reward_2 == pytest.approx(reward.calls[1][1][0])  # and played candidate 0 of turn 2, with its own reward
    assert ids_2[: len(ids_1)] == ids_1  # turn 2 starts with the exact tokens of turn 1


def test_an_idle_conversation_is_ended_with_its_reward(swarm):
    before = set(ledger_samples(swarm.data_dir))
    with Proxy(swarm.url, LengthReward(), conversation_idle_s=0.5) as proxy:
        proxy.app_client().chat.completions.create(model="tiny", messages=HELLO, max_tokens=4)
        new_rows(swarm, before, N)
        wait_for(lambda: proxy.metric("marl_proxy_conversations_held") == 0, what="the idle conversation to end")
        assert running_leases(swarm) == 0


def test_message_digests_ignore_what_the_template_does_not_render():
    sent = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    call = {"id": "call_9", "function": {"name": "f", "arguments": "{}"}}  # ids do not matter, names and arguments do
    returned = [{"role": "user", "content": "hi"}, AssistantMessage(content="", tool_calls=[call])]
    assert message_digests(sent) == message_digests(returned)
    assert message_digests(sent)[0] != message_digests([{"role": "user", "content": "hi!"}])[0]


# --- waiting for the server ----------------------------------------------------------------------------------------


def test_requests_wait_while_the_server_grants_no_lease_then_503_with_retry_after(local_server):
    with local_server() as server, admin_http(server.url) as http:
        start_rolling(http, batch_size=100, num_repeat=N, save_freq=0)
        http.post("/control/stop")
        wait_state(http, "OFFLINE")
        with Proxy(server.url, LengthReward(), max_wait_s=1.0) as proxy:
            started = time.monotonic()
            with pytest.raises(openai.InternalServerError) as unavailable:
                proxy.app_client().chat.completions.create(model="tiny", messages=HELLO, max_tokens=4)
            assert 1.0 <= time.monotonic() - started < 10
            assert unavailable.value.status_code == 503
            assert unavailable.value.response.headers["Retry-After"] == "1"
            assert unavailable.value.body["code"] == ErrorCode.ENGINE_UNAVAILABLE
            assert proxy.metric("marl_proxy_requests_total", outcome="unavailable") == 1
        with Proxy(server.url, LengthReward(), max_wait_s=60.0) as proxy:
            replies = []
            waiting = threading.Thread(target=lambda: replies.append(proxy.app_client().chat.completions.create(
                model="tiny", messages=HELLO, max_tokens=4)))
            waiting.start()
            wait_for(lambda: proxy.metric("marl_proxy_requests_waiting") == 1, what="the request to wait")
            assert http.post("/control/start").status_code == 200
            waiting.join(timeout=60)
            assert replies and replies[0].choices[0].message.content is not None


def test_held_conversations_never_keep_the_server_waiting(local_server):
    """Slots: a request that finds none free ends the held conversation. Drain: the server trains although the proxy
    held a conversation when the batch filled."""
    with local_server() as server, admin_http(server.url) as http:
        start_rolling(http, batch_size=1, num_repeat=2, max_leases=2, save_freq=0)
        with Proxy(server.url, LengthReward(), num_repeat=2, conversation_idle_s=300.0) as proxy:
            app = proxy.app_client()
            app.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4)  # its winner holds a slot
            # Needs both slots: the held conversation is ended, which completes its group and fills the batch.
            app.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "other"}], max_tokens=4)
            wait_version(http, 1)
            assert proxy.metric("marl_proxy_conversations_held") == 1
            play_episode(http, "direct", 1.0)  # with the held lease, these fill the next batch
            play_episode(http, "direct", 0.0)
            wait_version(http, 2)  # drained although the proxy held a lease: the watcher ended it
            assert proxy.metric("marl_proxy_conversations_held") == 0
            assert running_leases(server) == 0


def test_the_proxy_needs_n_that_fills_the_servers_groups(swarm):
    assert check_server(swarm.url, ADMIN, None, None) == (N, "tiny")
    assert check_server(swarm.url, ADMIN, N + 2, None) == (N + 2, "tiny")
    with pytest.raises(StartupError, match="num_repeat"):
        check_server(swarm.url, ADMIN, N - 1, None)


# --- reward functions ----------------------------------------------------------------------------------------------


def _candidates(*texts: str) -> list[Candidate]:
    responses = [ChatCompletionResponse(id="x", created=0, model="m", usage=Usage(prompt_tokens=1, completion_tokens=1,
                                                                                  total_tokens=2),
                                        choices=[Choice(message=AssistantMessage(content=t), finish_reason="stop")])
                 for t in texts]
    return [Candidate.from_response(r) for r in responses]


REQUEST = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "What color is the sky?"}])


def test_rule_reward_terms():
    words = rule_reward(max_words="1")
    assert words(REQUEST, _candidates("Blue.", "It is blue.", "")) == pytest.approx([1.0, 1 / 3, 0.0])
    both = rule_reward(pattern=r"^[A-Z]", contains="blue")
    assert both(REQUEST, _candidates("Blue", "blue", "Red")) == pytest.approx([1.0, 0.5, 0.5])
    assert rule_reward(min_words="4")(REQUEST, _candidates("a b", "a b c d e")) == pytest.approx([0.5, 1.0])
    with pytest.raises(ValueError, match="at least one"):
        rule_reward()
    with pytest.raises(ValueError, match="max_words"):
        rule_reward(max_words="many")


def test_load_reward_by_name(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def score(request, candidates):\n    return [1.0] * len(candidates)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("my_rewards:score")(REQUEST, _candidates("a")) == [1.0]
    assert load_reward("rule", {"max_words": "2"})(REQUEST, _candidates("a b c")) == pytest.approx([2 / 3])
    for spec, options, problem in [("my_rewards", None, "module:function"), ("nowhere:score", None, "cannot import"),
                                   ("my_rewards:missing", None, "no callable"), ("my_rewards:score", {"a": "1"},
                                                                                 "built-in"),
                                   ("rule", {"colour": "red"}, "colour")]:
        with pytest.raises(ValueError, match=problem):
            load_reward(spec, options)


def test_score_checks_what_the_reward_function_returns():
    async def asynchronous(request, candidates):
        return [0.5] * len(candidates)

    assert asyncio.run(score(asynchronous, REQUEST, _candidates("a", "b"))) == [0.5, 0.5]
    for bad, problem in [(lambda r, c: [1.0], "1 rewards for 2"), (lambda r, c: [1.0, float("nan")], "finite"),
                         (lambda r, c: [True, 1.0], "finite")]:
        with pytest.raises(ValueError, match=problem):
            asyncio.run(score(bad, REQUEST, _candidates("a", "b")))


def test_parse_scores_reads_what_judges_write():
    assert parse_scores("[3, 9, 5]", 3) == [3, 9, 5]
    assert parse_scores("<think>maybe [1, 2]</think>Scores: [7, 2]", 2) == [7, 2]
    assert parse_scores("Candidate 1: 8/10\nCandidate 2: 3/10", 2) == [8, 3]
    assert parse_scores("[1] 6\n[2] 4", 2) == [6, 4]
    assert parse_scores("I'd say 12 and -1", 2) == [10, 0]  # clamped to 0..10
    with pytest.raises(ValueError):
        parse_scores("all of them are fine", 2)


@pytest.fixture
def judge_endpoint():
    """A stand-in for a judge model at an OpenAI URL: it garbles its first answer, then scores by length."""
    app, seen = FastAPI(), []

    @app.post("/v1/chat/completions")
    async def judge(body: dict, authorization: str | None = Header(None)) -> dict:
        seen.append((authorization, body))
        prompt = body["messages"][-1]["content"]
        listed = prompt.split("Candidate replies:\n", 1)[1].split("\n\nScores", 1)[0].split("\n\n")
        content = "let me think" if len(seen) == 1 else str([len(c.split("] ", 1)[1]) for c in listed])
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, what="the judge to start")
    yield f"http://127.0.0.1:{port}/v1", seen
    server.should_exit = True
    thread.join(timeout=15)


def test_judge_reward_asks_again_then_scores(judge_endpoint, monkeypatch):
    url, seen = judge_endpoint
    monkeypatch.setenv("JUDGE_KEY", "judge-secret")
    judge = load_reward("judge", {"url": url, "model": "judge-model", "api_key_env": "JUDGE_KEY"})
    assert asyncio.run(score(judge, REQUEST, _candidates("Blue", "It is blue"))) == pytest.approx([0.4, 1.0])
    assert len(seen) == 2
    authorization, body = seen[-1]
    assert authorization == "Bearer judge-secret" and body["model"] == "judge-model"
    assert "What color is the sky?" in body["messages"][-1]["content"]
    with pytest.raises(ValueError, match="NO_SUCH_KEY"):
        load_reward("judge", {"url": url, "model": "m", "api_key_env": "NO_SUCH_KEY"})


def test_the_command_line_parses(monkeypatch, swarm):
    import argparse

    from marl.proxy import add_proxy_parser
    from marl.proxy.cli import proxy_options

    parser = argparse.ArgumentParser()
    add_proxy_parser(parser.add_subparsers())
    args = parser.parse_args(["proxy", "--server", swarm.url, "--reward", "rule", "--reward-option", "max_words=3",
                              "--conversation-idle-s", "0"])
    monkeypatch.setenv("MARL_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("MARL_PROXY_API_KEY", APP_KEY)
    options = proxy_options(args)
    assert (options.num_repeat, options.served_model, options.api_key) == (N, "tiny", APP_KEY)
    monkeypatch.setenv("MARL_PROXY_API_KEY", ADMIN)
    with pytest.raises(StartupError, match="admin token"):
        proxy_options(args)
