"""`marl.client.SwarmClient` against the REAL server app (`servers.entrypoint.build_app`) over stub backends.

Every protocol behaviour (auth, engine states, temporary refusals with `retry_after_s`, leases and their holders,
config sync) is the real server's, served by uvicorn on 127.0.0.1 (tests/stubs.py); only the engine and the trainer
are stubs, so a test runs in milliseconds and can hold the server in BOOTING or WEIGHT_SYNCING at will.

Three purpose-built misbehaving peers cover what a correct server never does, each named as such:
`NonProtocolServer` (bodies outside the protocol), `HangUpServer` (a raw socket that drops the connection after
reading the request) and `FlakyTransport` (the client's real transport to the real app, with transport errors
injected before the request is sent, or after the server has answered it).
"""

from __future__ import annotations

import logging
import math
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from conftest import ADMIN
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import ValidationError
from stubs import REPLY_TEXT, AppServer, StubServer, recorded_episodes, stub_server

from marl.client import EpisodeOutput, SwarmClient, SwarmError, SwarmRefused, SwarmTimeout
from marl.protocol import (
    ADMIN_TOKEN_ENV,
    AGENT_HEADER,
    ROUTE_ABORT,
    ROUTE_BEGIN,
    ROUTE_CONFIG,
    ROUTE_END,
    ROUTE_RENEW,
    ROUTE_START,
    ROUTE_STATUS,
    ROUTE_STOP,
    RUNNING_STATES,
    EngineState,
    ErrorCode,
    ErrorInfo,
    TrainConfig,
)
from marl.runner.launch import free_port

pytestmark = [pytest.mark.serial, pytest.mark.timeout(60)]

AGENTJET_CONFIG = {"batch_size": 2, "num_repeat": 2, "learning_rate": 3e-5}  # AgentJet's flat call style


# --------------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture
def server(tiny_model, tmp_path) -> Iterator[StubServer]:
    """A fresh real server (OFFLINE, own data dir) over stub backends."""
    with stub_server(tiny_model, tmp_path / "server") as srv:
        yield srv


@pytest.fixture(scope="module")
def idle_server(tiny_model, tmp_path_factory) -> Iterator[StubServer]:
    """One real server shared by tests that never change its state (auth, arguments refused before sending)."""
    with stub_server(tiny_model, tmp_path_factory.mktemp("idle-server")) as srv:
        yield srv


@pytest.fixture
def client(server: StubServer) -> Iterator[SwarmClient]:
    with SwarmClient(server.url, ADMIN, timeout=5.0, max_wait_s=10.0) as c:
        yield c


def rolling(client: SwarmClient, **config: Any) -> None:
    """Start the engine with a config that never fills a batch unless the test says otherwise."""
    client.auto_sync_train_config_and_start_engine({"batch_size": 100, "num_repeat": 2, **config})


def chat(episode: Any, agent: str | None = None) -> str:
    reply = episode.openai(agent=agent, max_retries=0).chat.completions.create(
        model=episode.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    return reply.choices[0].message.content


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
    """Poll `condition` until it returns something truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


def wait_state(client: SwarmClient, state: EngineState) -> None:
    wait_for(lambda: client.status().state is state, f"engine {state.value}")


def fill_the_batch(client: SwarmClient) -> None:
    """With batch_size=1 and num_repeat=1: one episode with a call completes the batch."""
    with client.episode("full") as ep:
        chat(ep)
        ep.reward = 1.0


def after(seconds: float, action: Callable[[], Any]) -> threading.Timer:
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


# --------------------------------------------------------------------------------------------------------------
# Auth and basic control plane
# --------------------------------------------------------------------------------------------------------------


def test_health_needs_no_token(idle_server: StubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    with SwarmClient(idle_server.url) as c:
        assert c.health()
    with SwarmClient(f"http://127.0.0.1:{free_port()}") as c:
        assert not c.health(timeout=1.0)


def test_missing_token_is_refused_with_a_clear_message(
    idle_server: StubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    with SwarmClient(idle_server.url) as c, pytest.raises(SwarmRefused) as info:
        c.status()
    assert info.value.status_code == 401
    assert info.value.code is ErrorCode.UNAUTHORIZED and info.value.code == "unauthorized"  # a str enum
    assert "no admin token" in str(info.value) and ADMIN_TOKEN_ENV in str(info.value)


def test_wrong_token_is_refused_without_retry(idle_server: StubServer) -> None:
    before = idle_server.log.count(ROUTE_BEGIN)
    start = time.monotonic()
    with SwarmClient(idle_server.url, "bad-t0ken-xyz") as c, pytest.raises(SwarmRefused) as info:
        c.begin_episode()
    assert time.monotonic() - start < 1.0
    assert idle_server.log.count(ROUTE_BEGIN) == before + 1
    assert info.value.code is ErrorCode.UNAUTHORIZED and "rejected" in str(info.value)
    assert "bad-t0ken-xyz" not in str(info.value)  # never echo a token


def test_token_from_environment(idle_server: StubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN)
    with SwarmClient(idle_server.url) as c:
        assert c.status().state is EngineState.OFFLINE
        pool = c.pool()
        assert pool.running_leases == 0 and pool.batch_size == TrainConfig().batch_size


def test_sync_train_config_validates_locally(client: SwarmClient, server: StubServer) -> None:
    with pytest.raises(ValidationError, match="batch_sise"):
        client.sync_train_config({"batch_sise": 8})
    assert server.log.count(ROUTE_CONFIG) == 0
    resp = client.sync_train_config({"batch_size": 8})
    assert resp.changed and resp.config.batch_size == 8 and client.status().pool.batch_size == 8
    assert not client.sync_train_config(TrainConfig(batch_size=8)).changed


def test_start_twice_and_stop(client: SwarmClient, server: StubServer) -> None:
    client.start_engine()
    with pytest.raises(SwarmRefused, match="already started") as info:
        client.start_engine()
    assert info.value.code is ErrorCode.ENGINE_NOT_OFFLINE and info.value.status_code == 409
    client.wait_until_state()
    assert client.stop_engine().state is EngineState.OFFLINE
    with pytest.raises(SwarmRefused, match="auto_sync_train_config_and_start_engine") as info:
        client.begin_episode()
    assert info.value.code is ErrorCode.ENGINE_NOT_ROLLING and info.value.state is EngineState.OFFLINE


def test_a_wrong_base_url_is_named_as_such(idle_server: StubServer) -> None:
    with SwarmClient(f"{idle_server.url}/v1", ADMIN) as client:  # the OpenAI base URL, not the server's root
        with pytest.raises(SwarmRefused, match="no such route") as info:
            client.status()
    assert info.value.code is ErrorCode.ROUTE_NOT_FOUND and info.value.status_code == 404


def test_bad_url_and_arguments() -> None:
    with pytest.raises(ValueError, match="http"):
        SwarmClient("localhost:8000")
    with pytest.raises(ValueError, match="timeout"):
        SwarmClient("http://localhost:8000", timeout=0)


# --------------------------------------------------------------------------------------------------------------
# Waiting, retrying, timing out
# --------------------------------------------------------------------------------------------------------------


def test_begin_retries_while_every_slot_is_taken(client: SwarmClient, server: StubServer) -> None:
    rolling(client, max_leases=1)
    holder = SwarmClient(server.url, ADMIN)
    held, _ = holder.begin_episode()
    after(0.3, lambda: holder.abort_episode(held))  # frees the only slot while the begin below waits
    start = time.monotonic()
    episode_id, lease = client.begin_episode(timeout=10)
    assert time.monotonic() - start >= 0.3
    assert server.log.count(ROUTE_BEGIN) >= 3  # the holder's, then this one's refused (no_free_slot) and granted
    assert lease.episode_id == episode_id and lease.model == "tiny" and lease.base_url == f"{server.url}/v1"
    assert [info.client_id for info in client.pool().leases] == [client.client_id]
    holder.close()


def test_begin_times_out_naming_the_state(client: SwarmClient, server: StubServer) -> None:
    rolling(client, batch_size=1, num_repeat=1)
    client.begin_episode()  # held open: once the batch is complete the engine drains it in ROLLING_POST
    fill_the_batch(client)
    wait_state(client, EngineState.ROLLING_POST)
    begins = server.log.count(ROUTE_BEGIN)
    start = time.monotonic()
    with pytest.raises(SwarmTimeout) as info:
        client.begin_episode(timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 3.0
    err = info.value
    assert err.last_state is EngineState.ROLLING_POST and err.what == "begin_episode" and err.status_code == 503
    assert err.code is ErrorCode.ENGINE_NOT_ROLLING and err.waited_s >= 0.3
    assert "ROLLING_POST" in str(err) and "timeout=" in str(err)
    assert isinstance(err, SwarmError) and isinstance(err, TimeoutError)
    assert server.log.count(ROUTE_BEGIN) - begins >= 2  # it did retry meanwhile


def test_begin_and_auto_sync_wait_through_a_weight_sync(client: SwarmClient, server: StubServer) -> None:
    server.backends.step_gate.clear()  # the training step runs until the gate opens
    rolling(client, batch_size=1, num_repeat=1)
    fill_the_batch(client)
    wait_state(client, EngineState.WEIGHT_SYNCING)
    # the same config while training: nothing to do, nothing restarted
    same = {"batch_size": 1, "num_repeat": 1}
    assert client.auto_sync_train_config_and_start_engine(same).state is EngineState.WEIGHT_SYNCING
    assert server.log.count(ROUTE_START) == 1
    after(0.3, server.backends.step_gate.set)
    _, lease = client.begin_episode(timeout=10)  # told to wait (503) until the new weights serve
    assert lease.policy_version == 1 and client.status().policy_version == 1
    assert [len(batch.groups) for batch in server.backends.trainers[0].batches] == [1]


def test_unreachable_server_times_out() -> None:
    with SwarmClient(f"http://127.0.0.1:{free_port()}", ADMIN) as c:
        start = time.monotonic()
        with pytest.raises(SwarmTimeout, match="could not reach") as info:
            c.status(timeout=0.3)
        assert time.monotonic() - start < 2.0
        assert isinstance(info.value.__cause__, httpx.ConnectError) and info.value.status_code is None


def test_wait_until_state(client: SwarmClient, server: StubServer) -> None:
    server.backends.boot_gate.clear()
    client.start_engine()
    with pytest.raises(SwarmTimeout, match="still BOOTING") as info:
        client.wait_until_state(EngineState.ROLLING, timeout=0.2)
    assert info.value.last_state is EngineState.BOOTING
    after(0.2, server.backends.boot_gate.set)
    assert client.wait_until_state("rolling", timeout=10).state is EngineState.ROLLING
    with pytest.raises(ValueError, match="unknown engine state"):
        client.wait_until_state("RUNNING")


def test_error_codes_and_pickling() -> None:
    err = SwarmTimeout("msg", waited_s=1.5, last_state=EngineState.BOOTING, status_code=503, what="begin_episode")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == "msg" and back.last_state is EngineState.BOOTING and back.status_code == 503
    refused = SwarmRefused("no", status_code=404, error=ErrorInfo(message="x", code="episode_not_found"))
    back = pickle.loads(pickle.dumps(refused))
    assert back.error.message == "x" and back.code is ErrorCode.EPISODE_NOT_FOUND
    assert SwarmRefused("no", error=ErrorInfo(message="x", code="teapot")).code == "teapot"  # unknown: kept as is
    assert SwarmError("no").code is None


# --------------------------------------------------------------------------------------------------------------
# Peers that do not speak the protocol, or drop the connection
# --------------------------------------------------------------------------------------------------------------


class NonProtocolServer(AppServer):
    """A purpose-built misbehaving server: answers with bodies outside the protocol (what a proxy or an unrelated
    web app sends). It has no /control/pool route at all, so FastAPI answers that with its own 404."""

    def __init__(self) -> None:
        app = FastAPI()

        @app.get(ROUTE_STATUS)
        async def status() -> dict:
            return {"unexpected": True}

        @app.post(ROUTE_STOP)
        async def stop() -> PlainTextResponse:
            return PlainTextResponse("boom", status_code=500)

        super().__init__(app)


def test_non_protocol_bodies() -> None:
    with NonProtocolServer() as peer, SwarmClient(peer.url, ADMIN, timeout=5.0) as client:
        with pytest.raises(SwarmRefused, match="same version") as info:
            client.pool()
        assert info.value.code is ErrorCode.ROUTE_NOT_FOUND and info.value.status_code == 404
        with pytest.raises(SwarmError, match="not a ServerStatus"):
            client.status()
        with pytest.raises(SwarmError, match="boom") as info:
            client.stop_engine()
        assert info.value.status_code == 500 and not isinstance(info.value, SwarmRefused)


class HangUpServer:
    """A purpose-built misbehaving server (a raw socket): reads each request, then closes without answering."""

    def __init__(self) -> None:
        self._socket = socket.create_server(("127.0.0.1", 0))
        self._socket.settimeout(0.05)  # closing a socket does not wake an accept(): poll the stop flag instead
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self.requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._socket.accept()
            except TimeoutError:
                continue
            conn.settimeout(5)
            with conn:
                if self._read_request(conn):
                    self.requests += 1

    @staticmethod
    def _read_request(conn: socket.socket) -> bytes:
        """The whole request (headers and Content-Length body): closing with unread bytes would send a reset."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return data
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length and (chunk := conn.recv(65536)):
            body += chunk
        return data

    def __enter__(self) -> HangUpServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close()


def test_a_connection_dropped_after_sending(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("marl.client.core._TRANSPORT_RETRY_S", 0.01)
    with HangUpServer() as peer, SwarmClient(peer.url, ADMIN, timeout=2.0) as client:
        with pytest.raises(SwarmTimeout, match="could not reach"):
            client.end_episode("t", "e1", 1.0, timeout=0.3)  # an end is idempotent: retried until its timeout
        assert peer.requests >= 2
        with pytest.raises(SwarmTimeout, match="could not reach") as timeout:
            client.status(timeout=0.3)  # idempotent: retried until its timeout
        assert isinstance(timeout.value.__cause__, httpx.RemoteProtocolError) and peer.requests >= 3


@dataclass
class Fault:
    error: type[httpx.TransportError]
    times: int
    after_send: bool


class FlakyTransport(httpx.BaseTransport):
    """The client's real transport to the real server, with transport errors injected by path: before sending
    (the server never sees the request) or after the server has answered (it acted; the answer is lost)."""

    def __init__(self) -> None:
        self._real = httpx.HTTPTransport()
        self._faults: dict[str, Fault] = {}
        self.attempts: dict[str, int] = {}

    def fail(self, path: str, error: type[httpx.TransportError], *, times: int = 1, after_send: bool = False) -> None:
        self._faults[path] = Fault(error, times, after_send)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.attempts[path] = self.attempts.get(path, 0) + 1
        fault = self._faults.get(path)
        if fault is None or fault.times <= 0:
            return self._real.handle_request(request)
        fault.times -= 1
        if fault.after_send:
            response = self._real.handle_request(request)
            response.read()
            response.close()
        raise fault.error(f"injected {fault.error.__name__}", request=request)

    def close(self) -> None:
        self._real.close()


def flaky(client: SwarmClient) -> FlakyTransport:
    """Route the client's requests through a `FlakyTransport` (its own is replaced; headers are kept)."""
    transport = FlakyTransport()
    old = client._http
    client._http = httpx.Client(base_url=client.url, headers=old.headers, timeout=old.timeout, transport=transport)
    old.close()
    return transport


def test_transport_errors_retried_only_when_safe(
    client: SwarmClient, server: StubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("marl.client.core._TRANSPORT_RETRY_S", 0.01)
    rolling(client)
    transport = flaky(client)
    transport.fail(ROUTE_STATUS, httpx.ReadTimeout, times=2)
    assert client.status().state is EngineState.ROLLING and transport.attempts[ROUTE_STATUS] == 3  # GET: retried
    transport.fail(ROUTE_BEGIN, httpx.RemoteProtocolError, after_send=True)
    episode_id, _ = client.begin_episode()  # begin: retried (the orphaned first lease just expires)
    assert server.log.count(ROUTE_BEGIN) == 2 and client.pool().running_leases == 2

    end_path = ROUTE_END.format(episode_id=episode_id)
    transport.fail(end_path, httpx.ReadTimeout, after_send=True)
    result = client.end_episode("t", episode_id, 1.0)  # the server recorded it; the retry gets the stored outcome
    assert result.replayed and transport.attempts[end_path] == 2
    assert not client.can_continue_episode(episode_id)
    assert [e["episode_id"] for e in recorded_episodes(server.data_dir)] == [episode_id]

    episode_id, _ = client.begin_episode()
    abort_path = ROUTE_ABORT.format(episode_id=episode_id)
    transport.fail(abort_path, httpx.ConnectError)  # never sent: safe to retry
    assert client.abort_episode(episode_id).disposition == "requeued"
    assert transport.attempts[abort_path] == 2 and server.log.count(ROUTE_ABORT) == 1


# --------------------------------------------------------------------------------------------------------------
# auto_sync_train_config_and_start_engine
# --------------------------------------------------------------------------------------------------------------


def test_auto_sync_seed_style_config_starts_once(client: SwarmClient, server: StubServer) -> None:
    st = client.auto_sync_train_config_and_start_engine(AGENTJET_CONFIG, timeout=10)
    assert st.state is EngineState.ROLLING and st.state in RUNNING_STATES
    assert server.log.count(ROUTE_START) == 1
    trainer_config = server.backends.trainers[-1].config  # what the server built its trainer with
    assert (trainer_config.batch_size, trainer_config.num_repeat) == (2, 2)
    assert trainer_config.grpo.learning_rate == pytest.approx(3e-5)
    # Idempotent, whichever way the same config is spelled and whichever client asks: nothing restarts.
    nested = {"batch_size": 2, "num_repeat": 2, "grpo": {"learning_rate": 3e-5}}
    for c, config in [(client, AGENTJET_CONFIG), (SwarmClient(server.url, ADMIN), TrainConfig(**AGENTJET_CONFIG)),
                      (SwarmClient(server.url, ADMIN), nested)]:
        assert c.auto_sync_train_config_and_start_engine(config).generation == st.generation
    assert server.log.count(ROUTE_START) == 1 and len(server.backends.trainers) == 1


@pytest.mark.parametrize("different", [{"batch_size": 3, "num_repeat": 2, "learning_rate": 3e-5},
                                       {"batch_size": 2, "num_repeat": 2, "grpo": {"learning_rate": 1e-3}}])
def test_auto_sync_refuses_a_different_config_while_running(
    client: SwarmClient, server: StubServer, different: dict
) -> None:
    client.auto_sync_train_config_and_start_engine(AGENTJET_CONFIG)
    with pytest.raises(SwarmRefused, match="stop_engine") as info:
        client.auto_sync_train_config_and_start_engine(different)
    err = info.value
    assert err.status_code == 409 and err.code is ErrorCode.ENGINE_NOT_OFFLINE and "different train config" in str(err)
    assert server.log.count(ROUTE_START) == 1
    assert not client.sync_train_config(AGENTJET_CONFIG).changed  # the server still runs the first config
    with pytest.raises(SwarmRefused, match="runs a different config") as info:
        client.sync_train_config(different)  # the plain call says the same
    assert info.value.code is ErrorCode.ENGINE_NOT_OFFLINE


def test_auto_sync_waits_for_booting(client: SwarmClient, server: StubServer) -> None:
    server.backends.boot_gate.clear()
    with SwarmClient(server.url, ADMIN) as other:
        other.start_engine()  # another client started it: this one finds it BOOTING
    assert client.status().state is EngineState.BOOTING
    after(0.3, server.backends.boot_gate.set)
    assert client.auto_sync_train_config_and_start_engine(timeout=10).state is EngineState.ROLLING
    assert server.log.count(ROUTE_START) == 1


@pytest.mark.parametrize("boot_s", [0.0, 0.3])  # fails at once, or after a while in BOOTING
def test_auto_sync_reports_a_failed_boot(client: SwarmClient, server: StubServer, boot_s: float) -> None:
    server.backends.boot_error = "CUDA out of memory"
    if boot_s:
        server.backends.boot_gate.clear()
        after(boot_s, server.backends.boot_gate.set)
    with pytest.raises(SwarmError, match="CUDA out of memory"):
        client.auto_sync_train_config_and_start_engine(timeout=10)
    assert server.log.count(ROUTE_START) == 1  # a failing boot is never restarted in a loop


def test_a_static_server_is_not_trained(tiny_model, tmp_path) -> None:
    with stub_server(tiny_model, tmp_path / "static", static=True) as static, \
            SwarmClient(static.url, ADMIN, timeout=5.0) as client:
        client.wait_until_state(EngineState.STATIC, timeout=10)
        with pytest.raises(SwarmRefused, match="STATIC") as info:
            client.auto_sync_train_config_and_start_engine()
        assert info.value.code is ErrorCode.STATIC_SERVER
        assert static.log.count(ROUTE_CONFIG) == 0 and static.log.count(ROUTE_START) == 0
        with pytest.raises(SwarmRefused, match="no leases") as info:
            client.begin_episode()
        assert info.value.code is ErrorCode.STATIC_SERVER and info.value.status_code == 409


# --------------------------------------------------------------------------------------------------------------
# Episodes
# --------------------------------------------------------------------------------------------------------------


@dataclass
class AgentJetTask:  # AgentJet's Task: `task_id`, plus data
    task_id: str
    main_query: str = "2+2?"


@dataclass
class AgentJetWorkflowOutput:  # AgentJet's WorkflowOutput: reward, is_success, metadata
    reward: float | None
    is_success: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


class IdTask:
    id = 7


def test_end_episode_argument_forms(client: SwarmClient, server: StubServer) -> None:
    rolling(client)
    forms = [
        ("t-str", 1.0),
        ("t-int", 2),
        (AgentJetTask("t-seed"), AgentJetWorkflowOutput(reward=0.5, is_success=True, metadata={"answer": "4"})),
        (IdTask(), EpisodeOutput(0.25, agent_rewards={"solver": 1.0}, metadata={"obj": object(), "x": math.inf})),
        ({"task_id": "t-map"}, {"reward": -1.0, "agent_rewards": {"a": 0}}),
        ({"id": "t-map-id"}, EpisodeOutput(reward=0.0)),
    ]
    for task, output in forms:
        episode_id, _ = client.begin_episode()
        resp = client.end_episode(task, episode_id, output)
        # no model call: nothing to train on (an agent named in agent_rewards gets an empty sample for its group)
        named = output.get("agent_rewards") if isinstance(output, dict) else getattr(output, "agent_rewards", None)
        assert resp.episode_id == episode_id and resp.samples == len(named or {}) and resp.trainable_tokens == 0
    stored = recorded_episodes(server.data_dir)
    assert [(e["task_id"], e["reward"], e["agent_rewards"]) for e in stored] == [
        ("t-str", 1.0, None), ("t-int", 2.0, None), ("t-seed", 0.5, None), ("7", 0.25, {"solver": 1.0}),
        ("t-map", -1.0, {"a": 0.0}), ("t-map-id", 0.0, None),
    ]
    assert stored[2]["metadata"] == {"answer": "4"}
    assert stored[3]["metadata"]["x"] is None and stored[3]["metadata"]["obj"].startswith("<object")
    assert all(e["client_id"] == client.client_id for e in stored)


@pytest.mark.parametrize(
    ("task", "output", "error", "match"),
    [
        ("t", None, TypeError, "reward"),
        ("t", "high", TypeError, "reward"),
        ("t", True, TypeError, "reward"),
        ("t", math.nan, ValueError, "finite"),
        ("t", AgentJetWorkflowOutput(reward=None), ValueError, "abort_episode"),
        ("t", EpisodeOutput(1.0, agent_rewards={"a": math.inf}), ValueError, "finite"),
        (object(), 1.0, TypeError, "task_id"),
        ("", 1.0, ValueError, "empty"),
        ({"name": "x"}, 1.0, TypeError, "task_id"),
    ],
)
def test_end_episode_bad_arguments_fail_before_sending(
    idle_server: StubServer, task: Any, output: Any, error: type[Exception], match: str
) -> None:
    with SwarmClient(idle_server.url, ADMIN) as client, pytest.raises(error, match=match):
        client.end_episode(task, "e-unknown", output)
    assert idle_server.log.count(ROUTE_END) == 0


def test_end_and_commit_replies_carry_the_pool_only_when_asked(client: SwarmClient, server: StubServer) -> None:
    rolling(client)
    episode_id, _ = client.begin_episode()
    assert client.end_episode("t", episode_id, 1.0).pool is None  # the server skipped the pool's ledger reads
    episode_id, _ = client.begin_episode()
    assert client.end_episode("t", episode_id, 1.0, include_pool=True).pool.batch_size == 100
    assert client.end_episode("t", episode_id, 1.0).replayed  # the same end: asking is no part of the body
    for include_pool in (False, True):
        episode_id, _ = client.begin_episode()
        client.prepare_episode("t", episode_id, 1.0, game_id=f"game-{include_pool}")
        assert (client.commit_episode(episode_id, include_pool=include_pool).pool is not None) is include_pool


def test_end_abort_renew_and_can_continue(client: SwarmClient, server: StubServer) -> None:
    rolling(client)
    episode_id, _ = client.begin_episode()
    assert client.can_continue_episode(episode_id)
    assert client.renew_episode(episode_id).can_continue
    with SwarmClient(server.url, ADMIN, client_id="someone-else") as other:
        with pytest.raises(SwarmRefused, match="held by another client") as info:
            other.end_episode("t", episode_id, 1.0)
        assert info.value.status_code == 403 and info.value.code is ErrorCode.NOT_LEASE_HOLDER
        assert "'someone-else'" in str(info.value)
        with pytest.raises(SwarmRefused) as info:
            other.renew_episode(episode_id)
        assert info.value.code is ErrorCode.NOT_LEASE_HOLDER
    assert client.abort_episode(episode_id).disposition == "requeued"
    assert not client.can_continue_episode(episode_id)
    assert client.abort_episode(episode_id) is None  # already gone: nothing to do
    with pytest.raises(SwarmRefused) as info:
        client.abort_episode(episode_id, missing_ok=False)
    assert info.value.code is ErrorCode.EPISODE_NOT_FOUND
    with pytest.raises(SwarmRefused, match="expired") as info:
        client.end_episode("t", episode_id, 1.0)
    assert info.value.status_code == 404 and info.value.code is ErrorCode.EPISODE_NOT_FOUND
    assert "heartbeat_s" in str(info.value)
    assert recorded_episodes(server.data_dir) == [] and client.pool().requeued == 1


def test_episode_context_manager_ends_with_reward(client: SwarmClient, server: StubServer) -> None:
    rolling(client)
    with client.episode(AgentJetTask("t1")) as ep:
        assert [info.episode_id for info in client.pool().leases] == [ep.episode_id]
        assert ep.model == "tiny" and ep.base_url == f"{server.url}/v1" and ep.task_id == "t1"
        assert chat(ep, agent="solver") == REPLY_TEXT
        ep.reward = 0.75
        ep.metadata["turns"] = 3
    assert ep.result is not None and ep.result.samples == 1 and ep.done and not ep.aborted
    stored = recorded_episodes(server.data_dir)
    assert [(e["task_id"], e["reward"], e["metadata"], e["agents"]) for e in stored] == [
        ("t1", 0.75, {"turns": 3}, ["solver"])]
    assert client.pool().running_leases == 0


def test_episode_context_manager_aborts_on_exception(client: SwarmClient, server: StubServer) -> None:
    rolling(client)
    with pytest.raises(ZeroDivisionError):
        with client.episode("t1") as ep:
            ep.reward = 1.0
            1 / 0  # noqa: B018
    assert ep.aborted and server.log.count(ROUTE_ABORT) == 1 and server.log.count(ROUTE_END) == 0
    pool = client.pool()
    assert pool.requeued == 1 and pool.running_leases == 0 and recorded_episodes(server.data_dir) == []


def test_episode_context_manager_explicit_end_and_missing_reward(
    client: SwarmClient, server: StubServer, caplog: pytest.LogCaptureFixture
) -> None:
    rolling(client)
    with client.episode("t1") as ep:
        ep.end(EpisodeOutput(1.0, agent_rewards={"a": 0.0}))
    assert [e["agent_rewards"] for e in recorded_episodes(server.data_dir)] == [{"a": 0.0}]
    with caplog.at_level(logging.WARNING, logger="marl.client"), client.episode("t2") as ep2:
        pass
    assert ep2.aborted and "without a reward" in caplog.text and server.log.count(ROUTE_ABORT) == 1
    begins = server.log.count(ROUTE_BEGIN)
    with pytest.raises(TypeError, match="task_id"):
        client.episode(object())  # fails before claiming a lease
    assert server.log.count(ROUTE_BEGIN) == begins and client.pool().running_leases == 0


def test_episode_abort_failure_never_masks_the_body_error(
    client: SwarmClient, server: StubServer, caplog: pytest.LogCaptureFixture
) -> None:
    rolling(client)
    transport = flaky(client)
    with caplog.at_level(logging.WARNING, logger="marl.client"), pytest.raises(KeyError, match="body"):
        with client.episode("t1") as ep:
            transport.fail(ROUTE_ABORT.format(episode_id=ep.episode_id), httpx.RemoteProtocolError, after_send=True)
            raise KeyError("body")
    assert f"abort of episode {ep.episode_id} failed" in caplog.text and "may or may not" in caplog.text


def test_episode_heartbeat_renews(client: SwarmClient, server: StubServer) -> None:
    rolling(client)
    with client.episode("t1", heartbeat_s=0.03) as ep:
        wait_for(lambda: server.log.count(ROUTE_RENEW) >= 2, "two heartbeats")
        ep.reward = 1.0
    assert len(recorded_episodes(server.data_dir)) == 1
    renewals = server.log.count(ROUTE_RENEW)
    time.sleep(0.1)
    assert server.log.count(ROUTE_RENEW) == renewals  # the heartbeat stopped with the episode


def test_openai_clients_are_bound_to_the_lease(client: SwarmClient, server: StubServer) -> None:
    rolling(client)
    with client.episode("t1") as ep:
        oai = ep.openai(agent="werewolf")
        assert str(oai.base_url).rstrip("/") == ep.base_url and oai.api_key == ep.api_key
        assert oai.default_headers[AGENT_HEADER] == "werewolf"
        oai.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        plain = client.openai_client(ep.lease, max_retries=0)
        assert AGENT_HEADER not in plain.default_headers and plain.max_retries == 0
        aoai = client.async_openai_client(ep.lease, agent="seer")
        assert aoai.default_headers[AGENT_HEADER] == "seer"
        with pytest.raises(TypeError, match="tuple"):
            client.openai_client((ep.episode_id, ep.lease))  # type: ignore[arg-type]
        ep.reward = 0.0
    assert recorded_episodes(server.data_dir)[0]["agents"] == ["werewolf"]  # the tag reached the server


def test_begin_from_many_threads(client: SwarmClient, server: StubServer) -> None:
    rolling(client, max_leases=4)
    release = threading.Event()

    def play(i: int) -> str:
        episode_id, _ = client.begin_episode(timeout=20)
        release.wait(20)  # the first 4 hold their slots, so the other 4 are told to wait
        client.end_episode(f"t{i % 2}", episode_id, float(i))
        return episode_id

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(play, i) for i in range(8)]
        wait_for(lambda: client.pool().running_leases == 4 and server.log.count(ROUTE_BEGIN) >= 8, "4 held, 4 waiting")
        release.set()
        ids = [f.result() for f in futures]
    assert len(set(ids)) == 8 and server.log.count(ROUTE_BEGIN) >= 12  # each waiter asked at least twice
    stored = recorded_episodes(server.data_dir)
    assert sorted(e["reward"] for e in stored) == [float(i) for i in range(8)]
    assert client.pool().running_leases == 0


def test_package_exports() -> None:
    import marl.client

    assert marl.SwarmClient is SwarmClient and marl.EpisodeOutput is EpisodeOutput
    assert marl.SwarmError is SwarmError and marl.SwarmRefused is SwarmRefused and marl.SwarmTimeout is SwarmTimeout
    assert marl.TrainConfig is TrainConfig and marl.ErrorCode is ErrorCode
    assert marl.ADMIN_TOKEN_ENV == marl.client.ADMIN_TOKEN_ENV == ADMIN_TOKEN_ENV == "MARL_ADMIN_TOKEN"
    assert marl.RUNNING_STATES is marl.client.RUNNING_STATES is RUNNING_STATES
    assert {"ADMIN_TOKEN_ENV", "RUNNING_STATES"} <= set(marl.client.__all__)
    with pytest.raises(AttributeError):
        marl.nope  # noqa: B018


def test_a_client_shared_by_many_threads_keeps_its_connections() -> None:
    """A pooled connection is never closed for being one of many (httpcore closes idle connections beyond
    `max_keepalive_connections` counted over the whole pool, even one just handed to a waiting thread, whose request
    then hangs until its timeout: encode/httpcore#1110). So a second wave of as many concurrent calls reuses the
    first wave's connections: the server accepts no new one."""
    import http.server

    accepted: list[int] = []

    class SlowHealth(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive

        def setup(self) -> None:
            super().setup()
            accepted.append(1)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            time.sleep(0.3)  # every call of a wave is in flight at once
            body = b'{"status": "ok"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    threads = 40
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowHealth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with SwarmClient(f"http://127.0.0.1:{server.server_address[1]}", admin_token="unused") as client:
            for _ in range(2):
                with ThreadPoolExecutor(threads) as pool:
                    assert all(pool.map(lambda _: client.health(), range(threads)))
        assert len(accepted) <= threads
    finally:
        server.shutdown()
        server.server_close()
