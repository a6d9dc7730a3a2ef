"""Unit tests of `marl.client.SwarmClient` against a small in-process fake of the swarm server's routes.

The fake (FastAPI + uvicorn on 127.0.0.1, in a thread) implements just enough of the protocol to drive the client:
auth, engine states, temporary refusals with `retry_after_s`, leases held by a client id. The real server's tests
live elsewhere.
"""

from __future__ import annotations

import collections
import logging
import math
import pickle
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

import marl
from marl.client import EpisodeOutput, SwarmClient, SwarmError, SwarmRefused, SwarmTimeout
from marl.protocol import (
    AGENT_HEADER,
    ROUTE_ABORT,
    ROUTE_BEGIN,
    ROUTE_CONFIG,
    ROUTE_END,
    ROUTE_EPISODE,
    ROUTE_HEALTH,
    ROUTE_POOL,
    ROUTE_RENEW,
    ROUTE_START,
    ROUTE_STATUS,
    ROUTE_STOP,
    AbortEpisodeResponse,
    BeginEpisodeRequest,
    ClientRequest,
    ConfigResponse,
    EndEpisodeRequest,
    EndEpisodeResponse,
    EngineState,
    EpisodeLease,
    EpisodeState,
    ErrorInfo,
    ErrorResponse,
    PoolInfo,
    ServerStatus,
    TrainConfig,
)

pytestmark = pytest.mark.timeout(30)

TOKEN = "test-admin-token"
WAIT_S = 0.01  # retry_after_s of the fake's temporary refusals: keeps the tests fast


# --------------------------------------------------------------------------------------------------------------
# The fake server
# --------------------------------------------------------------------------------------------------------------


class Refusal(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, retry_after_s: float | None = None,
                 state: EngineState | None = None) -> None:
        self.status = status
        self.info = ErrorInfo(message=message, code=code, retry_after_s=retry_after_s, state=state)


class Fake:
    """Mutable state of the fake server; the tests set it up and read what the client sent."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.state = EngineState.OFFLINE
        self.config = TrainConfig()
        self.calls: collections.Counter[str] = collections.Counter()
        self.begin_waits = 0  # temporary refusals (no free slot) before the next begin is granted
        self.boot_polls = 2  # status polls spent in BOOTING before ROLLING
        self.boot_error: str | None = None  # if set, BOOTING falls back to OFFLINE with this error
        self.last_error: str | None = None
        self.leases: dict[str, str] = {}  # episode_id -> client_id
        self.ended: list[EndEpisodeRequest] = []
        self.aborted: list[str] = []
        self.agent_headers: list[str | None] = []

    def pool(self) -> PoolInfo:
        return PoolInfo(
            batch_size=self.config.batch_size, num_repeat=self.config.num_repeat, complete_groups=0,
            pending_episodes=len(self.ended), running_leases=len(self.leases), free_slots=8, requeued=0,
            discarded=0, expired=0,
        )

    def status(self) -> ServerStatus:
        return ServerStatus(
            state=self.state, model="tiny", policy_version=0, generation=1, step=0,
            static=self.state is EngineState.STATIC, pool=self.pool(), last_error=self.last_error,
        )

    def lease_of(self, episode_id: str, client_id: str) -> None:
        if episode_id not in self.leases:
            raise Refusal(404, f"episode {episode_id} is unknown or expired", code="episode_not_found")
        if self.leases[episode_id] != client_id:
            raise Refusal(403, f"episode {episode_id} is held by another client", code="not_lease_holder")


def make_app(fake: Fake) -> FastAPI:
    app = FastAPI()

    @app.exception_handler(Refusal)
    async def _refusal(request: Request, exc: Refusal) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=exc.info).model_dump(mode="json"), status_code=exc.status)

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Any:
        if request.url.path != ROUTE_HEALTH and request.headers.get("authorization") != f"Bearer {TOKEN}":
            info = ErrorInfo(message="missing or wrong admin token", type="authentication_error", code="unauthorized")
            return JSONResponse(ErrorResponse(error=info).model_dump(mode="json"), status_code=401)
        path = request.url.path
        parts = path.strip("/").split("/")
        # episode routes are counted by kind ("end", "abort", "renew", "episode"), others by path
        key = parts[-1] if path != ROUTE_BEGIN and parts[0] == "episodes" and len(parts) == 3 else path
        fake.calls["episode" if path != ROUTE_BEGIN and parts[0] == "episodes" and len(parts) == 2 else key] += 1
        return await call_next(request)

    @app.get(ROUTE_HEALTH)
    async def health() -> dict[str, bool]:
        return {"ok": True}

    @app.post(ROUTE_CONFIG)
    async def config(cfg: TrainConfig) -> ConfigResponse:
        if fake.state is not EngineState.OFFLINE and cfg != fake.config:
            raise Refusal(409, f"engine is {fake.state.value} with another config", code="config_mismatch",
                          state=fake.state)
        changed = cfg != fake.config
        fake.config = cfg
        return ConfigResponse(config=cfg, changed=changed)

    @app.post(ROUTE_START)
    async def start() -> ServerStatus:
        if fake.state is not EngineState.OFFLINE:
            raise Refusal(409, f"engine is {fake.state.value}", code="engine_not_offline", state=fake.state)
        fake.state, fake.last_error = EngineState.BOOTING, None
        return fake.status()

    @app.post(ROUTE_STOP)
    async def stop() -> ServerStatus:
        fake.state = EngineState.OFFLINE
        return fake.status()

    @app.get(ROUTE_STATUS)
    async def status() -> ServerStatus:
        if fake.state is EngineState.BOOTING:
            fake.boot_polls -= 1
            if fake.boot_polls < 0:
                fake.state = EngineState.OFFLINE if fake.boot_error else EngineState.ROLLING
                fake.last_error = fake.boot_error
        return fake.status()

    @app.get(ROUTE_POOL)
    async def pool() -> PoolInfo:
        return fake.pool()

    @app.post(ROUTE_BEGIN)
    async def begin(body: BeginEpisodeRequest, request: Request) -> EpisodeLease:
        if fake.state in (EngineState.OFFLINE, EngineState.STATIC):
            raise Refusal(409, f"engine is {fake.state.value}: no leases", code="engine_offline", state=fake.state)
        if fake.state is not EngineState.ROLLING:
            raise Refusal(503, f"engine is {fake.state.value}", code="engine_busy", retry_after_s=WAIT_S,
                          state=fake.state)
        if fake.begin_waits > 0:
            fake.begin_waits -= 1
            raise Refusal(503, "no free lease slot", code="no_free_slot", retry_after_s=WAIT_S, state=fake.state)
        episode_id = uuid.uuid4().hex
        fake.leases[episode_id] = body.client_id
        base = str(request.base_url).rstrip("/")
        return EpisodeLease(episode_id=episode_id, base_url=f"{base}/v1", api_key=f"key-{episode_id}", model="tiny",
                            generation=1, patience_s=300.0, policy_version=0)

    @app.post(ROUTE_END)
    async def end(episode_id: str, body: EndEpisodeRequest) -> EndEpisodeResponse:
        fake.lease_of(episode_id, body.client_id)
        del fake.leases[episode_id]
        fake.ended.append(body)
        return EndEpisodeResponse(episode_id=episode_id, samples=1, trainable_tokens=3, pool=fake.pool())

    @app.post(ROUTE_ABORT)
    async def abort(episode_id: str, body: ClientRequest) -> AbortEpisodeResponse:
        fake.lease_of(episode_id, body.client_id)
        del fake.leases[episode_id]
        fake.aborted.append(episode_id)
        return AbortEpisodeResponse(episode_id=episode_id, disposition="requeued")

    @app.post(ROUTE_RENEW)
    async def renew(episode_id: str, body: ClientRequest) -> EpisodeState:
        fake.lease_of(episode_id, body.client_id)
        return EpisodeState(episode_id=episode_id, can_continue=True, reason="renewed", state=fake.state)

    @app.get(ROUTE_EPISODE)
    async def episode(episode_id: str, client_id: str) -> EpisodeState:
        fake.lease_of(episode_id, client_id)
        return EpisodeState(episode_id=episode_id, can_continue=True, reason="live", state=fake.state)

    return app


@pytest.fixture(scope="module")
def server() -> Any:
    fake = Fake()
    # port=0: the OS picks a free port. (uvicorn binding the socket itself also gets TCP_NODELAY on accepted
    # connections; a hand-made socket with proto=0 does not, and every keep-alive request then stalls ~40 ms.)
    srv = uvicorn.Server(uvicorn.Config(make_app(fake), host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "fake server did not start"
        time.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield fake, f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=5)


@pytest.fixture
def fake(server: Any) -> Fake:
    server[0].reset()
    return server[0]


@pytest.fixture
def url(server: Any) -> str:
    return server[1]


@pytest.fixture
def client(url: str, fake: Fake) -> Any:
    with SwarmClient(url, TOKEN, timeout=5.0, max_wait_s=5.0) as c:
        yield c


def rolling(fake: Fake) -> Fake:
    fake.state = EngineState.ROLLING
    return fake


def mock_transport(client: SwarmClient, handler: Any) -> None:
    """Swap the client's transport for an in-memory one (to inject transport errors deterministically)."""
    old = client._http
    client._http = httpx.Client(base_url=client.url, headers=old.headers, transport=httpx.MockTransport(handler))
    old.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------------------------
# Auth and basic control plane
# --------------------------------------------------------------------------------------------------------------


def test_health_needs_no_token(url: str, fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MARL_ADMIN_TOKEN", raising=False)
    with SwarmClient(url) as c:
        assert c.health()
    with SwarmClient(f"http://127.0.0.1:{free_port()}") as c:
        assert not c.health(timeout=1.0)


def test_missing_token_is_refused_with_a_clear_message(url: str, fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MARL_ADMIN_TOKEN", raising=False)
    with SwarmClient(url) as c, pytest.raises(SwarmRefused) as info:
        c.status()
    assert info.value.status_code == 401
    assert info.value.code == "unauthorized"
    assert "no admin token" in str(info.value) and "MARL_ADMIN_TOKEN" in str(info.value)


def test_wrong_token_is_refused_without_retry(url: str, fake: Fake) -> None:
    start = time.monotonic()
    with SwarmClient(url, "bad-t0ken-xyz") as c, pytest.raises(SwarmRefused) as info:
        c.begin_episode()
    assert time.monotonic() - start < 1.0
    assert info.value.status_code == 401 and "rejected" in str(info.value)
    assert "bad-t0ken-xyz" not in str(info.value)  # never echo a token


def test_token_from_environment(url: str, fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARL_ADMIN_TOKEN", TOKEN)
    with SwarmClient(url) as c:
        assert c.status().state is EngineState.OFFLINE
        assert c.pool().free_slots == 8


def test_stop_engine(client: SwarmClient, fake: Fake) -> None:
    rolling(fake)
    assert client.stop_engine().state is EngineState.OFFLINE


def test_sync_train_config_validates_locally(client: SwarmClient, fake: Fake) -> None:
    with pytest.raises(ValidationError, match="batch_sise"):
        client.sync_train_config({"batch_sise": 8})
    assert fake.calls[ROUTE_CONFIG] == 0
    resp = client.sync_train_config({"batch_size": 8})
    assert resp.changed and resp.config.batch_size == 8 and fake.config.batch_size == 8
    assert not client.sync_train_config(TrainConfig(batch_size=8)).changed


def test_bad_url_and_arguments() -> None:
    with pytest.raises(ValueError, match="http"):
        SwarmClient("localhost:8000")


# --------------------------------------------------------------------------------------------------------------
# Waiting, retrying, timing out
# --------------------------------------------------------------------------------------------------------------


def test_begin_retries_temporary_refusals(client: SwarmClient, fake: Fake) -> None:
    rolling(fake).begin_waits = 2
    start = time.monotonic()
    episode_id, lease = client.begin_episode()
    assert time.monotonic() - start < 1.0
    assert fake.calls[ROUTE_BEGIN] == 3
    assert lease.episode_id == episode_id and fake.leases[episode_id] == client.client_id
    assert lease.base_url.endswith("/v1") and lease.api_key == f"key-{episode_id}" and lease.model == "tiny"


def test_begin_times_out_naming_the_state(client: SwarmClient, fake: Fake) -> None:
    fake.state = EngineState.ROLLING_POST
    start = time.monotonic()
    with pytest.raises(SwarmTimeout) as info:
        client.begin_episode(timeout=0.3)
    elapsed = time.monotonic() - start
    assert 0.3 <= elapsed < 1.5
    err = info.value
    assert err.last_state is EngineState.ROLLING_POST and err.what == "begin_episode" and err.status_code == 503
    assert "ROLLING_POST" in str(err) and "timeout=" in str(err)
    assert isinstance(err, SwarmError) and isinstance(err, TimeoutError)
    assert fake.calls[ROUTE_BEGIN] >= 3  # it did retry with backoff meanwhile


def test_begin_when_offline_is_refused_at_once(client: SwarmClient, fake: Fake) -> None:
    with pytest.raises(SwarmRefused) as info:
        client.begin_episode()
    assert fake.calls[ROUTE_BEGIN] == 1
    assert info.value.status_code == 409 and info.value.state is EngineState.OFFLINE
    assert "auto_sync_train_config_and_start_engine" in str(info.value)


def test_unreachable_server_times_out(fake: Fake) -> None:
    with SwarmClient(f"http://127.0.0.1:{free_port()}", TOKEN) as c:
        start = time.monotonic()
        with pytest.raises(SwarmTimeout, match="could not reach") as info:
            c.status(timeout=0.3)
        assert time.monotonic() - start < 2.0
        assert isinstance(info.value.__cause__, httpx.ConnectError)


def test_transport_errors_retried_only_when_safe(
    client: SwarmClient, fake: Fake, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("marl.client._TRANSPORT_RETRY_S", 0.01)
    calls: collections.Counter[str] = collections.Counter()
    lease = EpisodeLease(episode_id="e1", base_url="http://x/v1", api_key="k", model="m", generation=1,
                         patience_s=1.0, policy_version=0)

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        calls[path] += 1
        if path == ROUTE_STATUS and calls[path] <= 2:
            raise httpx.ReadTimeout("slow", request=request)  # idempotent GET: retried
        if path == ROUTE_BEGIN and calls[path] == 1:
            raise httpx.RemoteProtocolError("reset", request=request)  # begin: retried
        if path == ROUTE_END.format(episode_id="e1"):
            raise httpx.ReadTimeout("slow", request=request)  # end, maybe processed: NOT retried
        if path == ROUTE_ABORT.format(episode_id="e1") and calls[path] == 1:
            raise httpx.ConnectError("refused", request=request)  # never sent: retried
        if path == ROUTE_ABORT.format(episode_id="e1"):
            return httpx.Response(200, json={"episode_id": "e1", "disposition": "requeued"})
        if path == ROUTE_BEGIN:
            return httpx.Response(200, json=lease.model_dump(mode="json"))
        return httpx.Response(200, json=fake.status().model_dump(mode="json"))

    mock_transport(client, handler)
    assert client.status().state is EngineState.OFFLINE and calls[ROUTE_STATUS] == 3
    assert client.begin_episode()[0] == "e1" and calls[ROUTE_BEGIN] == 2
    with pytest.raises(SwarmError, match="may or may not") as info:
        client.end_episode("t", "e1", 1.0)
    assert not isinstance(info.value, SwarmTimeout) and "can_continue_episode('e1')" in str(info.value)
    assert calls[ROUTE_END.format(episode_id="e1")] == 1
    assert client.abort_episode("e1").disposition == "requeued"
    assert calls[ROUTE_ABORT.format(episode_id="e1")] == 2


def test_non_protocol_errors(client: SwarmClient) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == ROUTE_POOL:
            return httpx.Response(404, json={"detail": "Not Found"})
        if request.url.path == ROUTE_STATUS:
            return httpx.Response(200, json={"unexpected": True})
        return httpx.Response(500, text="boom")

    mock_transport(client, handler)
    with pytest.raises(SwarmRefused, match="same version"):
        client.pool()
    with pytest.raises(SwarmError, match="not a ServerStatus"):
        client.status()
    with pytest.raises(SwarmError, match="boom") as info:
        client.stop_engine()
    assert info.value.status_code == 500 and not isinstance(info.value, SwarmRefused)


def test_wait_until_state(client: SwarmClient, fake: Fake) -> None:
    fake.state, fake.boot_polls = EngineState.BOOTING, 2
    assert client.wait_until_state("rolling", timeout=3).state is EngineState.ROLLING
    fake.state, fake.boot_polls = EngineState.BOOTING, 10**6
    with pytest.raises(SwarmTimeout, match="still BOOTING") as info:
        client.wait_until_state(EngineState.ROLLING, timeout=0.2)
    assert info.value.last_state is EngineState.BOOTING
    with pytest.raises(ValueError, match="unknown engine state"):
        client.wait_until_state("RUNNING")


def test_exceptions_pickle() -> None:
    err = SwarmTimeout("msg", waited_s=1.5, last_state=EngineState.BOOTING, status_code=503, what="begin_episode")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == "msg" and back.last_state is EngineState.BOOTING and back.status_code == 503
    refused = pickle.loads(pickle.dumps(SwarmRefused("no", status_code=409, error=ErrorInfo(message="x"))))
    assert refused.error.message == "x"


# --------------------------------------------------------------------------------------------------------------
# auto_sync_train_config_and_start_engine
# --------------------------------------------------------------------------------------------------------------


def test_auto_sync_starts_only_when_offline(client: SwarmClient, fake: Fake) -> None:
    cfg = {"batch_size": 2, "num_repeat": 2}
    st = client.auto_sync_train_config_and_start_engine(cfg, timeout=5)
    assert st.state is EngineState.ROLLING
    assert fake.calls[ROUTE_START] == 1 and fake.config == TrainConfig(**cfg)
    # Idempotent: a running engine with the same config is left alone, from this client or another one.
    for c in (client, SwarmClient(client.url, TOKEN)):
        assert c.auto_sync_train_config_and_start_engine(TrainConfig(**cfg)).state is EngineState.ROLLING
    assert fake.calls[ROUTE_START] == 1
    fake.state = EngineState.WEIGHT_SYNCING
    assert client.auto_sync_train_config_and_start_engine(cfg).state is EngineState.WEIGHT_SYNCING
    assert fake.calls[ROUTE_START] == 1


def test_auto_sync_refuses_a_different_config_while_running(client: SwarmClient, fake: Fake) -> None:
    rolling(fake)
    with pytest.raises(SwarmRefused, match="stop_engine") as info:
        client.auto_sync_train_config_and_start_engine({"batch_size": 99})
    assert info.value.status_code == 409 and "different train config" in str(info.value)
    assert fake.calls[ROUTE_START] == 0 and fake.config == TrainConfig()


def test_auto_sync_waits_for_booting(client: SwarmClient, fake: Fake) -> None:
    fake.state, fake.boot_polls = EngineState.BOOTING, 3
    assert client.auto_sync_train_config_and_start_engine(timeout=5).state is EngineState.ROLLING
    assert fake.calls[ROUTE_START] == 0


@pytest.mark.parametrize("boot_polls", [0, 2])  # fails at once (first status after start) or after a while
def test_auto_sync_reports_a_failed_boot(client: SwarmClient, fake: Fake, boot_polls: int) -> None:
    fake.boot_error, fake.boot_polls = "CUDA out of memory", boot_polls
    with pytest.raises(SwarmError, match="CUDA out of memory"):
        client.auto_sync_train_config_and_start_engine(timeout=5)
    assert fake.calls[ROUTE_START] == 1


def test_auto_sync_refuses_static(client: SwarmClient, fake: Fake) -> None:
    fake.state = EngineState.STATIC
    with pytest.raises(SwarmRefused, match="STATIC"):
        client.auto_sync_train_config_and_start_engine()
    assert fake.calls[ROUTE_CONFIG] == 0 and fake.calls[ROUTE_START] == 0


# --------------------------------------------------------------------------------------------------------------
# Episodes
# --------------------------------------------------------------------------------------------------------------


@dataclass
class SeedTask:  # the seed's Task: `task_id`, plus data
    task_id: str
    main_query: str = "2+2?"


@dataclass
class SeedWorkflowOutput:  # the seed's WorkflowOutput: reward, is_success, metadata
    reward: float | None
    is_success: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


class IdTask:
    id = 7


def test_end_episode_argument_forms(client: SwarmClient, fake: Fake) -> None:
    rolling(fake)
    forms = [
        ("t-str", 1.0),
        ("t-int", 2),
        (SeedTask("t-seed"), SeedWorkflowOutput(reward=0.5, is_success=True, metadata={"answer": "4"})),
        (IdTask(), EpisodeOutput(0.25, agent_rewards={"solver": 1.0}, metadata={"obj": object(), "x": math.inf})),
        ({"task_id": "t-map"}, {"reward": -1.0, "agent_rewards": {"a": 0}}),
        ({"id": "t-map-id"}, EpisodeOutput(reward=0.0)),
    ]
    for task, output in forms:
        episode_id, _ = client.begin_episode()
        resp = client.end_episode(task, episode_id, output)
        assert resp.episode_id == episode_id and resp.samples == 1
    got = [(e.task_id, e.reward, e.agent_rewards) for e in fake.ended]
    assert got == [
        ("t-str", 1.0, None), ("t-int", 2.0, None), ("t-seed", 0.5, None), ("7", 0.25, {"solver": 1.0}),
        ("t-map", -1.0, {"a": 0.0}), ("t-map-id", 0.0, None),
    ]
    assert fake.ended[2].metadata == {"answer": "4"}
    assert fake.ended[3].metadata["x"] is None and fake.ended[3].metadata["obj"].startswith("<object")
    assert all(e.client_id == client.client_id for e in fake.ended)


@pytest.mark.parametrize(
    ("task", "output", "error", "match"),
    [
        ("t", None, TypeError, "reward"),
        ("t", "high", TypeError, "reward"),
        ("t", True, TypeError, "reward"),
        ("t", math.nan, ValueError, "finite"),
        ("t", SeedWorkflowOutput(reward=None), ValueError, "abort_episode"),
        ("t", EpisodeOutput(1.0, agent_rewards={"a": math.inf}), ValueError, "finite"),
        (object(), 1.0, TypeError, "task_id"),
        ("", 1.0, ValueError, "empty"),
        ({"name": "x"}, 1.0, TypeError, "task_id"),
    ],
)
def test_end_episode_bad_arguments_fail_before_sending(
    client: SwarmClient, fake: Fake, task: Any, output: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        client.end_episode(task, "e-unknown", output)
    assert fake.calls["end"] == 0


def test_end_abort_renew_and_can_continue(client: SwarmClient, fake: Fake) -> None:
    rolling(fake)
    episode_id, _ = client.begin_episode()
    assert client.can_continue_episode(episode_id)
    assert client.renew_episode(episode_id).can_continue
    other = SwarmClient(client.url, TOKEN, client_id="someone-else")
    with pytest.raises(SwarmRefused, match="held by another client") as info:
        other.end_episode("t", episode_id, 1.0)
    assert info.value.status_code == 403
    assert client.abort_episode(episode_id).disposition == "requeued"
    assert not client.can_continue_episode(episode_id)
    assert client.abort_episode(episode_id) is None  # already gone: nothing to do
    with pytest.raises(SwarmRefused):
        client.abort_episode(episode_id, missing_ok=False)
    with pytest.raises(SwarmRefused, match="expired") as info:
        client.end_episode("t", episode_id, 1.0)
    assert info.value.status_code == 404 and info.value.code == "episode_not_found"
    assert fake.ended == [] and fake.aborted == [episode_id]


def test_episode_context_manager_ends_with_reward(client: SwarmClient, fake: Fake) -> None:
    rolling(fake)
    with client.episode(SeedTask("t1")) as ep:
        assert ep.episode_id in fake.leases and ep.model == "tiny" and ep.base_url.endswith("/v1")
        ep.reward = 0.75
        ep.metadata["turns"] = 3
    assert ep.result is not None and ep.done and not ep.aborted
    assert [(e.task_id, e.reward, e.metadata) for e in fake.ended] == [("t1", 0.75, {"turns": 3})]
    assert fake.leases == {} and fake.aborted == []


def test_episode_context_manager_aborts_on_exception(client: SwarmClient, fake: Fake) -> None:
    rolling(fake)
    with pytest.raises(ZeroDivisionError):
        with client.episode("t1") as ep:
            ep.reward = 1.0
            1 / 0  # noqa: B018
    assert ep.aborted and fake.aborted == [ep.episode_id] and fake.ended == [] and fake.leases == {}


def test_episode_context_manager_explicit_end_and_missing_reward(
    client: SwarmClient, fake: Fake, caplog: pytest.LogCaptureFixture
) -> None:
    rolling(fake)
    with client.episode("t1") as ep:
        ep.end(EpisodeOutput(1.0, agent_rewards={"a": 0.0}))
    assert len(fake.ended) == 1 and fake.aborted == [] and fake.ended[0].agent_rewards == {"a": 0.0}
    with caplog.at_level(logging.WARNING, logger="marl.client"), client.episode("t2") as ep2:
        pass
    assert ep2.aborted and fake.aborted == [ep2.episode_id] and "without a reward" in caplog.text
    with pytest.raises(TypeError, match="task_id"):
        client.episode(object())  # fails before claiming a lease
    assert fake.leases == {}


def test_episode_abort_failure_never_masks_the_body_error(client: SwarmClient, fake: Fake) -> None:
    rolling(fake)
    with pytest.raises(KeyError):
        with client.episode("t1") as ep:
            fake.leases[ep.episode_id] = "stolen"  # abort will be refused with 403
            raise KeyError("body")
    assert fake.aborted == []


def test_episode_heartbeat_renews(client: SwarmClient, fake: Fake) -> None:
    rolling(fake)
    with client.episode("t1", heartbeat_s=0.03) as ep:
        time.sleep(0.2)
        ep.reward = 1.0
    assert fake.calls["renew"] >= 2 and len(fake.ended) == 1


def test_openai_clients_are_bound_to_the_lease(client: SwarmClient, fake: Fake) -> None:
    rolling(fake)
    with client.episode("t1") as ep:
        oai = ep.openai(agent="werewolf")
        assert str(oai.base_url).rstrip("/") == ep.base_url and oai.api_key == ep.api_key
        assert oai.default_headers[AGENT_HEADER] == "werewolf"
        plain = client.openai_client(ep.lease, max_retries=0)
        assert AGENT_HEADER not in plain.default_headers and plain.max_retries == 0
        aoai = client.async_openai_client(ep.lease, agent="seer")
        assert aoai.default_headers[AGENT_HEADER] == "seer"
        with pytest.raises(TypeError, match="tuple"):
            client.openai_client((ep.episode_id, ep.lease))  # type: ignore[arg-type]
        ep.reward = 0.0


def test_begin_from_many_threads(client: SwarmClient, fake: Fake) -> None:
    rolling(fake).begin_waits = 8  # some threads are told to wait and retry
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: client.begin_episode(timeout=5), range(8)))
    ids = [episode_id for episode_id, _ in results]
    assert len(set(ids)) == 8 and set(ids) == set(fake.leases)
    assert fake.calls[ROUTE_BEGIN] == 16
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: client.end_episode(f"t{i % 2}", ids[i], float(i)), range(8)))
    assert fake.leases == {} and sorted(e.reward for e in fake.ended) == [float(i) for i in range(8)]


def test_package_exports() -> None:
    assert marl.SwarmClient is SwarmClient and marl.EpisodeOutput is EpisodeOutput
    assert marl.SwarmError is SwarmError and marl.SwarmRefused is SwarmRefused and marl.SwarmTimeout is SwarmTimeout
    assert marl.TrainConfig is TrainConfig
    with pytest.raises(AttributeError):
        marl.nope  # noqa: B018
