"""The vLLM engine behind a real swarm server: exact tokens and logprobs, streaming, stop strings, weight syncs after
training steps, and a vLLM subprocess that dies mid-run.

Needs the vLLM environment (`make vllm`, or $MARL_VLLM_PYTHON); skipped without it. One vLLM runs at a time (it
takes ~3 GB and 25-50 s to start): a static server first, started with vLLM settings given as `marl serve --vllm-*`
flags, then one trainable server (the CPU defaults) shared by the other tests, which run in order: a conversation,
streaming and stop strings, a training step, then the subprocess killed twice (restarted once, then down).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from conftest import ADMIN, admin_http, wait_state, wait_version
from tiny_model import build_tiny_model
from transformers import AutoModelForCausalLM

from marl.cli import _serve_options, parse
from marl.protocol import ErrorCode, TrainConfig
from marl.runner.launch import free_port
from servers.engines.vllm_http import sleep_for_training, sync_weights_waking
from servers.engines.vllm_process import VLLM_PYTHON_ENV, vllm_python
from servers.entrypoint import build_app, default_trainer_factory
from servers.episodes.ledger import Ledger
from servers.trainers.grpo import token_logprobs

pytestmark = [
    pytest.mark.skipif(not vllm_python().exists(),
                       reason=f"no vLLM environment at {vllm_python()} (`make vllm`, or set ${VLLM_PYTHON_ENV})"),
    pytest.mark.timeout(900),  # vLLM starts in 25-50 s on 2 busy cores; the crash test starts it twice
]

START_TIMEOUT_S = 600
LOGPROB_TOLERANCE = 1e-3


class VLLMServer:
    """A swarm server in this process (uvicorn in a thread) whose engine is vLLM, built from `marl serve` arguments
    (`vllm_flags`: its --vllm-* flags); `.server` is the server object."""

    def __init__(self, model: Path, data_dir: Path, *, static: bool = False, vllm_flags: Sequence[str] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = data_dir
        argv = ["serve", "--model", str(model), "--port", str(self.port), f"--admin-token={ADMIN}", "--data-dir",
                str(data_dir), "--served-model-name", "tiny", "--device", "cpu", "--engine", "vllm", *vllm_flags]
        options = _serve_options(parse(argv + (["--static"] if static else [])))  # as `marl serve` makes them
        app = build_app(options, trainer_factory=default_trainer_factory("cpu"))
        self.server = app.state.server  # TrainableServer or StaticServer
        self._uvicorn = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._uvicorn.run, daemon=True)

    def __enter__(self) -> VLLMServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "test server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # head_dim 32: vLLM's CPU attention supports 32 and up (the default tiny model has 16)
    return build_tiny_model(tmp_path_factory.mktemp("tiny-vllm"), hidden_size=64, num_heads=2)


@pytest.fixture(scope="module")
def trainable(model_dir, tmp_path_factory):
    """A trainable server on vLLM, ROLLING; one training step per group of 2 episodes, checkpointed each step."""
    with VLLMServer(model_dir, tmp_path_factory.mktemp("vllm-server")) as srv, admin_http(srv.url) as http:
        config = TrainConfig(batch_size=1, num_repeat=2, save_freq=1, learning_rate=1e-2, lease_patience_s=600)
        assert http.post("/control/config", json=config.model_dump(mode="json")).status_code == 200
        assert http.post("/control/start").status_code == 200
        wait_state(http, "ROLLING", timeout=START_TIMEOUT_S)
        yield srv, http
        assert http.post("/control/stop").status_code == 200


# ------------------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------------------


def check_the_sleep_mode_calls(engine, model_dir: Path) -> None:
    """The CPU build takes the sleep-mode weight sync's calls as they are sent (its workers skip the sleep itself):
    the engine sleeps, the weights wake, the reload runs while the KV cache still sleeps, then it serves again."""
    def sleeping() -> bool:
        return httpx.get(f"{engine.url}/is_sleeping").json()["is_sleeping"]

    sleep_for_training(engine.url)
    assert sleeping()
    sync_weights_waking(engine.url, model_dir)
    assert not sleeping()
    assert "wake up the engine with tags: ['kv_cache']" in engine.log_path.read_text()


def begin(http: httpx.Client, client_id: str = "c") -> dict:
    r = http.post("/episodes/begin", json={"client_id": client_id})
    assert r.status_code == 200, r.text
    return r.json()


def lease_client(lease: dict, agent: str | None = None) -> openai.OpenAI:
    headers = {"X-Marl-Agent": agent} if agent else None
    return openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"], default_headers=headers, max_retries=0)


@contextlib.contextmanager
def leased(http: httpx.Client, agent: str | None = None) -> Iterator[tuple[dict, openai.OpenAI]]:
    """A lease and its client; aborted at the end unless it was ended (an open lease would hold up training)."""
    lease = begin(http)
    try:
        yield lease, lease_client(lease, agent)
    finally:
        http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "c"})


def ask(client: openai.OpenAI, messages: list[dict], **kwargs) -> dict:
    """One call that returns its exact ids and the sampled tokens' logprobs (as `model_dump()`)."""
    reply = client.chat.completions.create(model="tiny", messages=messages, logprobs=True,
                                           extra_body={"return_token_ids": True}, **kwargs)
    return reply.model_dump()


def ids_and_logprobs(body: dict) -> tuple[list[int], list[int], list[float]]:
    choice = body["choices"][0]
    return body["prompt_token_ids"], choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]


def fp32_logprobs(weights: Path, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """What a transformers fp32 forward pass of `weights` gives the completion's tokens."""
    model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        return token_logprobs(model, ids, torch.ones_like(ids))[0, len(prompt_ids):].tolist()


def max_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b))


def assert_matches(weights: Path, body: dict) -> None:
    prompt, completion, served = ids_and_logprobs(body)
    assert max_gap(fp32_logprobs(weights, prompt, completion), served) <= LOGPROB_TOLERANCE


def samples(srv: VLLMServer, episode_id: str):
    ledger = Ledger(srv.data_dir / "ledger.sqlite")
    try:
        return ledger.samples_of(episode_id)
    finally:
        ledger.close()


def end(http: httpx.Client, episode_id: str, task_id: str, reward: float) -> None:
    r = http.post(f"/episodes/{episode_id}/end", json={"client_id": "c", "task_id": task_id, "reward": reward})
    assert r.status_code == 200, r.text


def one_episode(http: httpx.Client, task_id: str, reward: float) -> None:
    with leased(http) as (lease, client):
        ask(client, [{"role": "user", "content": f"task {task_id}"}], max_tokens=6, seed=1)
        end(http, lease["episode_id"], task_id, reward)


def served_weights(srv: VLLMServer, model_dir: Path) -> Path:
    """The newest checkpoint (every step is checkpointed here), else the base model."""
    return srv.server.lifecycle.checkpoints.latest() or model_dir


# ------------------------------------------------------------------------------------------------------------------
# tests (in order: the static server first, so that two vLLMs never run at once; the crash test last)
# ------------------------------------------------------------------------------------------------------------------


#: `marl serve` flags for every setting the CPU build accepts (tensor/data parallel sizes stay 1; sleep mode and the
#: utilization's CUDA start-up check do not exist on the CPU build).
SETTINGS_FLAGS = ["--vllm-max-model-len", "384", "--vllm-kv-cache-gb", "0.25", "--vllm-max-num-seqs", "4",
                  "--vllm-dtype", "float32", "--vllm-sleep-between-steps", "false", "--vllm-arg=--max-logprobs=1"]


def test_a_static_server_serves_through_vllm_started_with_the_settings(model_dir, tmp_path):
    with VLLMServer(model_dir, tmp_path / "static", static=True, vllm_flags=SETTINGS_FLAGS) as srv, \
            admin_http(srv.url) as http:
        wait_state(http, "STATIC", timeout=START_TIMEOUT_S)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="anything", max_retries=0)
        body = ask(client, [{"role": "user", "content": "Say yes."}], max_tokens=16, seed=3)
        assert_matches(model_dir, body)
        assert body["usage"]["completion_tokens"] == len(body["choices"][0]["token_ids"]) >= 1
        check_vllm_runs_with_the_settings(srv.server.engine)
        check_the_sleep_mode_calls(srv.server.engine, model_dir)
        assert_matches(model_dir, ask(client, [{"role": "user", "content": "Say yes."}], max_tokens=16, seed=3))


def check_vllm_runs_with_the_settings(engine) -> None:
    argv = Path(f"/proc/{engine.pid}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")
    assert "vllm.entrypoints.launchers.api_server.entry" in argv
    for flag, value in [("--max-model-len", "384"), ("--kv-cache-memory-bytes", str(2**28)), ("--max-num-seqs", "4"),
                        ("--dtype", "float32"), ("--tensor-parallel-size", "1"), ("--data-parallel-size", "1")]:
        assert argv[argv.index(flag) + 1] == value
    assert argv[-1] == "--max-logprobs=1" and "--enable-sleep-mode" not in argv
    # vLLM took them: its model length, its KV budget (a quarter GiB, which the old whole-GiB variable could not say),
    # its batch size, and the extra argument (more logprobs than --max-logprobs are refused)
    assert engine.context_length == 384
    assert httpx.get(f"{engine.url}/v1/models").json()["data"][0]["max_model_len"] == 384
    log = engine.log_path.read_text()
    assert "Explicitly set (0.25/" in log and "'max_num_seqs': 4" in log and "'max_logprobs': 1" in log
    refused = httpx.post(f"{engine.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "logprobs": 2})
    assert refused.status_code == 400 and "logprobs" in refused.text


def test_a_conversation_records_the_engines_exact_ids_and_logprobs(trainable, model_dir):
    srv, http = trainable
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 2 + 3?"}]
    turns = []
    with leased(http, agent="speaker") as (lease, client):
        for turn in range(3):
            body = ask(client, messages, max_tokens=12, temperature=1.0, seed=turn)
            assert_matches(model_dir, body)
            turns.append(body)
            messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"And {turn} + 4?"}]
        end(http, lease["episode_id"], "conversation", 1.0)

    (sample,) = samples(srv, lease["episode_id"])  # each turn extends the last one's exact ids: one sample
    assert (sample.agent, sample.num_calls) == ("speaker", 3)
    prompt, completion, _ = ids_and_logprobs(turns[-1])
    assert sample.token_ids == prompt + completion
    generated = [lp for lp, mask in zip(sample.logprobs, sample.loss_mask) if mask]
    served = [lp for body in turns for lp in ids_and_logprobs(body)[2]]
    assert generated == pytest.approx(served, abs=1e-6)

    # vLLM's prefix cache (whole 32-token blocks) gave the later turns the earlier turns' keys and values
    assert srv.server.lifecycle.engine.stats.cached_tokens >= 32
    cached = [line for line in httpx.get(f"{srv.url}/metrics").text.splitlines()
              if line.startswith("marl_engine_prompt_tokens_total") and 'kind="cached"' in line]
    assert cached and float(cached[0].rsplit(" ", 1)[1]) >= 32


FORCED_NAMES = ("get_weather", "get_time", "lookup_city")


def test_a_forced_call_names_a_declared_function_with_raw_logprobs(trainable, model_dir):
    """`tool_choice: required` over several tools: vLLM's logits processor (servers/engines/vllm_lead.py) holds the
    name to the declared ones, applied after vLLM took the raw logprobs (a tiny model names garbage otherwise:
    tests/servers/test_forced_tool_names.py)."""
    _, http = trainable
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in FORCED_NAMES]
    with leased(http) as (_, client):
        for seed in range(4):
            body = ask(client, [{"role": "user", "content": "Weather in Paris?"}], tools=tools, tool_choice="required",
                       max_tokens=20, temperature=1.0, seed=seed)
            (call,) = body["choices"][0]["message"]["tool_calls"]
            assert call["function"]["name"] in FORCED_NAMES
            assert_matches(model_dir, body)  # raw logprobs: not renormalised over the names


def test_streaming_stop_strings_and_context_errors(trainable):
    srv, http = trainable
    with leased(http) as (_, client):
        check_streaming_stop_strings_and_context_errors(srv, client)


def check_streaming_stop_strings_and_context_errors(srv: VLLMServer, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Write a story about a fox."}]
    full = ask(client, messages, max_tokens=40, temperature=1.0, seed=5)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=1.0, seed=5,
                                            stream=True, extra_body={"return_token_ids": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        full["choices"][0]["message"]["content"]
    assert chunks[-1].model_dump()["choices"][0]["token_ids"] == full["choices"][0]["token_ids"]

    # A stop string: the same sample cut where the stop string completes; the tokens that formed it are recorded.
    text, ids = full["choices"][0]["message"]["content"], full["choices"][0]["token_ids"]
    stop = next(text[i:i + 2] for i in range(3, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isalnum())
    cut = ask(client, messages, max_tokens=40, temperature=1.0, seed=5, stop=[stop])
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == text[:text.index(stop)]
    cut_ids = cut["choices"][0]["token_ids"]
    assert cut_ids == ids[:len(cut_ids)] and len(cut_ids) < len(ids)
    formatter = srv.server.lifecycle.formatter
    assert stop in formatter.decode(cut_ids) and stop not in formatter.decode(cut_ids[:-1])

    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=100_000)
    assert too_long.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED.value


def test_a_training_step_reaches_vllm_and_logprobs_follow_the_new_weights(trainable, model_dir):
    srv, http = trainable
    engine = srv.server.lifecycle.engine
    one_episode(http, "a", 1.0)
    one_episode(http, "a", 0.0)
    wait_version(http, 1, timeout=START_TIMEOUT_S)
    assert engine.stats.weight_loads == 1 and engine.stats.restarts == 0
    step = http.get("/control/monitor").json()["recent_steps"][-1]["metrics"]
    assert step["logprob_diff_max"] <= LOGPROB_TOLERANCE  # the trainer recomputed vLLM's logprobs

    checkpoint = served_weights(srv, model_dir)
    assert checkpoint != model_dir
    with leased(http) as (_, client):
        body = ask(client, [{"role": "user", "content": "Say yes."}], max_tokens=16, seed=3)
    assert_matches(checkpoint, body)
    prompt, completion, served = ids_and_logprobs(body)
    assert max_gap(fp32_logprobs(model_dir, prompt, completion), served) > 10 * LOGPROB_TOLERANCE  # new weights


def test_a_killed_vllm_is_restarted_once_then_the_engine_is_down(trainable, model_dir):
    srv, http = trainable
    with leased(http) as (_, client):
        check_restart_then_down(srv, client, model_dir)


def check_restart_then_down(srv: VLLMServer, client: openai.OpenAI, model_dir: Path) -> None:
    engine = srv.server.lifecycle.engine
    first_pid = engine.pid
    failed = kill_mid_generation(engine, client)
    assert ErrorCode.ENGINE_ERROR.value in str(failed.body)

    # Restarted once, with the latest weights (a call racing the crash's detection fails; later ones wait for it).
    body = call_until(lambda: ask(client, [{"role": "user", "content": "Say yes."}], max_tokens=16, seed=3))
    assert engine.stats.restarts == 1 and engine.pid != first_pid
    assert_matches(served_weights(srv, model_dir), body)

    # Killed again: the engine is down; every call fails at once, saying why.
    os.kill(engine.pid, signal.SIGKILL)
    assert until_refused(client, "down").code == ErrorCode.ENGINE_ERROR.value


def kill_mid_generation(engine, client: openai.OpenAI) -> openai.APIError:
    """SIGKILL vLLM while a streamed reply is running on it; that reply's error.

    vLLM is paused first (its own dev route), so the reply cannot finish before the kill lands, however the two
    busy cores schedule the processes.
    """
    assert httpx.post(f"{engine.url}/pause", params={"mode": "keep"}).status_code == 200
    errors: list[Exception] = []

    def read_stream() -> None:
        try:
            list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=50, stream=True))
        except openai.APIError as exc:
            errors.append(exc)

    reader = threading.Thread(target=read_stream)
    reader.start()
    deadline = time.monotonic() + 60
    while engine.running_requests < 1:
        assert reader.is_alive() and time.monotonic() < deadline, "the call never reached the engine"
        time.sleep(0.01)
    os.kill(engine.pid, signal.SIGKILL)
    reader.join(timeout=60)
    assert len(errors) == 1, "the stream did not fail"
    return errors[0]


def until_refused(client: openai.OpenAI, saying: str, timeout: float = 60) -> openai.InternalServerError:
    """Ask until a call fails with a 500 whose body says `saying` (a call racing a crash's detection may fail
    otherwise first); that error."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            ask(client, [{"role": "user", "content": "Say yes."}], max_tokens=4)
        except openai.InternalServerError as exc:
            if saying in str(exc.body):
                return exc
        assert time.monotonic() < deadline, f"the engine never refused saying {saying!r}"
        time.sleep(0.2)


def call_until(call, timeout: float = START_TIMEOUT_S):
    """`call()` once it stops failing with an engine error (a call racing the crash's detection fails at once)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except openai.InternalServerError:
            assert time.monotonic() < deadline, "the vLLM engine did not come back"
            time.sleep(0.5)
