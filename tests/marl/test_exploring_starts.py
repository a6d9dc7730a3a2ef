"""`run.explore`: exploring starts. A share of tasks open with moves drawn uniformly from the legal moves, alike for
every repeat of a task; each is told to its player, and the model is asked only from the state they reach. Trained
(`trained: true`), the moves are drawn per repeat and asked of the model with its reply held to them."""

from __future__ import annotations

from collections import Counter

import pytest
import yaml
from conftest import ADMIN, LocalServer, admin_http, start_rolling

from marl.games.record import read_games
from marl.games.table import ExploringStarts, GameFailed, GameSettings, GameTable
from marl.topology import Topology, TopologyError
from tests.marl.test_role_sampling import TRAIN, Relay, topology

pytest.importorskip("pyspiel")


def kuhn_table(explore: ExploringStarts | None, player_factory=None) -> GameTable:
    from envs.openspiel_env import OpenSpielEnv
    return GameTable(lambda: OpenSpielEnv("kuhn_poker", deals="stratified"), {"player_0": None, "player_1": None},
                     GameSettings(explore=explore), player_factory)


def test_a_share_of_tasks_open_with_uniform_moves_alike_for_every_repeat():
    table = kuhn_table(ExploringStarts(share=0.5, moves=1))
    forced, first_moves = 0, Counter()
    for seed in range(240):
        games = [table.play("t", seed, {}, {}, episode=episode) for episode in range(3)]
        assert len({(g.forced_moves, g.transcript[0].action) for g in games}) == 1  # a task's repeats alike
        game = games[0]
        assert [turn.forced for turn in game.transcript] == [True] * game.forced_moves + [False] * (
            len(game.transcript) - game.forced_moves)
        if game.forced_moves:
            forced += 1
            first_moves[game.transcript[0].action] += 1
    assert 90 <= forced <= 150  # 0.5 of 240 tasks: 120, sd 7.7
    assert set(first_moves) == {"Pass", "Bet"} and min(first_moves.values()) >= forced * 0.3  # uniform: half each

    two = kuhn_table(ExploringStarts(share=1.0, moves=2)).play("t", 7, {}, {})
    assert two.forced_moves == 2 and [t.forced for t in two.transcript[:2]] == [True, True]
    assert kuhn_table(None).play("t", 7, {}, {}).forced_moves == 0


def test_trained_exploring_starts_draw_each_repeat_its_own_moves():
    table = kuhn_table(ExploringStarts(share=1.0, moves=1, trained=True))
    mixed = 0
    for seed in range(20):
        first = [table.play("t", seed, {}, {}, episode=e).transcript[0].action for e in range(6)]
        assert first == [table.play("t", seed, {}, {}, episode=e).transcript[0].action for e in range(6)]  # replays
        mixed += set(first) == {"Pass", "Bet"}
    assert mixed >= 15  # 6 uniform draws agree with probability 1/32


def test_a_player_that_cannot_be_told_a_move_fails_the_game_with_the_reason():
    class Forgetful:
        def act(self, observation: str) -> str:
            return "Pass"

    table = kuhn_table(ExploringStarts(share=1.0), player_factory=lambda seat: Forgetful())
    with pytest.raises(GameFailed, match="cannot be told one it did not choose.*remember"):
        table.play("t", 1, {}, {})
    table = kuhn_table(ExploringStarts(share=1.0, trained=True), player_factory=lambda seat: Forgetful())
    with pytest.raises(GameFailed, match="cannot be asked with its reply held to it.*act_held"):
        table.play("t", 1, {}, {})


def test_run_explore_is_checked_at_its_key(tmp_path):
    spec = {"name": "x", "servers": {}, "roles": {"player_0": {"scripted": True}, "player_1": {"scripted": True}},
            "env": {"openspiel": "kuhn_poker"}, "run": {"games": 1, "explore": {"share": 0}}}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(TopologyError, match="run.explore.share"):
        Topology.load(str(tmp_path / "t.yaml"))


# Enough games that some open Pass and then see player_1 bet (the only way player_0 is asked again when untrained):
# the tiny model's reply is sampled, so 6 games (about 3 openings of Pass) sometimes had none (CI, 2026-12-07).
GAMES = 30


@pytest.mark.parametrize("trained", [False, True])
def test_a_forced_move_is_in_the_models_conversation(trained, tiny_model, tmp_path, monkeypatch):
    """A real run on a tiny model: every game opens with a forced move. Told (untrained), player_0's first call is
    never its first turn, and the conversation it sends shows the forced move as its own reply, as `marl eval`
    reaches the state. Trained, the first call is its first turn, held to the drawn move, which it replies."""
    from marl.runner.run import run

    monkeypatch.setenv("ROLE_SAMPLING_ADMIN", ADMIN)
    with LocalServer(tiny_model, tmp_path / "server") as server, Relay(server.url) as relay:
        with admin_http(server.url) as http:
            start_rolling(http, **TRAIN)
        spec = yaml.safe_load(open(topology(tmp_path, {"player_0": {"server": "m", "sampling": {"choice": True}},
                                                       "player_1": {"server": "m", "sampling": {"choice": True}}},
                                            {"swarm_url": relay.url, "admin_token_env": "ROLE_SAMPLING_ADMIN",
                                             "trainable": True, "train": TRAIN})))
        spec["env"] = {"openspiel": "kuhn_poker", "args": {"max_invalid_retries": 0}}
        spec["run"].update(games=GAMES, explore={"share": 1.0, "trained": trained})
        (tmp_path / "kuhn.yaml").write_text(yaml.safe_dump(spec))
        summary = run(str(tmp_path / "kuhn.yaml"))
    assert summary.error is None and summary.games == GAMES
    games = read_games(tmp_path / "run" / "games.jsonl")
    assert all(g.forced_moves == 1 and g.transcript[0].agent == "player_0" for g in games)
    assert {g.transcript[0].action for g in games} <= {"Pass", "Bet"}
    calls = [(body, reply) for role, body, reply in relay.calls if role == "player_0"]
    player_1_calls = [body for role, body, _ in relay.calls if role == "player_1"]
    assert len(player_1_calls) == GAMES  # player_1 answers the forced opening in every game
    if not trained:
        assert calls  # it answered after Pass-Bet
        for body, _ in calls:  # system, the forced exchange, the state now: never asked at the opening
            assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
            assert body["messages"][2]["content"] == "Pass"  # player_0 moves again only after Pass, Bet
        return
    openings = [(body, reply) for body, reply in calls if len(body["messages"]) == 2]
    assert len(openings) == GAMES  # asked at the opening in every game, held to the drawn move, which it replied
    drawn = sorted(g.transcript[0].action for g in games)
    assert sorted(body["structured_outputs"]["choice"][0] for body, _ in openings) == drawn
    for body, reply in openings:
        assert body["structured_outputs"]["choice"] == [reply["choices"][0]["message"]["content"]]
