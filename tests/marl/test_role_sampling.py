"""Per-role sampling (`roles.R.sampling`): validated in the topology, sent with each role's calls to a real tiny-model
server, honoured there, and recorded in games.jsonl."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict

import httpx
import pytest
import uvicorn
import yaml
from conftest import ADMIN, LocalServer, admin_http, start_rolling, wait_state
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from marl.games.record import GameRecord, Sampling, read_games
from marl.games.table import GameSettings
from marl.runner.launch import free_port
from marl.topology import Topology, TopologyError

SPEAKER = {"temperature": 0.3, "max_tokens": 3, "stop": "\n\n"}  # one stop string is a list of one
LISTENER = {"temperature": 1.5, "top_p": 0.5, "max_tokens": 9}
TRAIN = {"job": "tiny", "batch_size": 100, "num_repeat": 2, "save_freq": 0}  # never trains: the test plays 2 games


class Relay:
    """An HTTP relay in front of a swarm server that keeps every chat completion: (agent tag, request body, reply
    body), as they crossed the wire. It forwards the Host header as it came, so the leases the server hands out
    through it point at the relay, and the agents' calls cross it too."""

    def __init__(self, target: str):
        self.target, self.port = target, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.calls: list[tuple[str | None, dict, dict]] = []
        app = Starlette(routes=[Route("/{path:path}", self.forward, methods=["GET", "POST", "PUT", "DELETE"])])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("content-length", "accept-encoding")}
        async with httpx.AsyncClient(timeout=120) as client:
            reply = await client.request(request.method, self.target + request.url.path, params=request.query_params,
                                         headers=headers, content=body)
        if request.url.path.endswith("/chat/completions"):
            self.calls.append((request.headers.get("x-marl-agent"), json.loads(body), reply.json()))
        return Response(reply.content, reply.status_code, media_type=reply.headers.get("content-type"))

    def __enter__(self) -> Relay:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline, "the relay did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)


def topology(tmp_path, roles: dict, server: dict) -> str:
    spec = {
        "name": "role-sampling",
        "servers": {"m": server},
        "roles": roles,
        "env": {"class": "envs.signalling:SignallingGame", "args": {"num_items": 3}},
        "run": {"games": 2, "repeats": 2, "concurrency": 1, "max_tokens": 5, "temperature": 1.0,
                "run_dir": str(tmp_path / "run")},
    }
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_each_role_samples_with_its_own_settings_and_games_jsonl_says_so(tiny_model, tmp_path, monkeypatch):
    from marl.runner.run import run

    monkeypatch.setenv("ROLE_SAMPLING_ADMIN", ADMIN)
    with LocalServer(tiny_model, tmp_path / "server") as server, Relay(server.url) as relay:
        with admin_http(server.url) as http:
            start_rolling(http, **TRAIN)
        path = topology(tmp_path, {"speaker": {"server": "m", "sampling": SPEAKER},
                                   "listener": {"server": "m", "sampling": LISTENER}},
                        {"swarm_url": relay.url, "admin_token_env": "ROLE_SAMPLING_ADMIN", "trainable": True,
                         "train": TRAIN})
        summary = run(path)
    assert summary.error is None and summary.games == 2

    sent = defaultdict(list)  # role -> (request, reply), as on the wire
    for role, body, reply in relay.calls:
        sent[role].append((body, reply))
    assert set(sent) == {"speaker", "listener"}
    for body, reply in sent["speaker"]:
        assert (body["temperature"], body["max_tokens"], body["stop"]) == (0.3, 3, ["\n\n"])
        assert "top_p" not in body  # set nowhere: the server's default
        assert reply["usage"]["completion_tokens"] <= 3  # honoured by the server
    for body, reply in sent["listener"]:
        assert (body["temperature"], body["top_p"], body["max_tokens"]) == (1.5, 0.5, 9)
        assert "stop" not in body
        assert reply["usage"]["completion_tokens"] <= 9
    assert max(reply["usage"]["completion_tokens"] for _, reply in sent["listener"]) > 3  # the limits differ

    games = read_games(tmp_path / "run" / "games.jsonl")
    assert len(games) == 2
    for game in games:
        assert game.sampling == {"speaker": Sampling(temperature=0.3, max_tokens=3, stop=("\n\n",)),
                                 "listener": Sampling(temperature=1.5, top_p=0.5, max_tokens=9)}
    row = json.loads((tmp_path / "run" / "games.jsonl").read_text().splitlines()[0])
    assert row["sampling"]["speaker"] == {"max_tokens": 3, "temperature": 0.3, "top_p": None, "stop": ["\n\n"],
                                          "choice": False}


def test_a_role_held_to_the_legal_moves_sends_them_each_turn_and_never_replies_invalid(tiny_model, tmp_path,
                                                                                       monkeypatch):
    pytest.importorskip("pyspiel")
    from marl.runner.run import run

    monkeypatch.setenv("ROLE_SAMPLING_ADMIN", ADMIN)
    with LocalServer(tiny_model, tmp_path / "server") as server, Relay(server.url) as relay:
        with admin_http(server.url) as http:
            start_rolling(http, **TRAIN)
        spec = yaml.safe_load(open(topology(tmp_path, {"player_0": {"server": "m", "sampling": {"choice": True}},
                                                       "player_1": {"server": "m"}},
                                            {"swarm_url": relay.url, "admin_token_env": "ROLE_SAMPLING_ADMIN",
                                             "trainable": True, "train": TRAIN})))
        spec["env"] = {"openspiel": "kuhn_poker", "args": {"max_invalid_retries": 0}}
        spec["run"]["games"] = 4
        (tmp_path / "kuhn.yaml").write_text(yaml.safe_dump(spec))
        summary = run(str(tmp_path / "kuhn.yaml"))
    assert summary.error is None and summary.games == 4
    held = [body for role, body, _ in relay.calls if role == "player_0"]
    assert held and all(body["structured_outputs"] == {"choice": ["Pass", "Bet"]} for body in held)
    assert all("structured_outputs" not in body for role, body, _ in relay.calls if role == "player_1")
    games = read_games(tmp_path / "run" / "games.jsonl")
    assert all(game.invalid_actions.get("player_0", 0) == 0 for game in games)
    assert sum(game.invalid_actions.get("player_1", 0) for game in games) > 0  # the tiny model, unheld
    assert games[0].sampling["player_0"].choice and not games[0].sampling["player_1"].choice


def test_a_role_without_sampling_keeps_the_runs_and_a_scripted_role_records_none():
    settings = GameSettings(max_tokens=5, temperature=0.7, sampling={"speaker": {"max_tokens": 2}})
    assert settings.sampling_of("speaker") == Sampling(max_tokens=2, temperature=0.7)
    assert settings.sampling_of("listener") == Sampling(max_tokens=5, temperature=0.7)
    with pytest.raises(ValueError, match="unknown settings \\['temprature'\\]"):
        GameSettings(sampling={"speaker": {"temprature": 0.5}})

    from envs.signalling import SignallingGame
    from marl.games.table import GameTable

    table = GameTable(lambda: SignallingGame(num_items=3), {"speaker": None, "listener": None}, settings)
    assert table.play("t", 1, {}, {}).sampling == {}  # nobody sampled a model
    assert GameRecord.model_validate({"role_rewards": {"a": 1.0}}).sampling == {}  # an older row still reads


def test_bad_sampling_is_refused_at_its_key(tmp_path, tiny_model):
    for roles, problem in [
        ({"speaker": {"server": "m", "sampling": {"temperature": 3}}, "listener": {"server": "m"}},
         "roles.speaker.sampling.temperature"),
        ({"speaker": {"server": "m", "sampling": {"top_k": 3}}, "listener": {"server": "m"}},
         "roles.speaker.sampling.top_k"),
        ({"speaker": {"server": "m"}, "listener": {"scripted": True, "sampling": {"max_tokens": 4}}},
         "a scripted role samples no model"),
        ({"speaker": {"server": "m", "sampling": {"stop": ["x", ""]}}, "listener": {"server": "m"}},
         "an empty stop string"),
    ]:
        with pytest.raises(TopologyError, match=problem.replace(".", r"\.")):
            Topology.load(topology(tmp_path, roles, {"model": str(tiny_model), "trainable": True, "train": TRAIN}))


def test_an_agentscope_player_sends_its_roles_sampling_too(tiny_model, tmp_path):
    pytest.importorskip("agentscope")
    from marl.agents.agentscope import agentscope_players
    from marl.games.table import Seat

    with LocalServer(tiny_model, tmp_path / "server", static=True) as server, Relay(server.url) as relay:
        with admin_http(server.url) as http:
            wait_state(http, "STATIC")
        seat = Seat("player_3", "seer", "frozen", system_prompt="You are the seer.", base_url=relay.url + "/v1",
                    model="tiny", temperature=0.2, top_p=0.5, max_tokens=4, stop=("\n\n",))
        player = agentscope_players()(seat)
        assert isinstance(player.act("Night 1. Who do you check?"), str)
        player.close()
    [(tag, body, reply)] = relay.calls
    assert tag == "seer"
    limit = body.get("max_completion_tokens", body.get("max_tokens"))  # AgentScope sends the newer name
    assert (body["temperature"], body["top_p"], limit, body["stop"]) == (0.2, 0.5, 4, ["\n\n"])
    assert reply["usage"]["completion_tokens"] <= 4  # honoured by the server
