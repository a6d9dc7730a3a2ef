"""Topologies: loading, overrides, the graph, validation errors that name their key, the env's roles against
`roles:`, `marl topology show`."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import pytest

from marl.cli import main
from marl.protocol import TrainConfig
from marl.topology import RoleInfo, ServerKind, Topology, TopologyError, import_class, import_env_factory

REPO = Path(__file__).resolve().parents[2]
CPU = REPO / "topologies" / "signalling-cpu.yaml"
THREE = REPO / "topologies" / "signalling-3-servers.yaml"

ENV_MODULE = '''
from envs.base import RoleInfo, TextAECEnv

class Game(TextAECEnv):
    """Deals the roles of the `base` topology."""

    def __init__(self, num_items: int = 3, render_mode=None):
        if num_items < 1:
            raise ValueError(f"num_items must be 1 or more; got {num_items}")
        super().__init__(render_mode=render_mode)
        self.num_items = num_items

    def dealt_roles(self):
        village = {role: RoleInfo("village") for role in ("seer", "witch", "hunter", "guard")}
        return {"werewolf": RoleInfo("wolves", 3), **village, "villager": RoleInfo("village", 3)}

class Undealt(Game):
    def dealt_roles(self):
        raise RuntimeError("roles are dealt at reset(): call reset() first")

def make_game(num_items: int = 3):
    """A factory function: env.class may name one instead of a class."""
    return Game(num_items=num_items)

def not_an_env():
    return None

def text_signalling(num_items: int = 3, *, roles=None, teams=None):
    """An adapted AEC env (the signalling game behind a TextAdapter, free text everywhere), renamed by tables."""
    from envs.adapter import TextAdapter
    from envs.signalling import SignallingGame

    return TextAdapter(SignallingGame(num_items=num_items), render=lambda agent, obs, info: str(obs),
                       actions=lambda agent, obs, info: None, roles=roles, teams=teams)

NOT_CALLABLE = 3
'''


@pytest.fixture
def env_path(tmp_path, monkeypatch) -> str:
    """A stand-in env class in a module of its own (the import check really imports and constructs it)."""
    (tmp_path / "topo_standin_env.py").write_text(ENV_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "topo_standin_env:Game"


def train(**kw):
    return {"job": "t", "batch_size": 2, "num_repeat": 4, **kw}


@pytest.fixture
def base(env_path) -> dict:
    """A werewolves-like topology using every server kind."""
    return {
        "name": "wolves",
        "servers": {
            "small": {"model": "smollm2-135m", "trainable": True, "device": "cpu", "train": train()},
            "remote_7b": {"swarm_url": "http://gpu-box:10086", "admin_token_env": "MARL_ADMIN_TOKEN",
                          "trainable": True, "train": train(learning_rate=1e-6)},
            "frozen": {"model": "smollm2-135m", "trainable": False},
            "big": {"url": "http://localhost:8000/v1", "model": "Qwen/Qwen3-235B-A22B-Instruct-2507",
                    "api_key_env": "BIG_MODEL_API_KEY"},
        },
        "roles": {
            "werewolf": {"server": "remote_7b", "count": 3, "team": "wolves"},
            "seer": {"server": "remote_7b", "team": "village"},
            "witch": {"server": "small", "team": "village"},
            "hunter": {"server": "big", "team": "village"},
            "guard": {"server": "frozen", "team": "village"},
            "villager": {"scripted": True, "count": 3, "team": "village"},
        },
        "env": {"class": env_path, "args": {"num_items": 3}},
        "run": {"max_steps": 5, "repeats": 4, "concurrency": 8},
    }


def load_error(data: dict, overrides=()) -> TopologyError:
    with pytest.raises(TopologyError) as info:
        Topology.from_dict(data, overrides)
    return info.value


# ---------------------------------------------------------------------------------------------------------------
# Loading, overrides, the shipped files
# ---------------------------------------------------------------------------------------------------------------


def test_shipped_cpu_topology():
    topo = Topology.load(CPU, check_env=False)
    spec = topo.spec
    assert spec.name == "signalling-cpu"
    assert topo.trainable_servers() == ["speaker_model", "listener_model"]
    assert topo.local_servers() == ["speaker_model", "listener_model"]
    assert topo.static_endpoints() == []
    assert spec.servers["speaker_model"].kind is ServerKind.LOCAL_TRAINABLE
    assert spec.servers["speaker_model"].train == TrainConfig(job="signalling", batch_size=2, num_repeat=8,
                                                              learning_rate=4e-5, micro_batch_tokens=1024, kl_coef=0.1)
    assert topo.server_of("speaker") == "speaker_model" and topo.server_of("listener") == "listener_model"
    assert spec.env.class_path == "envs.signalling:SignallingGame"
    assert spec.env.args == {"num_items": 3, "naming_bonus": 0.5, "max_invalid_retries": 0}
    assert spec.run.repeats == 8 and spec.run.max_steps == 25 and spec.run.games is None
    assert spec.run.temperature == 0.8
    assert spec.run.run_dir == Path("runs/signalling-cpu")  # ${name} resolved
    assert topo.warnings == []


def test_shipped_three_server_topology():
    topo = Topology.load(THREE, check_env=False)
    assert list(topo.spec.servers) == ["speaker_model", "listener_model", "frozen"]
    assert topo.trainable_servers() == ["speaker_model", "listener_model"]
    assert topo.static_endpoints() == ["frozen"]
    assert topo.spec.servers["frozen"].kind is ServerKind.LOCAL_STATIC
    assert topo.roles_of("frozen") == ["observer"]
    assert len(topo.spec.roles) == 3


def test_shipped_topologies_import_their_env():
    pytest.importorskip("envs.signalling")
    for path in (CPU, THREE):
        topo = Topology.load(path)  # env.class imported and env.args checked against its signature
        assert topo.env_class().__name__ == "SignallingGame"


def test_shipped_gpu_topologies_use_vllm_and_fsdp(monkeypatch):
    monkeypatch.setenv("MARL_GPU_MODEL", "/models/Qwen2.5-0.5B-Instruct")
    gpu = Topology.load(REPO / "topologies" / "signalling-gpu.yaml", check_env=False)  # its model is on a GPU box
    for name in ("speaker_model", "listener_model"):
        server = gpu.spec.servers[name]
        assert (server.model, server.engine, server.device) == ("/models/Qwen2.5-0.5B-Instruct", "vllm", "cuda")
        assert server.train.trainer == "fsdp" and server.train.trainer_section.ranks == 4
    big = Topology.load(REPO / "topologies" / "werewolves-7b-14b-235b.yaml")
    assert {big.spec.servers[name].train.trainer for name in big.trainable_servers()} == {"fsdp"}


def test_overrides_are_merged_and_interpolated():
    topo = Topology.load(CPU, ["run.max_steps=5", "servers.speaker_model.train.grpo.learning_rate=1e-5", "name=quick",
                               "run.games=40", "env.args.num_items=4"], check_env=False)
    assert topo.spec.run.max_steps == 5 and topo.spec.run.games == 40
    assert topo.spec.servers["speaker_model"].train.grpo.learning_rate == 1e-5
    assert topo.spec.servers["listener_model"].train.grpo.learning_rate == 5e-5
    assert topo.spec.env.args == {"num_items": 4, "naming_bonus": 0.5, "max_invalid_retries": 0}
    assert topo.spec.run.run_dir == Path("runs/quick")  # run_dir: runs/${name} follows the overridden name
    assert topo.overrides[0] == "run.max_steps=5"


def test_name_defaults_to_file_stem_and_env_interpolation(tmp_path, monkeypatch):
    monkeypatch.setenv("TOPO_TEST_URL", "http://big-box:9000/v1")
    path = tmp_path / "my-exp.yaml"
    path.write_text(textwrap.dedent("""\
        servers:
          big: {url: "${oc.env:TOPO_TEST_URL,http://localhost:8000/v1}", model: Qwen/Qwen3-235B-A22B}
        roles:
          speaker: {server: big}
          listener: {server: big}
        env: {class: envs.signalling:SignallingGame}
        run: {games: 8}
        """))
    topo = Topology.load(path)
    assert topo.name == "my-exp" and topo.spec.run.run_dir == Path("runs/my-exp")
    assert topo.spec.servers["big"].url == "http://big-box:9000/v1"
    assert topo.spec.servers["big"].kind is ServerKind.EXTERNAL_OPENAI
    assert topo.spec.run.repeats == 1  # nothing trainable


def test_to_dict_round_trips(base):
    topo = Topology.from_dict(base)
    again = Topology.from_dict(topo.to_dict())
    assert again.spec == topo.spec
    assert topo.to_dict()["servers"]["small"]["train"] == train()  # only the keys the file set


def test_repeats_default_to_num_repeat(base):
    del base["run"]["repeats"]
    assert Topology.from_dict(base).spec.run.repeats == 4


# ---------------------------------------------------------------------------------------------------------------
# The graph
# ---------------------------------------------------------------------------------------------------------------


def test_graph_and_helpers(base):
    topo = Topology.from_dict(base)
    g = topo.graph
    kinds = {n: d["kind"] for n, d in g.nodes(data=True)}
    assert {n for n, k in kinds.items() if k == "role"} == {f"role:{r}" for r in base["roles"]}
    assert {n for n, k in kinds.items() if k == "server"} == {f"server:{s}" for s in base["servers"]}
    assert {n for n, k in kinds.items() if k == "team"} == {"team:wolves", "team:village"}
    assert g.edges["role:werewolf", "server:remote_7b"]["kind"] == "played_by"
    assert g.edges["role:werewolf", "team:wolves"]["kind"] == "member_of"
    assert not any(d["kind"] == "played_by" for _, _, d in g.out_edges("role:villager", data=True))
    assert g.nodes["role:werewolf"]["count"] == 3
    assert g.nodes["server:big"]["server_kind"] is ServerKind.EXTERNAL_OPENAI
    assert Topology.node("role", "seer") == "role:seer"

    assert topo.server_of("werewolf") == "remote_7b"
    assert topo.server_of("villager") is None
    assert topo.roles_of("remote_7b") == ["werewolf", "seer"]
    assert topo.trainable_servers() == ["small", "remote_7b"]
    assert topo.local_servers() == ["small", "frozen"]
    assert topo.remote_servers() == ["remote_7b", "big"]
    assert topo.static_endpoints() == ["frozen", "big"]
    assert topo.scripted_roles() == ["villager"]
    assert topo.teams() == {"wolves": ["werewolf"], "village": ["seer", "witch", "hunter", "guard", "villager"]}
    assert [s.kind for s in topo.spec.servers.values()] == [
        ServerKind.LOCAL_TRAINABLE, ServerKind.REMOTE_SWARM, ServerKind.LOCAL_STATIC, ServerKind.EXTERNAL_OPENAI]
    assert topo.env_class().__name__ == "Game"
    assert topo.make_env().num_items == 3
    with pytest.raises(KeyError, match="unknown role 'wolf'"):
        topo.server_of("wolf")

    assert topo.players() == {"werewolf": "remote_7b", "seer": "remote_7b", "witch": "small", "hunter": "big",
                              "guard": "frozen", "villager": None}
    assert topo.linked_servers() == ["small", "remote_7b"]
    assert topo.dealt_roles() == {"werewolf": RoleInfo("wolves", 3), "seer": RoleInfo("village"),
                                  "witch": RoleInfo("village"), "hunter": RoleInfo("village"),
                                  "guard": RoleInfo("village"), "villager": RoleInfo("village", 3)}
    assert topo.team_of("werewolf") == "wolves" and topo.team_of("villager") == "village"


def test_count_and_team_default_to_the_envs(base):
    for role in base["roles"].values():
        role.pop("team", None), role.pop("count", None)
    topo = Topology.from_dict(base)
    assert topo.team_of("seer") == "village" and topo.graph.has_edge("role:werewolf", "team:wolves")
    assert topo.dealt_roles()["werewolf"] == RoleInfo("wolves", 3)
    assert topo.graph.nodes["role:villager"]["count"] == 3
    assert topo.teams() == {"wolves": ["werewolf"], "village": ["seer", "witch", "hunter", "guard", "villager"]}


def test_without_the_env_count_and_team_default_to_one_and_the_role_name(base):
    del base["roles"]["seer"]["team"]
    topo = Topology.from_dict(base, check_env=False)
    assert topo.team_of("seer") == "seer" and topo.teams()["seer"] == ["seer"]
    assert topo.graph.has_edge("role:seer", "team:seer")
    assert topo.dealt_roles()["seer"] == RoleInfo("seer", 1) and topo.dealt_roles()["werewolf"] == RoleInfo("wolves", 3)


# ---------------------------------------------------------------------------------------------------------------
# Validation errors name their key
# ---------------------------------------------------------------------------------------------------------------


def _set(data: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        data = data.setdefault(p, {})
    if value is _DEL:
        del data[last]
    else:
        data[last] = value


_DEL = object()

CASES = {
    "unknown server": ({"roles.hunter.server": "bgi"}, "roles.hunter.server",
                       ["unknown server 'bgi'", "known servers: small, remote_7b, frozen, big", "did you mean 'big'"]),
    "unassigned role": ({"roles.villager.scripted": False}, "roles.villager", ["no one plays this role"]),
    "server and scripted": ({"roles.villager.server": "big"}, "roles.villager", ["not both"]),
    "trainable without train": ({"servers.small.train": _DEL}, "servers.small.train", ["needs its training config"]),
    "static with train": ({"servers.frozen.train": train()}, "servers.frozen.train", ["does not train"]),
    "env module missing": ({"env.class": "no_such_module_xyz:Game"}, "env.class",
                           ["cannot import module 'no_such_module_xyz'", "No module named"]),
    "env class missing": ({"env.class": "topo_standin_env:Gam"}, "env.class", ["no attribute 'Gam'",
                                                                                 "did you mean 'Game'"]),
    "env not callable": ({"env.class": "topo_standin_env:NOT_CALLABLE"}, "env.class",
                         ["not a class or a function", "it is 3"]),
    "env factory returns no env": ({"env.class": "topo_standin_env:not_an_env", "env.args": {}}, "env.class",
                                   ["not_an_env() returned None", "not an env marl can play"]),
    "env path format": ({"env.class": "topo_standin_env.Game"}, "env.class",
                        ["not an import path 'module:Class' or 'module:factory'",
                         "did you mean 'topo_standin_env:Game'"]),
    "factory arg typo": ({"env.class": "topo_standin_env:make_game", "env.args": {"num_itemz": 3}},
                         "env.args.num_itemz",
                         ["make_game() takes no argument 'num_itemz'", "did you mean 'num_items'"]),
    "env constructor fails": ({"env.args": {"num_items": 0}}, "env.args",
                              ["constructing the env failed", "Game(num_items=0) raised ValueError",
                               "num_items must be 1 or more"]),
    "env cannot deal": ({"env.class": "topo_standin_env:Undealt"}, "env.class",
                        ["Undealt.dealt_roles() failed", "call reset() first", "must work before reset()"]),
    "role never dealt": ({"roles.wizard": {"scripted": True}}, "roles.wizard",
                         ["Game never deals role 'wizard'", "it deals werewolf, seer, witch, hunter, guard, villager"]),
    "dealt role without player": ({"roles.guard": _DEL}, "roles",
                                  ["Game deals role 'guard' (1 × team village) but no one plays it", "roles.guard"]),
    "wrong count": ({"roles.werewolf.count": 2}, "roles.werewolf.count",
                    ["is 2 but Game deals 3 werewolf", "set count: 3"]),
    "wrong team": ({"roles.seer.team": "wolves"}, "roles.seer.team",
                   ["is 'wolves' but Game puts seer in team 'village'", "set team: village"]),
    "env arg typo": ({"env.args": {"num_itemz": 3}}, "env.args.num_itemz",
                     ["takes no argument 'num_itemz'", "did you mean 'num_items'"]),
    "local and remote": ({"servers.big.swarm_url": "http://x:1"}, "servers.big", ["both url", "swarm_url"]),
    "neither model nor url": ({"servers.frozen.model": _DEL}, "servers.frozen", ["neither what nor where"]),
    "device on remote": ({"servers.big.device": "cuda"}, "servers.big.device", ["only applies to a local server"]),
    "prefix cache on remote": ({"servers.big.prefix_cache_gb": 4}, "servers.big.prefix_cache_gb",
                               ["only applies to a local server"]),
    "negative prefix cache": ({"servers.small.prefix_cache_gb": -1}, "servers.small.prefix_cache_gb",
                              ["greater than or equal to 0"]),
    "trainable external": ({"servers.big.trainable": True, "servers.big.train": train()}, "servers.big.trainable",
                           ["cannot be trained"]),
    "static remote swarm": ({"servers.remote_7b.trainable": False, "servers.remote_7b.train": _DEL},
                            "servers.remote_7b.trainable", ["set trainable: true"]),
    "external without model": ({"servers.big.model": _DEL}, "servers.big.model", ["needs the model id"]),
    "bad url": ({"servers.big.url": "localhost:8000/v1"}, "servers.big.url", ["not an http(s) URL"]),
    "unknown top-level key": ({"rols": {}}, "rols", ["unknown key 'rols'", "did you mean 'roles'"]),
    "unknown server key": ({"servers.small.trainble": True}, "servers.small.trainble",
                           ["did you mean 'trainable'", "the keys of a server are"]),
    "unknown role key": ({"roles.seer.sever": "small"}, "roles.seer.sever", ["did you mean 'server'"]),
    "unknown train key": ({"servers.small.train.grpo.learning_rat": 1e-5}, "servers.small.train.grpo.learning_rat",
                          ["did you mean 'learning_rate'"]),
    "unknown run key": ({"run.max_stepz": 3}, "run.max_stepz", ["did you mean 'max_steps'"]),
    "unknown env key": ({"env.argz": {}}, "env.argz", ["did you mean 'args'"]),
    "bad type": ({"run.concurrency": "lots"}, "run.concurrency", ["valid integer", "'lots'"]),
    "bad train value": ({"servers.small.train.grpo.learning_rate": -1}, "servers.small.train.grpo.learning_rate",
                        ["greater than 0"]),
    "missing env": ({"env": _DEL}, "env", ["required key is missing"]),
    "repeats != num_repeat": ({"run.repeats": 6}, "run.repeats",
                              ["is 6 but servers.small.train.num_repeat is 4", "drop run.repeats"]),
    "num_repeat disagree": ({"run.repeats": _DEL, "servers.remote_7b.train.num_repeat": 6},
                            "servers.remote_7b.train.num_repeat", ["same GRPO group size"]),
    "unused trainable": ({"roles.witch.server": "big"}, "servers.small", ["no role uses"]),
    "trainable plays only an undealt role": ({"roles.witch": _DEL, "roles.wizard": {"server": "small"}},
                                             "roles.wizard", ["never deals role 'wizard'", "servers.small plays no"
                                                              " role the env deals, so it would never get an episode"]),
    "never stops": ({"run.max_steps": None}, "run", ["never stops"]),
    "max_steps without training": ({"roles.werewolf.server": "big", "roles.seer.server": "big",
                                    "roles.witch.server": "big", "servers.small": _DEL, "servers.remote_7b": _DEL},
                                   "run.max_steps", ["no server is trainable"]),
    "bad role name": ({"roles.bad name": {"scripted": True}}, "roles.bad name", ["letters, digits"]),
    "past_of unknown server": ({"servers.past": {"past_of": {"server": "smal"}}, "roles.guard.server": "past"},
                               "servers.past.past_of.server", ["unknown server 'smal'", "did you mean 'small'"]),
    "past_of a remote server": ({"servers.past": {"past_of": {"server": "remote_7b"}}, "roles.guard.server": "past"},
                                "servers.past.past_of.server", ["servers.remote_7b is a remote swarm server",
                                                                "checkpoints that a local trainable server"]),
    "past_of with a model": ({"servers.past": {"past_of": {"server": "small"}, "model": "x"},
                              "roles.guard.server": "past"}, "servers.past.model",
                             ["does not apply to a past_of server", "checkpoints of servers.small"]),
    "trainable past_of": ({"servers.past": {"past_of": {"server": "small"}, "trainable": True},
                           "roles.guard.server": "past"}, "servers.past.trainable", ["plays frozen checkpoints"]),
    "past_of with a port": ({"servers.past": {"past_of": {"server": "small"}, "port": 9000},
                             "roles.guard.server": "past"}, "servers.past.port", ["one process per snapshot"]),
    "past_of bad pool": ({"servers.past": {"past_of": {"server": "small", "pool": "recent"}},
                          "roles.guard.server": "past"}, "servers.past.past_of.pool", ["'latest' or 'uniform'"]),
    "eval_every of a remote server": ({"run.eval_every": 2}, "run.eval_every",
                                      ["servers.remote_7b is a remote swarm server"]),
    "eval_every without checkpoints": ({"run.eval_every": 2, "servers.small.train.save_freq": 0}, "run.eval_every",
                                       ["servers.small.train.save_freq is 0"]),
    "eval_exploitability without eval_every": ({"run.eval_exploitability": True}, "run.eval_exploitability",
                                               ["run.eval_every is not set"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_validation_error_names_its_key(base, case):
    changes, key, fragments = CASES[case]
    data = copy.deepcopy(base)
    for dotted, value in changes.items():
        _set(data, dotted, value)
    err = load_error(data)
    assert_problem(err, key, fragments, case)
    assert f"{key}: " in str(err)


def assert_problem(err, key: str, fragments: list[str], case: str) -> None:
    """`err` has a problem at `key` whose message holds every fragment."""
    keys = [p.key for p in err.problems]
    assert key in keys, f"{case}: {err}"
    problem = next(p for p in err.problems if p.key == key)
    for fragment in fragments:
        assert fragment in problem.message, f"{case}: {fragment!r} not in {problem.message!r}"


def test_a_league_of_past_selves_in_the_graph(base):
    base["servers"]["past"] = {"past_of": {"server": "small", "pool": "uniform", "k": 2}, "device": "cpu"}
    base["roles"]["guard"]["server"] = "past"
    topo = Topology.from_dict(base)
    assert topo.spec.servers["past"].kind is ServerKind.PAST_SNAPSHOTS and topo.spec.servers["past"].is_local
    assert list(topo.past_of_servers()) == ["past"] and topo.past_of_servers()["past"].k == 2
    assert "past" not in topo.local_servers() and "past" not in topo.static_endpoints()
    assert topo.graph.edges["server:past", "server:small"]["kind"] == "past_of"
    assert topo.players()["guard"] == "past" and topo.linked_servers() == ["small", "remote_7b"]
    base["servers"]["small"]["train"]["save_freq"] = 0
    warnings = Topology.from_dict(base).warnings
    assert any(w.key == "servers.past.past_of.server" and "always plays its initial model" in w.message
               for w in warnings)


def test_unused_static_server_is_a_warning(base):
    base["roles"]["guard"]["server"] = "big"
    topo = Topology.from_dict(base)
    assert [w.key for w in topo.warnings] == ["servers.frozen"]
    assert "no role uses this server" in str(topo.warnings[0])


def test_all_problems_reported_at_once(base):
    base["roles"]["hunter"]["server"] = "bgi"
    base["run"]["repeats"] = 6
    err = load_error(base)
    assert {"roles.hunter.server", "run.repeats"} <= {p.key for p in err.problems}
    assert "problems" in str(err)


def test_independent_problems_of_the_servers_and_the_env_are_reported_together(tmp_path):
    """A trainable server without train: fails validation; the env, checked on its own, still is (issue 54): both
    problems in one error, each at its line, not the second after the first is fixed."""
    pytest.importorskip("textarena")
    text = (REPO / "topologies" / "textarena-kuhn-poker.yaml").read_text()
    train = "    train: {job: kuhn-poker, batch_size: 2, num_repeat: 8,"
    assert text.count(train) == 2 and text.count("textarena: KuhnPoker-v0") == 1
    lines = text.splitlines()
    lines.pop(next(i for i, line in enumerate(lines) if line.startswith(train)))  # player_0_model's train:
    path = tmp_path / "two-mistakes.yaml"
    path.write_text("\n".join(lines).replace("textarena: KuhnPoker-v0", "textarena: KuhnPokr-v0") + "\n")
    lines = path.read_text().splitlines()
    server_line = 1 + next(i for i, line in enumerate(lines) if line.startswith("  player_0_model:"))
    env_line = 1 + next(i for i, line in enumerate(lines) if "textarena: KuhnPokr-v0" in line)
    with pytest.raises(TopologyError) as info:
        Topology.load(path)
    found = {(p.key, p.where) for p in info.value.problems}
    assert ("servers.player_0_model.train", f"{path}:{server_line}") in found
    assert ("env.textarena", f"{path}:{env_line}") in found
    message = str(info.value)
    assert "2 problems" in message and "'KuhnPokr-v0' is not a TextArena game id" in message
    assert "a trainable server needs its training config" in message
    # Without the env check (marl plan), the server's problem alone
    with pytest.raises(TopologyError) as info:
        Topology.load(path, check_env=False)
    assert [p.key for p in info.value.problems] == ["servers.player_0_model.train"]


def test_an_env_that_does_not_import_is_reported_beside_an_invalid_run_and_an_invalid_env_once(base):
    base["run"]["concurrency"] = 0
    base["env"]["class"] = "not_written_yet_xyz:Game"
    assert {p.key for p in load_error(base).problems} == {"run.concurrency", "env.class"}
    base["env"]["bogus"] = 1  # the env section itself is invalid: said once, not checked on its own
    assert sorted(p.key for p in load_error(base).problems) == ["env.bogus", "run.concurrency"]


def test_check_env_can_be_skipped(base):
    base["env"]["class"] = "not_written_yet_xyz:Game"
    base["roles"]["wizard"] = {"scripted": True}  # no env to deal roles: nothing to compare with
    assert Topology.from_dict(base, check_env=False).spec.env.module == "not_written_yet_xyz"
    with pytest.raises(ImportError, match="cannot import module"):
        import_class("not_written_yet_xyz:Game")
    with pytest.raises(ImportError, match="cannot import module"):
        import_env_factory("not_written_yet_xyz:Game")


# ---------------------------------------------------------------------------------------------------------------
# env.class: a class or a factory function
# ---------------------------------------------------------------------------------------------------------------


def test_factory_function_as_env_class(base):
    base["env"] = {"class": "topo_standin_env:make_game", "args": {"num_items": 5}}
    topo = Topology.from_dict(base)
    assert topo.env_class().__name__ == "make_game"
    env = topo.make_env()
    assert type(env).__name__ == "Game" and env.num_items == 5
    assert topo.dealt_roles()["werewolf"] == RoleInfo("wolves", 3)
    assert import_env_factory("topo_standin_env:make_game") is topo.env_class()
    with pytest.raises(ImportError, match="is a function, not a class"):
        import_class("topo_standin_env:make_game")  # for code that needs a class


def test_adapted_pettingzoo_env_from_a_factory(env_path):
    data = {"name": "adapted", "servers": {"m": {"model": "smollm2-135m", "trainable": False}},
            "roles": {"speaker": {"server": "m"}, "guesser": {"server": "m", "team": "pair"}},
            "env": {"class": "topo_standin_env:text_signalling",
                    "args": {"roles": {"listener": "guesser"}, "teams": {"speaker": "pair", "listener": "pair"}}},
            "run": {"games": 2}}
    topo = Topology.from_dict(data)
    assert topo.dealt_roles() == {"speaker": RoleInfo("pair"), "guesser": RoleInfo("pair")}
    assert topo.teams() == {"pair": ["speaker", "guesser"]}
    assert type(topo.make_env()).__name__ == "TextAdapter"
    data["roles"]["listener"] = data["roles"].pop("guesser")
    err = load_error(data)
    assert [p.key for p in err.problems] == ["roles", "roles.listener"]
    assert "deals role 'guesser'" in str(err) and "never deals role 'listener'" in str(err)


def test_real_tictactoe_factory_in_a_topology():
    pytest.importorskip("pygame", reason="pettingzoo.classic.tictactoe_v3 imports pygame")
    data = {"name": "ttt", "servers": {"m": {"model": "smollm2-135m", "trainable": False}},
            "roles": {"player_1": {"server": "m"}, "player_2": {"scripted": True}},
            "env": {"class": "envs.adapter:text_tictactoe"}, "run": {"games": 2}}
    expected = {"player_1": RoleInfo("player_1"), "player_2": RoleInfo("player_2")}
    assert Topology.from_dict(data).dealt_roles() == expected


def test_trainable_server_of_an_undealt_role_is_refused_at_its_line(tmp_path, env_path):
    path = tmp_path / "undealt.yaml"
    path.write_text(textwrap.dedent(f"""\
        servers:
          small: {{model: smollm2-135m, trainable: true, train: {{job: t, num_repeat: 2}}}}
          frozen: {{model: smollm2-135m}}
        roles:
          werewolf: {{server: frozen}}
          seer: {{server: frozen}}
          witch: {{server: frozen}}
          hunter: {{server: frozen}}
          guard: {{server: frozen}}
          villager: {{scripted: true, count: 3, team: village}}
          wizard: {{server: small}}
        env: {{class: "{env_path}"}}
        run: {{max_steps: 1}}
        """))
    with pytest.raises(TopologyError) as info:
        Topology.load(path)
    (problem,) = info.value.problems
    assert (problem.key, problem.where) == ("roles.wizard", f"{path}:11")
    assert "servers.small plays no role the env deals, so it would never get an episode" in problem.message
    assert Topology.load(path, check_env=False).linked_servers() == ["small"]  # only the env knows it never plays


# ---------------------------------------------------------------------------------------------------------------
# Files: overrides, line numbers, missing files
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, fragment", [
    ("run.max_steps", "expected key=value"),
    ("=5", "bad key"),
    ("run..max_steps=5", "bad key"),
    ("run.max_steps=[1,", "cannot parse the value"),
])
def test_bad_override(override, fragment):
    with pytest.raises(TopologyError) as info:
        Topology.load(CPU, [override], check_env=False)
    assert f"override {override!r}" in str(info.value) and fragment in str(info.value)


def test_override_errors_point_at_the_override():
    with pytest.raises(TopologyError) as info:
        Topology.load(CPU, ["roles.listener.server=lstener"], check_env=False)
    (problem,) = info.value.problems
    assert problem.key == "roles.listener.server"
    assert problem.where == "override 'roles.listener.server=lstener'"
    assert "unknown server 'lstener'; known servers: speaker_model, listener_model (did you mean 'listener_model'?)" \
        in str(problem)
    with pytest.raises(TopologyError, match=r"override 'run.max_stepz=3': run.max_stepz: unknown key"):
        Topology.load(CPU, ["run.max_stepz=3"], check_env=False)
    with pytest.raises(TopologyError, match=r"signalling-cpu.yaml:\d+: run.max_steps: Input should be a valid int"):
        Topology.load(CPU, ["run.max_steps.x=3"], check_env=False)  # the key is in the file: its line
    with pytest.raises(TopologyError) as info:  # a server only the override mentions
        Topology.load(CPU, ["servers.extra.trainable=false"], check_env=False)
    (problem,) = info.value.problems
    assert (problem.key, problem.where) == ("servers.extra", "override 'servers.extra.trainable=false'")


def test_errors_carry_line_numbers(tmp_path, env_path):
    path = tmp_path / "typo.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: typo
        servers:
          a:
            model: smollm2-135m
            trainable: true
            train: {{num_repeat: 4}}
        roles:
          r:
            server: b
        env:
          class: "{env_path}"
        run: {{max_steps: 2}}
        """))
    with pytest.raises(TopologyError) as info:
        Topology.load(path)
    assert info.value.problems[0].where == f"{path}:9"
    assert f"{path}:9: roles.r.server: unknown server 'b'" in str(info.value)

    path.write_text(path.read_text().replace("trainable: true", "trainable: true\n    devise: cpu"))
    with pytest.raises(TopologyError) as info:
        Topology.load(path)
    assert f"{path}:6: servers.a.devise: unknown key 'devise' (did you mean 'device'?)" in str(info.value)


def test_yaml_syntax_error_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nroles: [a,\nenv: 1\n")
    with pytest.raises(TopologyError, match="not valid YAML"):
        Topology.load(bad)
    with pytest.raises(TopologyError, match="no such topology file") as info:
        Topology.load(tmp_path / "nope.yaml")
    assert "bad.yaml" in str(info.value)  # lists the topologies next to it
    with pytest.raises(TopologyError, match="did you mean") as info:
        Topology.load(REPO / "topologies" / "signalling-cpu.yml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(TopologyError, match="a topology is a YAML mapping"):
        Topology.load(empty)


def test_unresolvable_interpolation_names_its_key(tmp_path, monkeypatch):
    monkeypatch.delenv("TOPO_UNSET_VAR", raising=False)
    path = tmp_path / "t.yaml"
    path.write_text("name: t\nservers:\n  big: {url: '${oc.env:TOPO_UNSET_VAR}', model: m}\n"
                    "roles: {r: {server: big}}\nenv: {class: 'argparse:Namespace'}\nrun: {games: 1}\n")
    with pytest.raises(TopologyError) as info:
        Topology.load(path)
    assert "servers.big.url" in str(info.value) and "TOPO_UNSET_VAR" in str(info.value)
    assert f"{path}:3" in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# marl topology show
# ---------------------------------------------------------------------------------------------------------------


def test_cli_show(capsys):
    main(["topology", "show", "--no-env-check", str(THREE), "run.max_steps=7"])
    out = capsys.readouterr().out
    for text in ["signalling-3-servers", "speaker_model", "local trainable", "frozen", "local static",
                 "observer ×1", "envs.signalling:SignallingGame", "num_items=3", "max_steps=7", "repeats=4",
                 "grpo={'learning_rate': 2e-05}", "teams"]:
        assert text in out, text
    assert "\x1b[" not in out  # plain text when piped


def test_cli_show_all_kinds(base, tmp_path, capsys):
    import yaml

    path = tmp_path / "wolves.yaml"
    base["roles"]["guard"]["server"] = "big"  # leaves `frozen` unused: a warning
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    main(["topology", "show", str(path)])
    out = capsys.readouterr().out
    for text in ["remote swarm", "external OpenAI", "swarm_url=http://gpu-box:10086", "werewolf ×3",
                 "scripted roles", "villager ×3", "wolves", "village", "warnings", "no role uses this server",
                 "teams  (as the env deals them)"]:
        assert text in out, text


def test_cli_show_reports_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["topology", "show", str(CPU), "roles.listener.server=lstener", "--no-env-check"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "roles.listener.server: unknown server 'lstener'" in err and "did you mean 'listener_model'" in err


def test_a_section_of_the_trainer_not_run_is_a_warning(base):
    """`grpo:` under `trainer: fsdp` would be silently ignored: the warning names it; the run's section is quiet."""
    base["servers"]["small"]["train"] = {**train(), "trainer": "fsdp", "grpo": {"learning_rate": 1e-4},
                                         "fsdp": {"learning_rate": 3e-6}}
    warnings = Topology.from_dict(base).warnings
    assert [w.key for w in warnings] == ["servers.small.train.grpo"]
    assert "ignored: trainer is fsdp" in warnings[0].message
    base["servers"]["small"]["train"].pop("grpo")
    assert Topology.from_dict(base).warnings == []
