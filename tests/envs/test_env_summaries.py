"""`summary()`: what each env says about a finished game, for its transcript in games.jsonl (`marl games show`)."""

from __future__ import annotations

import json

from envs.adapter import text_tictactoe
from envs.base import GameEnv, TextAECEnv, play
from envs.signalling import SignallingGame
from envs.werewolves import ROLES, Werewolves
from tests.envs.test_envs import TinyTicTacToe


def scripted(env: TextAECEnv) -> dict:
    return {agent: (lambda obs, agent=agent: env.scripted_action(agent)) for agent in env.possible_agents}


def test_summary_is_optional_and_empty_by_default():
    class Coin(TextAECEnv):
        possible_agents = ["caller"]

        def _reset_game(self, seed, options):
            self.side = self.rng.choice(["heads", "tails"])

        def _observe_text(self, agent):
            return "Heads or tails?"

        def _apply(self, agent, action):
            self.terminations[agent] = True

    env = Coin()
    play(env, {"caller": lambda obs: "heads"}, seed=0)
    assert env.summary() == {}
    assert "summary" not in GameEnv.__annotations__ and not hasattr(GameEnv, "summary")  # not required of an env


def test_signalling_summary_has_the_items_the_target_the_message_and_the_picks():
    env = SignallingGame(observers=1)
    play(env, {"speaker": lambda obs: "the  thing", "listener": lambda obs: "2", "observer_0": lambda obs: "1"},
         seed=4)
    summary = env.summary()
    assert summary["items"] == env.items and summary["target"] == env.target in env.items
    assert summary["message"] == "the thing"  # as the env parsed it (whitespace collapsed)
    assert summary["choices"] == {"listener": env.orders["listener"][1], "observer_0": env.orders["observer_0"][0]}
    assert summary["orders"] == env.orders and summary["names_target"] is False
    json.dumps(summary)  # JSON values only


def test_werewolves_summary_says_who_had_which_role_who_died_when_and_who_won():
    env = Werewolves()
    play(env, scripted(env), seed=3)
    summary = env.summary()
    assert summary["roles"] == env.roles and sorted(summary["roles"].values()) == sorted(ROLES)
    assert summary["winner"] == env.winner in ("village", "werewolves", "draw")
    deaths = [e for e in env.events if e["type"] == "death"]
    assert len(summary["deaths"]) == len(deaths) > 0
    first = deaths[0]
    number = first["target"].split("_")[1]
    assert summary["deaths"][0].startswith(f"round {first['round']} ({first['phase']}): Player {number}"
                                           f" ({env.roles[first['target']]})")
    assert summary["alive"] == env.alive
    types = {e["type"] for e in summary["events"]}
    assert "attack" in types and "game_over" in types
    assert not types & {"speech", "wolf_speech", "last_words"}  # speech is in the transcript, not repeated here
    json.dumps(summary)


def test_adapted_tictactoe_summary_is_the_final_board():
    env = text_tictactoe(TinyTicTacToe())
    play(env, scripted(env), seed=1)
    views = env.summary()["final_view"]
    assert set(views) == {"player_1", "player_2"}
    board = views["player_1"].split("Board (. is empty):\n", 1)[1].splitlines()[:3]
    marks = "".join(board).replace(" ", "")
    assert marks.count("X") + marks.count("O") == sum(1 for s in env.env.squares if s)
