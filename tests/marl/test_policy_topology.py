"""LoRA policies in a topology: `servers.S.policies`, `roles.R.policy`, their errors at the key to change, and the
learners the coordinator leases (a policy is one, named `server.policy`)."""

from __future__ import annotations

import copy

import pytest

from marl.plan.topology_plan import plan_topology
from marl.topology import Topology
from tests.marl.test_topology import _DEL, _set, assert_problem, env_path, load_error, train  # noqa: F401 - env_path: a fixture


@pytest.fixture
def team(env_path) -> dict:  # noqa: F811 - the fixture of the same name
    """A server of two policies (speaker, listener) beside a plain trainable server (judge); the stand-in env deals
    other roles, so tests that load it whole skip the env check."""
    return {
        "name": "lora",
        "servers": {
            "team": {"model": "smollm2-135m", "trainable": True, "device": "cpu", "train": train(),
                     "policies": {"speaker": {"lora": {"rank": 8}},
                                  "listener": {"train": {"grpo": {"learning_rate": 3e-4}}}}},
            "judge": {"model": "smollm2-135m", "trainable": True, "device": "cpu", "train": train()},
        },
        "roles": {
            "speaker": {"server": "team", "policy": "speaker"},
            "listener": {"server": "team", "policy": "listener"},
            "referee": {"server": "judge"},
        },
        "env": {"class": env_path},
        "run": {"max_steps": 3},
    }


def test_each_policy_is_a_learner_with_its_own_config(team):
    topo = Topology.from_dict(team, check_env=False)
    assert topo.learners() == {"team.speaker": ("team", "speaker"), "team.listener": ("team", "listener"),
                               "judge": ("judge", None)}
    assert topo.role_learners() == {"speaker": "team.speaker", "listener": "team.listener", "referee": "judge"}
    assert topo.linked_learners() == ["team.speaker", "team.listener", "judge"]
    assert topo.players()["speaker"] == "team"  # the server that plays it: what starts processes and plans memory
    server = topo.spec.servers["team"]
    assert server.policies["speaker"].lora.rank == 8 and server.policies["listener"].lora.rank == 16  # default
    listener, speaker = server.policy_train("listener"), server.policy_train("speaker")
    assert listener.grpo.learning_rate == 3e-4 and speaker.grpo.learning_rate == server.train.grpo.learning_rate
    assert listener.grpo.micro_batch_tokens == server.train.grpo.micro_batch_tokens  # merged key by key
    assert listener.batch_size == server.train.batch_size


def test_policies_train_on_fsdp_ranks_together(team):
    team["servers"]["team"]["train"]["trainer"] = "fsdp"
    topo = Topology.from_dict(team, check_env=False)
    server = topo.spec.servers["team"]
    assert {server.policy_train(name).trainer for name in ("speaker", "listener")} == {"fsdp"}
    # the listener's own grpo: section would be ignored now
    assert [w.key for w in topo.warnings] == ["servers.team.policies.listener.train.grpo"]


def test_the_only_policy_needs_no_name(team):
    team["servers"]["team"]["policies"] = {"solo": {}}
    team["roles"] = {"speaker": {"server": "team"}, "listener": {"server": "team"}, "referee": {"server": "judge"}}
    assert Topology.from_dict(team, check_env=False).role_learners()["listener"] == "team.solo"


def test_the_shipped_lora_topology():
    topo = Topology.load("topologies/signalling-lora.yaml")
    assert topo.role_learners() == {"speaker": "team.speaker", "listener": "team.listener"}
    assert topo.local_servers() == ["team"]


CASES = {
    "missing policy": ({"roles.speaker.policy": _DEL}, "roles.speaker",
                       ["servers.team trains 2 policies (speaker, listener)", "policy:"]),
    "unknown policy": ({"roles.speaker.policy": "speakr"}, "roles.speaker.policy",
                       ["unknown policy 'speakr'", "speaker, listener", "did you mean 'speaker'"]),
    "policy of a plain server": ({"roles.referee.policy": "speaker"}, "roles.referee.policy",
                                 ["servers.judge trains one full-weight model", "add servers.judge.policies"]),
    "policy nobody plays": ({"roles.listener.policy": "speaker"}, "servers.team.policies.listener",
                            ["no role plays this policy"]),
    "policies of a static server": ({"servers.team.trainable": False, "servers.team.train": _DEL},
                                    "servers.team.policies", ["only a trainable swarm server"]),
    "bad policy name": ({"servers.team.policies.bad.name": {}}, "servers.team.policies.bad.name", ["letters"]),
    "empty policies": ({"servers.team.policies": {}}, "servers.team.policies", ["is empty"]),
    "bad lora rank": ({"servers.team.policies.speaker.lora": {"rank": 0}}, "servers.team.policies.speaker.lora.rank",
                      ["greater than or equal to 1"]),
    "unknown lora key": ({"servers.team.policies.speaker.lora": {"rnak": 8}},
                         "servers.team.policies.speaker.lora.rnak", []),
    "policy train not a config": ({"servers.team.policies.speaker.train": {"batch_size": 0}},
                                  "servers.team.policies.speaker.train", ["does not make a valid train config"]),
    "mixed trainers": ({"servers.team.policies.listener.train.trainer": "fsdp"}, "servers.team.policies.listener.train",
                       ["trainer: fsdp, policy speaker with grpo", "share one trainer"]),
    "mixed fsdp ranks": ({"servers.team.train.trainer": "fsdp",
                          "servers.team.policies.listener.train.fsdp": {"ranks": 4}},
                         "servers.team.policies.listener.train", ["fsdp.ranks", "share their FSDP ranks"]),
    "past_of without its policy": ({"servers.past": {"past_of": {"server": "team"}}}, "servers.past.past_of",
                                   ["servers.team trains LoRA policies", "policy: (one of speaker, listener)"]),
    "past_of an unknown policy": ({"servers.past": {"past_of": {"server": "team", "policy": "speakr"}}},
                                  "servers.past.past_of.policy", ["no policy 'speakr'", "did you mean 'speaker'"]),
    "past_of a plain server's policy": ({"servers.past": {"past_of": {"server": "judge", "policy": "speaker"}}},
                                        "servers.past.past_of.policy", ["servers.judge trains no LoRA policies",
                                                                        "remove policy"]),
    "num_repeat per policy": ({"servers.team.policies.speaker.train": {"num_repeat": 2}},
                              "servers.team.policies.speaker.train.num_repeat", ["keep their server's num_repeat"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_policy_errors_name_their_key(team, case):
    changes, key, fragments = CASES[case]
    data = copy.deepcopy(team)
    for dotted, value in changes.items():
        if dotted == "servers.team.policies.bad.name":
            data["servers"]["team"]["policies"]["bad.name"] = value  # a dotted name: _set would nest it
            data["roles"]["extra"] = {"server": "team", "policy": "bad.name"}
            continue
        _set(data, dotted, value)
    assert_problem(load_error(data), key, fragments, case)


def test_past_of_a_policy(team):
    team["servers"]["past"] = {"past_of": {"server": "team", "policy": "speaker", "k": 2}}
    team["roles"]["referee"]["server"] = "past"
    del team["servers"]["judge"]
    topo = Topology.from_dict(team, check_env=False)
    assert topo.past_of_servers()["past"].policy == "speaker"
    assert "team.speaker" in topo.learners() and "past" not in topo.learners()
    plan = plan_topology(topo.spec, host_memory=64e9)  # its snapshots are adapters on team: nothing of its own
    assert [s.server for s in plan.servers] == ["team"] and plan.skipped == []
