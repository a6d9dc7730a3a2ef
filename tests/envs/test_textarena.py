"""TextArena games as marl envs (`envs/textarena_env.py`): four games of different kinds under PettingZoo's
`api_test` and played to the end by scripted players, TextArena's invalid moves and rewards, seeds, a topology that
names a game by id (and refuses an unknown id, a bad player count, a game that needs the internet), and a
`marl run` of each of the four on a tiny model."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import warnings
from collections import Counter

import pytest
import yaml
from pettingzoo.test import api_test

from envs.base import RoleInfo, play
from envs.textarena_env import GameRefused, TextArenaEnv
from marl.games.record import read_games
from marl.topology import Topology, TopologyError

pytest.importorskip("textarena")  # an optional extra: pip install 'marl[textarena]'

from conftest import ledger_samples  # noqa: E402

#: One game of each kind the issue names: social deduction with roles, a two-player card game, an iterated matrix
#: game, a negotiation.
GAMES = [("SecretMafia-v0", {"num_players": 6, "game_args": {"discussion_rounds": 1}}), ("KuhnPoker-v0", {}),
         ("IteratedPrisonersDilemma-v0", {}), ("SimpleNegotiation-v0", {})]


def quiet_api_test(env, num_cycles=10):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # api_test warns that text spaces are not Box/Discrete
        api_test(env, num_cycles=num_cycles)


def scripted_game(env: TextArenaEnv, seed: int) -> dict[str, float]:
    return play(env, {a: (lambda obs, a=a: env.scripted_action(a)) for a in env.possible_agents}, seed=seed)


@pytest.mark.parametrize("game, args", GAMES, ids=[g for g, _ in GAMES])
def test_api_test_passes(game, args):
    quiet_api_test(TextArenaEnv(game, **args), num_cycles=10)


@pytest.mark.parametrize("game, args", GAMES, ids=[g for g, _ in GAMES])
def test_a_scripted_game_plays_to_the_end_with_textarenas_rewards(game, args):
    env = TextArenaEnv(game, **args)
    outcome = scripted_game(env, seed=3)
    assert env.agents == [] and env.final_rewards and outcome == env.final_rewards  # TextArena's rewards, as is
    assert set(outcome) == set(env.possible_agents)
    summary = env.summary()
    assert summary["game"] == game and summary["reason"] and summary["winner"] == env.winner
    assert env.winner is not None
    assert set(env.replies_by_role) == set(env.dealt_roles())
    labels = env.action_labels()
    assert labels and all(label == "invalid" or label == "talk" or label.startswith("[")
                          for moves in labels.values() for label in moves)
    assert sum(env.invalid_actions.values()) == sum(moves.count("invalid") for moves in labels.values())


def test_secret_mafia_deals_roles_in_teams_and_its_summary_has_the_deaths_and_the_winner():
    env = TextArenaEnv("SecretMafia-v0", num_players=6, game_args={"discussion_rounds": 1})
    assert env.dealt_roles() == {"detective": RoleInfo("village", 1), "doctor": RoleInfo("village", 1),
                                 "mafia": RoleInfo("mafia", 2), "villager": RoleInfo("village", 2)}
    with pytest.raises(RuntimeError, match="reset"):
        env.role_of("player_0")
    scripted_game(env, seed=5)
    roles = {a: env.role_of(a) for a in env.possible_agents}
    assert Counter(roles.values()) == {"mafia": 2, "villager": 2, "doctor": 1, "detective": 1}
    summary = env.summary()
    assert summary["roles"] == roles and summary["deaths"] and all("Player" in d for d in summary["deaths"])
    assert env.winner in ("mafia", "village") and "wins" in summary["reason"]
    winners = {a for a, r in env.final_rewards.items() if r == 1}
    assert winners == {a for a in roles if env.team_of(a) == env.winner}
    assert all(env.goal_met(a) == (a in winners) for a in roles)
    first = env.observe("player_0")  # the last news; the first turn began with the rules and the role
    assert isinstance(first, str)


def test_the_first_observation_is_textarenas_prompt_and_the_system_prompt_its_own():
    env = TextArenaEnv("KuhnPoker-v0")
    env.reset(seed=0)
    obs = env.observe(env.agent_selection)
    assert obs.startswith("[GAME] You are Player") and "Kuhn Poker" in obs and "[check]" in obs
    assert "competitive game player" in env.system_prompt("player_0")


def test_an_invalid_move_is_textarenas_call_counted_and_its_penalty_ends_the_game():
    env = TextArenaEnv("KuhnPoker-v0")
    env.reset(seed=0)
    agent = env.agent_selection
    env.step("I raise the stakes")  # no bracketed move: invalid, TextArena asks again (its error allowance)
    assert env.agent_selection == agent and env.invalid_actions_by_role[agent] == 1
    assert "attempted an invalid move" in env.observe(agent)
    env.step("still nothing")  # twice in a row: TextArena ends the game, the invalid player loses
    other = next(a for a in env.possible_agents if a != agent)
    assert env.final_rewards == {agent: -1.0, other: 1.0} and env.winner == other
    assert env.summary()["penalized_for_invalid_moves"] == [agent]
    assert env.action_labels()[agent] == ["invalid", "invalid"]


def test_a_seed_replays_the_same_game_and_another_seed_another():
    def game(seed: int):
        env = TextArenaEnv("SecretMafia-v0", num_players=6, game_args={"discussion_rounds": 1})
        scripted_game(env, seed)
        return env.summary(), env.action_labels()

    assert game(7) == game(7)
    assert any(game(s)[0]["roles"] != game(7)[0]["roles"] for s in (8, 9, 10))


def test_rotated_seats_put_each_agent_in_every_seat_by_the_seed_and_its_rewards_follow_it():
    """Kuhn Poker, one round: TextArena's Player 1 opens. Seated as named, player_1 opens every game; rotated, the
    opener alternates with the seed, and the reward, the invalid-move penalty and the summary follow the agent."""
    def opener(seed: int, **args) -> str:
        env = TextArenaEnv("KuhnPoker-v0", game_args={"max_rounds": 1}, **args)
        env.reset(seed=seed)
        return env.agent_selection

    assert [opener(seed) for seed in range(4)] == ["player_1"] * 4
    assert [opener(seed, rotate_seats=True) for seed in range(4)] == ["player_1", "player_0"] * 2
    env = TextArenaEnv("KuhnPoker-v0", game_args={"max_rounds": 1}, rotate_seats=True)
    env.reset(seed=1)
    assert env.summary()["seats"] == {"player_1": "Player 0", "player_0": "Player 1"}
    assert "Player 1" in env.observe("player_0")  # TextArena's own text names the seat it sits in
    env.step("no move")
    env.step("no move again")  # player_0, in seat 1, loses by two invalid moves
    assert env.final_rewards == {"player_0": -1.0, "player_1": 1.0} and env.winner == "player_1"
    assert env.summary()["penalized_for_invalid_moves"] == ["player_0"] and env.invalid_actions_by_role == {
        "player_0": 2, "player_1": 0}
    assert scripted_game(env, seed=5) == env.final_rewards  # and a scripted game ends
    quiet_api_test(TextArenaEnv("KuhnPoker-v0", rotate_seats=True))


def test_roles_per_seat_or_one_shared_role():
    assert TextArenaEnv("KuhnPoker-v0").dealt_roles() == {"player_0": RoleInfo("player_0"),
                                                          "player_1": RoleInfo("player_1")}
    assert TextArenaEnv("KuhnPoker-v0", shared_role="player").dealt_roles() == {"player": RoleInfo("player", 2)}


def test_the_env_refuses_an_unknown_id_a_bad_player_count_and_a_game_that_needs_the_internet():
    with pytest.raises(GameRefused, match="did you mean 'KuhnPoker-v0'") as info:
        TextArenaEnv("KuhnPokr-v0")
    assert info.value.arg == "game"
    with pytest.raises(GameRefused, match="refuses 3 players") as info:
        TextArenaEnv("KuhnPoker-v0", num_players=3)
    assert info.value.arg == "num_players"
    with pytest.raises(GameRefused, match="cannot run offline"):
        TextArenaEnv("Codenames-v0", num_players=4)


# --- in a topology --------------------------------------------------------------------------------------------------

def kuhn_topology(**env) -> dict:
    return {"name": "kuhn", "servers": {}, "roles": {"player_0": {"scripted": True}, "player_1": {"scripted": True}},
            "env": {"textarena": "KuhnPoker-v0", **env}, "run": {"games": 1}}


def load_problems(data: dict) -> dict[str, str]:
    with pytest.raises(TopologyError) as info:
        Topology.from_dict(data)
    return {p.key: p.message for p in info.value.problems}


def test_a_topology_names_a_textarena_game_by_id():
    topology = Topology.from_dict(kuhn_topology())
    env = topology.make_env()
    assert isinstance(env, TextArenaEnv) and env.game == "KuhnPoker-v0"
    mafia = {"name": "mafia", "servers": {}, "env": {"textarena": "SecretMafia-v0", "args": {"num_players": 6}},
             "roles": {r: {"scripted": True} for r in ("mafia", "villager", "doctor", "detective")},
             "run": {"games": 1}}
    assert Topology.from_dict(mafia).make_env().dealt_roles()["mafia"] == RoleInfo("mafia", 2)
    mafia["roles"]["mafia"]["team"] = "village"
    assert "puts mafia in team 'mafia'" in load_problems(mafia)["roles.mafia.team"]


def test_a_topology_refuses_an_unknown_id_a_bad_player_count_and_an_online_game_at_the_key():
    assert "did you mean 'KuhnPoker-v0'" in load_problems({**kuhn_topology(), "env": {"textarena": "KuhnPokr-v0"}})[
        "env.textarena"]
    problems = load_problems(kuhn_topology(args={"num_players": 3}))
    assert "KuhnPoker-v0 refuses 3 players" in problems["env.args.num_players"]
    assert "cannot run offline" in load_problems({**kuhn_topology(), "env": {"textarena": "Codenames-v0", "args": {
        "num_players": 4}}})["env.textarena"]
    assert "num_player" in load_problems(kuhn_topology(args={"num_player": 2}))["env.args.num_player"]
    both = load_problems(kuhn_topology(**{"class": "envs.signalling:SignallingGame"}))
    assert any("not both" in message for message in both.values())


# --- marl run on tiny models ------------------------------------------------------------------------------------

#: Per game: the roles a model plays in the `marl run` test (the rest scripted) and TextArena args that keep it short.
RUN_GAMES = {"SecretMafia-v0": (("mafia", "villager"), {"num_players": 6, "game_args": {"discussion_rounds": 1}}),
             "KuhnPoker-v0": (("player_0", "player_1"), {"game_args": {"max_rounds": 1}}),
             "IteratedPrisonersDilemma-v0": (("player_0", "player_1"), {"game_args": {"num_rounds": 1}}),
             "SimpleNegotiation-v0": (("player_0", "player_1"), {"game_args": {"max_turns": 2}})}


@pytest.mark.heavy  # boots a server (tests/conftest.py's HEAVY_FILES marks whole files)
@pytest.mark.parametrize("game", list(RUN_GAMES))
def test_marl_run_of_two_games_records_each_roles_episodes_with_textarenas_rewards(game, tiny_model, tmp_path):
    played, args = RUN_GAMES[game]
    dealt = TextArenaEnv(game, **args).dealt_roles()
    spec = {"name": "tiny-textarena",
            "servers": {"model": {"model": str(tiny_model), "trainable": True, "device": "cpu",
                                  "train": {"job": "ta", "batch_size": 1, "num_repeat": 2, "save_freq": 0}}},
            "roles": {role: {"server": "model"} if role in played else {"scripted": True} for role in dealt},
            "env": {"textarena": game, "args": args},
            "run": {"games": 2, "repeats": 2, "concurrency": 2, "max_tokens": 8, "run_dir": str(tmp_path / "run")}}
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(spec))
    result = subprocess.run([sys.executable, "-m", "marl.cli", "run", str(tmp_path / "topology.yaml")],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "120"})
    assert result.returncode == 0, result.stdout + result.stderr
    games = read_games(tmp_path / "run" / "games.jsonl")
    assert len(games) == 2
    for record in games:
        assert record.summary["game"] == game and set(record.role_rewards) == set(dealt)
        seats = record.summary["roles"]  # seat -> role
        for role in dealt:  # TextArena's rewards, by role: the mean over the seats dealt it
            rewards = [float(r) for seat, r in record.summary["rewards"].items() if seats[seat] == role]
            assert record.role_rewards[role] == pytest.approx(sum(rewards) / len(rewards))
    # The server's ledger holds every game's episode, and a sample for each role it played (an empty one for a
    # role that never moved, say a villager killed at night), rewarded as TextArena said.
    recorded = {g.episodes["model"]: g for g in games}
    samples = ledger_samples(tmp_path / "run" / "servers" / "model")
    assert {episode for episode, *_ in samples} == set(recorded)
    for episode, record in recorded.items():
        assert {agent for ep, _, agent, _ in samples if ep == episode} == set(played)
        assert all(reward == pytest.approx(record.role_rewards[agent]) for ep, _, agent, reward in samples
                   if ep == episode)


def ledger_episodes(data_dir) -> list[tuple[str, float]]:
    db = sqlite3.connect(data_dir / "ledger.sqlite")
    try:
        return db.execute("SELECT episode_id, reward FROM episodes").fetchall()
    finally:
        db.close()
