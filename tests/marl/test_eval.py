"""`marl eval`: intervals computed right, checkpoints resolved, every pairing played on the same seeds."""

from __future__ import annotations

import csv
import json
import math
import shutil

import pytest
import yaml
from PIL import Image

from envs.signalling import SignallingGame
from marl.eval.command import main, split_arguments
from marl.eval.matrix import PairingResult, win_rules_caption
from marl.eval.pairings import Pairing, plan_pairings, run_dir_of
from marl.eval.stats import WIN_RULES, mean_interval, role_stats, role_won, t_value, wilson_interval, win_rule
from marl.games.record import GameRecord
from marl.games.table import goals_by_role
from marl.league.snapshots import SnapshotError, checkpoints_of, resolve_snapshot
from marl.topology import Topology
from marl.watching.plot import replot_eval_matrix


def topology_dict(model: str, run_dir: str) -> dict:
    train = {"job": "tiny", "batch_size": 1, "num_repeat": 2, "save_freq": 1}
    return {
        "name": "tiny-eval",
        "servers": {"speaker_model": {"model": model, "trainable": True, "device": "cpu", "train": train},
                    "listener_model": {"model": model, "trainable": True, "device": "cpu", "train": train},
                    "frozen": {"model": model, "device": "cpu"}},
        "roles": {"speaker": {"server": "speaker_model"}, "listener": {"server": "listener_model"},
                  "observer": {"server": "frozen"}},
        "env": {"class": "envs.signalling:SignallingGame", "args": {"num_items": 3, "observers": 1}},
        "run": {"max_steps": 2, "run_dir": run_dir, "max_tokens": 6},
    }


# --- statistics -------------------------------------------------------------------------------------------------


def test_wilson_interval_of_known_binomial_cases():
    low, high = wilson_interval(8, 10)  # the textbook case: 8 of 10 at 95%
    assert low == pytest.approx(0.4902, abs=5e-4) and high == pytest.approx(0.9433, abs=5e-4)
    low, high = wilson_interval(0, 4)  # no collapse to a point at 0/n
    assert low == 0.0 and high == pytest.approx(0.4899, abs=5e-4)
    assert wilson_interval(10, 10)[1] == 1.0 and wilson_interval(10, 10)[0] == pytest.approx(0.7225, abs=5e-4)
    assert all(math.isnan(x) for x in wilson_interval(0, 0))


def test_t_intervals_match_the_table():
    for df, quantile in ((1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (29, 2.045), (120, 1.980)):
        assert t_value(df) == pytest.approx(quantile, abs=1e-3), df
    mean, low, high = mean_interval([1.0, 2.0, 3.0, 4.0, 5.0])  # s = 1.5811, t(4) = 2.7764: ± 1.9632
    assert (mean, low, high) == (3.0, pytest.approx(1.0368, abs=1e-3), pytest.approx(4.9632, abs=1e-3))
    assert math.isnan(mean_interval([0.5])[1]) and math.isnan(mean_interval([])[0])


def test_wins_rewards_and_valid_replies_per_role():
    teams = {"wolf": "wolves", "seer": "village"}
    games = [GameRecord(role_rewards={"wolf": 1.0, "seer": 0.0}, winner="wolves", teams=teams,
                        replies={"wolf": 4, "seer": 2}, invalid_actions={"wolf": 1}),
             GameRecord(role_rewards={"wolf": 0.0, "seer": 1.0}, winner="village", teams=teams,
                        replies={"wolf": 4, "seer": 2}),
             GameRecord(role_rewards={"wolf": 0.5, "seer": 0.0})]  # no winner recorded: a positive reward wins
    assert [role_won(g, "wolf") for g in games] == [True, False, True]
    stats = role_stats(games, "wolf")
    assert (stats.games, stats.wins, stats.win_rate) == (3, 2, pytest.approx(2 / 3))
    assert (stats.win_low, stats.win_high) == wilson_interval(2, 3)
    assert stats.mean_reward == pytest.approx(0.5) and stats.valid_reply_rate == pytest.approx(1 - 1 / 8)
    assert (stats.reward_low, stats.reward_high) == pytest.approx(mean_interval([1.0, 0.0, 0.5])[1:])


def test_a_shaping_bonus_is_no_win_where_the_env_says_the_goal_was_missed():
    """The signalling game pays the speaker a naming bonus even when the listener picks wrong; the team's goal (the
    listener's pick) decides the win, and the table says so."""
    env = SignallingGame(num_items=3, naming_bonus=0.5)
    records = []
    for right in (True, False):
        env.reset(seed=3)
        env.step(f"The {env.target}!")  # names the target: the bonus
        env.step(env.target if right else next(item for item in env.items if item != env.target))
        records.append(GameRecord(role_rewards=env.outcome_by_role(), goals=goals_by_role(env),
                                  winner=env.winner, teams={env.role_of(a): env.team_of(a) for a in env.agents}))
    assert [r.role_rewards["speaker"] for r in records] == [1.5, 0.5]  # positive both times
    assert [win_rule(r, "speaker") for r in records] == ["goal", "goal"]
    assert [role_won(r, "speaker") for r in records] == [True, False]
    assert [role_won(r, "listener") for r in records] == [True, False]
    speaker = role_stats(records, "speaker")
    assert (speaker.wins, speaker.win_rule) == (1, "goal")
    older = GameRecord(role_rewards={"speaker": 0.5})  # a row from before goals: a positive reward still wins
    assert win_rule(older, "speaker") == "reward" and role_won(older, "speaker")
    assert role_stats([*records, older], "speaker").win_rule == "mixed"
    pairing = Pairing(seats={})
    caption = win_rules_caption([PairingResult(pairing, [], {"speaker": speaker})])
    assert caption == f"a win of speaker: {WIN_RULES['goal']}"


# --- checkpoints ----------------------------------------------------------------------------------------------


def test_checkpoint_references_resolve_to_the_run_directory(tmp_path):
    topology = Topology.from_dict(topology_dict("smollm2-135m", str(tmp_path / "run")))
    root = tmp_path / "run" / "servers" / "speaker_model" / "checkpoints"
    for name in ("step_000002", "step_000005", ".step_000007.tmp-0a1b"):  # the last: an interrupted save
        (root / name).mkdir(parents=True)
    assert list(checkpoints_of(tmp_path / "run", "speaker_model")) == [2, 5]
    resolve = lambda ref: resolve_snapshot(topology, tmp_path / "run", "speaker_model", ref)  # noqa: E731
    assert (resolve("latest").version, resolve("latest").model) == (5, str(root / "step_000005"))
    assert resolve("2").version == resolve("v2").version == resolve("step_2").version == 2
    assert (resolve("initial").version, resolve("initial").model, resolve("0").label) == (0, "smollm2-135m", "initial")
    assert resolve(str(root / "step_000005")).version == 5
    with pytest.raises(SnapshotError, match=r"no checkpoint of step 3 .*steps kept: 2, 5"):
        resolve("3")
    # none yet: no latest (a wrong run directory must not play the initial model as if trained), unless allowed
    with pytest.raises(SnapshotError, match=r"servers.listener_model has no checkpoint in .*listener_model/checkpoints"
                                            r" \(no such directory\), so there is no latest.*Ask for initial"):
        resolve_snapshot(topology, tmp_path / "run", "listener_model", "latest")
    assert resolve_snapshot(topology, tmp_path / "run", "listener_model", "latest",
                            latest_may_be_initial=True).version == 0
    data = topology_dict("smollm2-135m", str(tmp_path / "run"))
    data["servers"]["listener_model"] = {"swarm_url": "http://127.0.0.1:9", "trainable": True,
                                         "train": data["servers"]["speaker_model"]["train"]}
    remote = Topology.from_dict(data)
    with pytest.raises(SnapshotError, match="remote swarm server: only local trainable servers keep checkpoints"):
        resolve_snapshot(remote, tmp_path / "run", "listener_model", "latest")


def test_pairings_are_every_combination_and_bad_choices_say_why(tmp_path):
    topology = Topology.from_dict(topology_dict("smollm2-135m", str(tmp_path / "run")))
    for server in ("speaker_model", "listener_model"):
        for step in (1, 2):
            (tmp_path / "run" / "servers" / server / "checkpoints" / f"step_00000{step}").mkdir(parents=True)
    choices, overrides = split_arguments(["speaker=0,1,2", "listener=initial,latest", "run.seed=3"])
    assert overrides == ["run.seed=3"]
    pairings = plan_pairings(topology, tmp_path / "run", choices)
    assert [p.label for p in pairings][:3] == ["speaker=initial listener=initial", "speaker=initial listener=v2",
                                               "speaker=v1 listener=initial"]
    assert len(pairings) == 6 and [p.seats["listener"].server for p in pairings] == ["listener_model"] * 6
    assert [p.label for p in plan_pairings(topology, tmp_path / "run", {})] == ["speaker=v2 listener=v2"]
    with pytest.raises(SnapshotError, match="played by frozen, which has no checkpoints"):
        plan_pairings(topology, tmp_path / "run", {"observer": ["1"]})
    with pytest.raises(SnapshotError, match="unknown role 'spaeker'"):
        plan_pairings(topology, tmp_path / "run", {"spaeker": ["1"]})


def test_latest_without_a_checkpoint_and_a_missing_run_directory_are_errors(tmp_path):
    topology = Topology.from_dict(topology_dict("smollm2-135m", str(tmp_path / "run")))
    (tmp_path / "run" / "servers" / "speaker_model" / "checkpoints" / "step_000002").mkdir(parents=True)
    with pytest.raises(SnapshotError, match="servers.listener_model has no checkpoint in"):
        plan_pairings(topology, tmp_path / "run", {})  # the listener plays latest by default
    # asked for with initial, latest is the initial model: both labelled initial, nothing silent
    pairings = plan_pairings(topology, tmp_path / "run", {"listener": ["initial", "latest"]})
    assert [p.label for p in pairings] == ["speaker=v2 listener=initial"] * 2
    assert run_dir_of(topology, None) == tmp_path / "run"
    assert run_dir_of(topology, str(tmp_path)) == tmp_path
    with pytest.raises(SnapshotError, match=r"--run-dir .*nope: no such directory"):
        run_dir_of(topology, str(tmp_path / "nope"))


# --- eval end to end on tiny models -----------------------------------------------------------------------------


def test_eval_plays_every_pairing_on_the_same_seeds(tiny_model, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_model, run_dir / "servers" / "speaker_model" / "checkpoints" / "step_000001")
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(topology_dict(str(tiny_model), str(run_dir)), sort_keys=False))
    out = tmp_path / "eval"
    # initial and 0 are the same snapshot: with the same seeds and greedy play, their games must be identical
    main([str(path), "speaker=initial,0,1", "listener=initial", "run.seed=0", "--games", "3", "--concurrency", "1",
          "--out", str(out)])
    printed = capsys.readouterr().out
    assert "speaker=v1 listener=initial" in printed and "win rate" in printed
    report = json.loads((out / "eval.json").read_text())
    pairings = report["pairings"]
    assert [p["label"] for p in pairings] == ["speaker=initial listener=initial"] * 2 + ["speaker=v1 listener=initial"]
    assert all(p["seeds"] == [0, 1, 2] for p in pairings)  # seed * 1_000_003 + i with seed 0
    for pairing in pairings:
        version = pairing["seats"]["speaker"]["version"]
        for game in map(GameRecord.model_validate, pairing["games"]):
            assert game.co_players["speaker"].policy_version == version
            assert game.co_players["speaker"].snapshot_of == "speaker_model"
            observer = game.co_players["observer"]  # a static server's model: no version, no snapshot
            assert observer.server.startswith("frozen@") and (observer.policy_version, observer.snapshot_of) == (None,
                                                                                                             None)
            assert game.episodes == {}  # static servers only: nothing leased, nothing recorded
        for role, stats in pairing["roles"].items():
            games = [GameRecord.model_validate(g) for g in pairing["games"]]
            assert stats["win_rule"] == "goal"  # the signalling game says whether each role's goal was met
            assert stats["games"] == 3 and (stats["win_low"], stats["win_high"]) == pytest.approx(
                wilson_interval(sum(role_won(g, role) for g in games), 3))
    first, again = ([(g["role_rewards"], g["replies"]) for g in p["games"]] for p in pairings[:2])
    assert first == again
    rows = list(csv.DictReader((out / "eval.csv").open()))
    assert len(rows) == 3 * 3 and {r["role"] for r in rows} == {"speaker", "listener", "observer"}
    assert {r["speaker_checkpoint"] for r in rows} == {"initial", "v1"}
    with Image.open(out / "eval.png") as image:  # one heatmap per evaluated role, side by side
        width = image.size[0]
        assert width > 3 * 300
    (out / "eval.png").unlink()
    assert replot_eval_matrix(out) == out / "eval.png"  # `marl plot` draws it again from eval.json
    with Image.open(out / "eval.png") as image:
        assert image.size[0] == width


def test_eval_refuses_a_missing_checkpoint_with_exit_2(tiny_model, tmp_path, capsys):
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(topology_dict(str(tiny_model), str(tmp_path / "run"))))
    with pytest.raises(SystemExit) as info:
        main([str(path), "speaker=7", "listener=initial"])
    assert info.value.code == 2
    assert "servers.speaker_model has no checkpoint of step 7" in capsys.readouterr().err


def test_role_checkpoints_may_follow_options_on_the_command_line():
    from marl.cli import parse

    args = parse(["eval", "t.yaml", "listener=0", "--games", "8", "speaker=0,5", "run.seed=3"])
    assert args.pairs == ["listener=0", "speaker=0,5", "run.seed=3"] and args.games == 8
    args = parse(["topology", "show", "t.yaml", "--no-env-check", "run.max_steps=2"])
    assert args.overrides == ["run.max_steps=2"] and args.no_env_check
    for bad in (["eval", "t.yaml", "--games", "8", "--bogus"], ["eval", "t.yaml", "--games", "8", "listener"],
                ["status", "http://x", "a=b"]):
        with pytest.raises(SystemExit):
            parse(bad)
