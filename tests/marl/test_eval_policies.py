"""`marl eval` and `run.eval_every` for roles played by LoRA policies: each role plays its own policy's checkpoints
(the adapter on the server's base model), two policies of one server are two players; past_of such a server is
refused for now. Real adapter checkpoints of a tiny model (`LoraGRPOTrainer.save`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from marl.eval.command import main
from marl.eval.pairings import checkpointed_roles, plan_pairings
from marl.eval.periodic import PeriodicEval
from marl.games.record import GameRecord
from marl.league.snapshots import SnapshotError, checkpoints_of, resolve_snapshot
from marl.protocol import GRPOConfig, LoraSpec
from marl.topology import Topology, TopologyError

SPEC = LoraSpec(rank=4, alpha=8)


def lora_topology(model: str, run_dir: str, **run) -> dict:
    """Speaker and listener as two LoRA policies of server `team`; an observer on a static server."""
    train = {"job": "tiny", "batch_size": 1, "num_repeat": 2, "save_freq": 1}
    lora = {"rank": SPEC.rank, "alpha": SPEC.alpha}
    return {
        "name": "tiny-eval-lora",
        "servers": {"team": {"model": model, "trainable": True, "device": "cpu", "train": train,
                             "policies": {"speaker": {"lora": lora}, "listener": {"lora": lora}}},
                    "frozen": {"model": model, "device": "cpu"}},
        "roles": {"speaker": {"server": "team", "policy": "speaker"},
                  "listener": {"server": "team", "policy": "listener"}, "observer": {"server": "frozen"}},
        "env": {"class": "envs.signalling:SignallingGame", "args": {"num_items": 3, "observers": 1}},
        "run": {"max_steps": 2, "run_dir": run_dir, "max_tokens": 6, **run},
    }


def policy_checkpoints(run_dir: Path, policy: str) -> Path:
    return run_dir / "servers" / "team" / "policies" / policy / "checkpoints"


@pytest.fixture(scope="module")
def saved_adapter(tiny_model, tmp_path_factory) -> Path:
    """A policy checkpoint as the LoRA trainer saves it (adapter/ + trainer_state.pt), its B made non-zero so that
    it plays otherwise than the base model."""
    from servers.trainers.lora_grpo import LoraGRPOTrainer

    directory = tmp_path_factory.mktemp("policy") / "step_000001"
    LoraGRPOTrainer(tiny_model, {"speaker": (SPEC, GRPOConfig())}, device="cpu").save("speaker", directory)
    weights = directory / "adapter" / "adapter_model.safetensors"
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(t.shape, generator=generator) * 0.5 if "lora_B" in name else t
               for name, t in load_file(weights).items()}
    save_file(tensors, weights)
    return directory


def install(checkpoint: Path, run_dir: Path, policy: str, step: int) -> Path:
    """A copy of `checkpoint` as step `step` of `policy` in the run directory."""
    import shutil

    target = policy_checkpoints(run_dir, policy) / f"step_{step:06d}"
    shutil.copytree(checkpoint, target)
    return target


def test_a_policys_snapshots_are_its_adapter_checkpoints_on_the_base_model(saved_adapter, tmp_path):
    run_dir = tmp_path / "run"
    topology = Topology.from_dict(lora_topology("smollm2-135m", str(run_dir)))
    for step in (2, 5):
        install(saved_adapter, run_dir, "speaker", step)
    (policy_checkpoints(run_dir, "speaker") / ".step_000007.tmp-0a1b").mkdir()  # an interrupted save
    assert list(checkpoints_of(run_dir, "team", "speaker")) == [2, 5] and checkpoints_of(run_dir, "team") == {}
    resolve = lambda ref: resolve_snapshot(topology, run_dir, "team.speaker", ref)  # noqa: E731
    latest = resolve("latest")
    assert (latest.server, latest.policy, latest.version, latest.model) == ("team", "speaker", 5, "smollm2-135m")
    assert latest.adapter == str(policy_checkpoints(run_dir, "speaker") / "step_000005" / "adapter")
    assert (latest.name, latest.learner, latest.label) == ("team.speaker@v5", "team.speaker", "v5")
    assert resolve("2").adapter == resolve("v2").adapter == resolve("step_2").adapter
    initial = resolve("initial")  # the base model alone: a new adapter (B = 0) changes nothing
    assert (initial.version, initial.model, initial.adapter, initial.name) == (0, "smollm2-135m", None,
                                                                              "team.speaker@initial")
    assert resolve("0") == initial
    by_path = [resolve(str(policy_checkpoints(run_dir, "speaker") / "step_000005" / sub)) for sub in ("", "adapter")]
    assert all((s.version, s.adapter, s.label) == (5, latest.adapter, "v5") for s in by_path)
    with pytest.raises(SnapshotError, match="servers.team.policies.listener has no checkpoint in"):
        resolve_snapshot(topology, run_dir, "team.listener", "latest")  # no checkpoint yet: no latest
    listener = resolve_snapshot(topology, run_dir, "team.listener", "latest", latest_may_be_initial=True)
    assert (listener.version, listener.name) == (0, "team.listener@initial") and listener != initial


def test_a_policys_missing_checkpoint_names_its_directory(saved_adapter, tmp_path):
    run_dir = tmp_path / "run"
    topology = Topology.from_dict(lora_topology("smollm2-135m", str(run_dir)))
    install(saved_adapter, run_dir, "speaker", 2)
    where = policy_checkpoints(run_dir, "speaker")
    with pytest.raises(SnapshotError, match=rf"servers.team.policies.speaker has no checkpoint of step 3 in {where}"
                                            r" \(steps kept: 2; also initial\)"):
        resolve_snapshot(topology, run_dir, "team.speaker", "3")
    with pytest.raises(SnapshotError, match="servers.team trains LoRA policies.*team.speaker, team.listener"):
        resolve_snapshot(topology, run_dir, "team", "latest")
    with pytest.raises(SnapshotError, match="not a LoRA adapter checkpoint of policy speaker"):
        resolve_snapshot(topology, run_dir, "team.speaker", str(tmp_path))


def test_pairings_seat_each_role_on_its_own_policy(saved_adapter, tmp_path):
    run_dir = tmp_path / "run"
    topology = Topology.from_dict(lora_topology("smollm2-135m", str(run_dir)))
    install(saved_adapter, run_dir, "speaker", 1)
    install(saved_adapter, run_dir, "listener", 2)
    assert checkpointed_roles(topology) == ["speaker", "listener"]
    pairings = plan_pairings(topology, run_dir, {"speaker": ["initial", "latest"], "listener": ["initial", "latest"]})
    assert [p.label for p in pairings] == ["speaker=initial listener=initial", "speaker=initial listener=v2",
                                           "speaker=v1 listener=initial", "speaker=v1 listener=v2"]
    first, last = pairings[0].seats, pairings[-1].seats
    assert first["speaker"].name == "team.speaker@initial" != first["listener"].name == "team.listener@initial"
    assert [last[r].adapter for r in ("speaker", "listener")] == [
        str(policy_checkpoints(run_dir, role) / f"step_00000{step}" / "adapter") for role, step in (("speaker", 1),
                                                                                                  ("listener", 2))]
    assert pairings[-1].describe()["listener"]["policy"] == "listener"


def test_periodic_eval_pairs_learners(saved_adapter, tmp_path):
    run_dir = tmp_path / "run"
    topology = Topology.from_dict(lora_topology("smollm2-135m", str(run_dir), eval_every=1))
    evals = PeriodicEval(topology, run_dir, "token")
    try:
        assert evals.reached() == 0 and list(evals.pairings(0)) == ["latest"]
        install(saved_adapter, run_dir, "speaker", 1)
        assert evals.reached() == 0  # the listener has no checkpoint yet
        install(saved_adapter, run_dir, "listener", 1)
        assert evals.reached() == 1
        pairings = evals.pairings(1)
        assert list(pairings) == ["latest", "team.speaker latest", "team.listener latest"]
        assert pairings["team.speaker latest"].label == "speaker=v1 listener=initial"
        assert pairings["team.listener latest"].seats["speaker"].name == "team.speaker@initial"
    finally:
        evals.close()


def test_past_of_a_server_of_policies_names_its_policy(tmp_path):
    data = lora_topology("smollm2-135m", str(tmp_path / "run"))
    data["servers"]["old"] = {"past_of": {"server": "team"}, "device": "cpu"}
    data["roles"]["observer"] = {"server": "old"}
    with pytest.raises(TopologyError, match="servers.old.past_of.*servers.team trains LoRA policies, each with its"
                                            " own checkpoints: name the one to play with policy:"):
        Topology.from_dict(data)


def test_eval_every_checks_each_policys_save_freq(tmp_path):
    data = lora_topology("smollm2-135m", str(tmp_path / "run"), eval_every=2)
    data["servers"]["team"]["policies"]["listener"]["train"] = {"save_freq": 0}
    with pytest.raises(TopologyError, match="servers.team.policies.listener.train.save_freq is 0"):
        Topology.from_dict(data)
    data["servers"]["team"]["policies"]["listener"]["train"] = {"save_freq": 3}
    assert any("servers.team.policies.listener.train.save_freq (3)" in str(w)
               for w in Topology.from_dict(data).warnings)


def test_eval_plays_a_policys_adapter_checkpoint(tiny_model, saved_adapter, tmp_path, capsys):
    run_dir = tmp_path / "run"
    install(saved_adapter, run_dir, "speaker", 1)
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(lora_topology(str(tiny_model), str(run_dir)), sort_keys=False))
    out = tmp_path / "eval"
    main([str(path), "speaker=initial,latest", "listener=initial,latest", "run.seed=0", "--games", "2",
          "--concurrency", "1", "--out", str(out)])
    assert "speaker=v1 listener=initial" in capsys.readouterr().out
    pairings = json.loads((out / "eval.json").read_text())["pairings"]
    # the listener has no checkpoint: its latest is its initial, the same snapshot
    assert [p["label"] for p in pairings] == ["speaker=initial listener=initial"] * 2 + [
        "speaker=v1 listener=initial"] * 2
    for pairing in pairings:
        seats = pairing["seats"]
        assert (seats["speaker"]["policy"], seats["listener"]["policy"]) == ("speaker", "listener")
        for game in map(GameRecord.model_validate, pairing["games"]):
            speaker, listener = game.co_players["speaker"], game.co_players["listener"]
            assert (speaker.snapshot_of, speaker.policy_version) == ("team.speaker", seats["speaker"]["version"])
            assert speaker.server == f"team.speaker@{seats['speaker']['label']}"
            assert (listener.snapshot_of, listener.server) == ("team.listener", "team.listener@initial")
            assert game.episodes == {}
    speaker_says = [[turn.action for g in p["games"] for turn in GameRecord.model_validate(g).transcript
                     if turn.role == "speaker"] for p in pairings]
    assert speaker_says[0] == speaker_says[1] and speaker_says[2] == speaker_says[3]  # greedy, the same seeds
    assert speaker_says[0] != speaker_says[2]  # v1 is its adapter on the base model, not the base model
    logs = sorted(path.name for path in (out / "logs").glob("team*.log"))  # one static server per snapshot
    assert logs == ["team.listener@initial.log", "team.speaker@initial.log", "team.speaker@v1.log"]
