"""The text-game env API (envs.base), the signalling game, and the PettingZoo adapter."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from gymnasium.spaces import Box, Dict, Discrete
from pettingzoo import AECEnv
from pettingzoo.test import api_test
from pettingzoo.utils import AgentSelector

from envs.adapter import TICTACTOE_CELLS, TextAdapter, text_tictactoe, tictactoe_actions, tictactoe_render
from envs.base import (
    EPISODE_OPTION,
    GameEnv,
    InvalidAction,
    RoleInfo,
    TextAECEnv,
    TextObservation,
    match_choice,
    play,
    printable,
)
from envs.signalling import ITEMS, SignallingGame


def quiet_api_test(env, num_cycles=20):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # api_test warns that text spaces are not Box/Discrete
        api_test(env, num_cycles=num_cycles)


# --- match_choice ------------------------------------------------------------------------------------------------

CHOICES = ["red apple", "blue car", "green frog"]


@pytest.mark.parametrize("reply, expected", [
    ("blue car", 1), ("  Blue CAR. ", 1), ('"green frog"', 2),
    ("2", 1), ("2.", 1), ("(3)", 2), ("#1", 0), ("option 2", 1), ("Option #3", 2), ("No. 1", 0), ("choice 3", 2),
    ("2. blue car", 1), ("3: green frog", 2), ("2. car", 1), ("2, because it is blue. I'm sure.", 1),
    ("I think it is the red apple.", 0), ("the speaker means: green frog!", 2),
    ("", None), ("   ", None), ("4", None), ("0", None), ("purple hat", None), ("blue", None),
    ("red apple or blue car", None), ("2. red apple", None), ("two", None), ("12", None),
])
def test_match_choice(reply, expected):
    assert match_choice(reply, CHOICES) == expected


def test_match_choice_nested_and_numeric_options():
    cells = list(TICTACTOE_CELLS)
    assert match_choice("top center", cells) == cells.index("top center")  # "center" is inside it: not a 2nd hit
    assert match_choice("center", cells) == cells.index("center")
    assert match_choice("I play the center", cells) == cells.index("center")
    assert match_choice("top", cells) is None
    assert match_choice("3", ["5", "3", "1"]) == 1  # an option's own text first, then its number
    assert match_choice("2", ["5", "3", "1"]) == 1


def test_printable():
    assert printable("caf\u00e9 \u2014 \u201cok\u201d\u2026") == 'cafe - "ok"...'
    assert printable("a\x00b\u4e2d") == "a?b?"


# --- the base class: a tiny game that exercises every hook ---------------------------------------------------------

class Pick(TextAECEnv):
    """Two players each pick a number; player_2 is told player_1's pick; both get the sum if they match."""

    metadata = {"name": "pick_v0", "render_modes": ["ansi"]}
    possible_agents = ["player_1", "player_2"]

    def _reset_game(self, seed, options):
        self.options = [str(n) for n in self.rng.sample(range(10, 100), 3)]
        self.picks = {}

    def _observe_text(self, agent):
        return f"Pick a number. Picks so far: {self.picks}"

    def _legal_actions(self, agent):
        return self.options

    def _parse(self, agent, text):
        if text == "forbidden":
            raise InvalidAction("that word is not allowed")
        return super()._parse(agent, text)

    def _apply(self, agent, action):
        self.picks[agent] = action
        if agent == "player_1":
            self.agent_selection = "player_2"
            return
        win = float(self.picks["player_1"] == self.picks["player_2"])
        for a in self.agents:
            self.rewards[a] = win * (1 + self.agents.index(a))
            self.terminations[a] = True

    def role_of(self, agent):
        return "picker"


def test_pick_api():
    quiet_api_test(Pick())


def test_spaces_and_observation_type():
    env = Pick()
    env.reset(seed=1)
    assert env.observation_space("player_1") is env.observation_space("player_1")
    assert env.action_space("player_2") is env.action_space("player_2")
    obs, *_, info = env.last()
    assert isinstance(obs, TextObservation) and obs.dtype == env.observation_space("player_1").dtype
    assert env.observation_space("player_1").contains(obs)
    lines = obs.splitlines()
    assert lines[1:4] == [f"{i}. {o}" for i, o in enumerate(env.options, 1)]
    assert lines[-1] == Pick.choice_prompt
    assert info == {"role": "picker", "invalid_actions": 0, "fallbacks": 0}


def test_invalid_reply_retries_then_falls_back():
    env = Pick()
    env.reset(seed=2)
    env.step("nonsense")
    assert env.agent_selection == "player_1" and env.picks == {}  # not advanced: asked again
    assert 'Your reply "nonsense" was not valid: reply with one number from 1 to 3. Try again (2 tries left).' \
        == env.observe("player_1").splitlines()[-1]
    env.step("forbidden")
    assert "was not valid: that word is not allowed. Try again (1 try left)." in env.observe("player_1")
    env.step("99999")
    # third invalid reply with max_invalid_retries=2: the fallback (first option) is played
    assert env.picks == {"player_1": env.options[0]} and env.agent_selection == "player_2"
    assert env.invalid_actions == {"player_1": 3, "player_2": 0} and env.fallbacks == {"player_1": 1, "player_2": 0}
    assert env.invalid_actions_by_role == {"picker": 3} and env.fallbacks_by_role == {"picker": 1}
    assert env.infos["player_1"]["invalid_actions"] == 3 and env.infos["player_1"]["fallbacks"] == 1
    assert "not valid" not in env.observe("player_2")
    # a valid reply after one invalid one resets the streak: no fallback
    env.step("zzz")
    env.step(env.options[0])
    assert env.fallbacks["player_2"] == 0 and env.invalid_actions["player_2"] == 1
    assert env.outcome() == {"player_1": 1.0, "player_2": 2.0}
    assert env.outcome_by_role() == {"picker": 1.5}


def test_max_invalid_retries_zero_and_max_steps():
    class Strict(Pick):
        max_invalid_retries = 0
        max_steps = 1

    env = Strict()
    env.reset(seed=0)
    env.step("nope")
    assert env.fallbacks["player_1"] == 1 and env.picks == {"player_1": env.options[0]}
    assert all(env.truncations.values())  # max_steps reached: the game is cut off
    for _ in env.agent_iter():
        env.step(None)
    assert env.agents == []


def test_rewards_reported_by_last_then_agents_removed():
    env = Pick()
    env.reset(seed=3)
    env.step("1")
    env.step("1")
    seen = {}
    for agent in env.agent_iter():
        _, reward, terminated, *_ = env.last()
        assert terminated
        seen[agent] = reward
        env.step(None)
    assert seen == {"player_1": 1.0, "player_2": 2.0} and env.agents == []
    assert env.outcome() == {"player_1": 1.0, "player_2": 2.0}


# --- the signalling game -----------------------------------------------------------------------------------------

def test_signalling_api():
    quiet_api_test(SignallingGame())
    quiet_api_test(SignallingGame(num_items=5))


def test_signalling_seed_reproduces_the_game():
    a, b = SignallingGame(), SignallingGame()
    games = set()
    for seed in range(20):
        a.reset(seed=seed)
        b.reset(seed=seed)
        assert (a.items, a.target, a.listener_items) == (b.items, b.target, b.listener_items)
        assert a.observe("speaker") == b.observe("speaker")
        assert len(set(a.items)) == 3 and a.target in a.items and sorted(a.listener_items) == sorted(a.items)
        games.add((tuple(a.items), a.target))
    assert len(games) > 15  # different seeds, different games


def test_signalling_orders_per_episode_move_the_target_through_every_position():
    def game(seed: int, episode: int) -> tuple:
        env = SignallingGame(observers=1, orders="episode")
        env.reset(seed=seed, options={EPISODE_OPTION: episode})
        return env.items, env.target, env.orders, env.observe("listener")

    for seed in range(10):
        group = [game(seed, episode) for episode in range(8)]
        assert len({(tuple(items), target) for items, target, _, _ in group}) == 1  # one task: items and target
        for guesser in ("listener", "observer_0"):
            positions = [orders[guesser].index(target) for _, target, orders, _ in group]
            assert sorted(positions.count(p) for p in range(3)) == [2, 3, 3]  # each position, give or take one
            assert all(sorted(orders[guesser]) == sorted(items) for items, _, orders, _ in group)
        assert group == [game(seed, episode) for episode in range(8)]  # the same seed and episode, the same game
    task = SignallingGame()  # the default: one order per task, whatever the episode
    orders = set()
    for episode in range(4):
        task.reset(seed=3, options={EPISODE_OPTION: episode})
        orders.add(tuple(task.listener_items))
    assert len(orders) == 1
    quiet_api_test(SignallingGame(orders="episode"))
    with pytest.raises(ValueError, match="orders must be one of task, episode; got 'game'"):
        SignallingGame(orders="game")


def test_signalling_scripted_players_always_win():
    env = SignallingGame(num_items=4)
    scripted = {agent: (lambda obs, agent=agent: env.scripted_action(agent)) for agent in env.possible_agents}
    for seed in range(30):
        assert play(env, scripted, seed=seed) == {"speaker": 1.0, "listener": 1.0}
        assert env.invalid_actions == {"speaker": 0, "listener": 0}


def test_signalling_rewards_and_parsing():
    env = SignallingGame()
    env.reset(seed=7)
    wrong = next(item for item in env.listener_items if item != env.target)
    assert env._legal_actions("speaker") is None
    assert "Target: " + env.target in env.observe("speaker")
    env.step("  " + " ".join(["word"] * 30) + "  ")
    assert env.message == " ".join(["word"] * 20)  # at most 20 words kept
    listener_obs = env.observe("listener")
    assert f'The speaker said: "{env.message}"' in listener_obs
    assert listener_obs.splitlines()[-1] == "Reply with the number or the name of your choice."
    env.step(str(env.listener_items.index(wrong) + 1))
    assert env.rewards == {"speaker": 0.0, "listener": 0.0} and all(env.terminations.values())
    assert env.outcome() == {"speaker": 0.0, "listener": 0.0}
    assert env.infos["speaker"]["choices"] == {"listener": wrong} and env.infos["listener"]["target"] == env.target

    env.reset(seed=7)
    env.step(env.target)
    env.step(f"It is the {env.target}.")  # a name works as well as a number
    assert env.outcome() == {"speaker": 1.0, "listener": 1.0}
    assert "You win." in env.observe("listener") and "1 of 1 picked the target" in env.observe("speaker")


def test_signalling_with_no_retries_one_invalid_reply_loses():
    env = SignallingGame(max_invalid_retries=0)
    env.reset(seed=3)
    env.step(env.target)
    env.step("I am not sure")  # names no item: with no retries the listener falls back at once and picks nothing
    assert all(env.terminations.values()) and env.choice == ""
    assert env.outcome() == {"speaker": 0.0, "listener": 0.0}
    assert env.invalid_actions_by_role["listener"] == 1 and env.fallbacks_by_role["listener"] == 1
    with pytest.raises(ValueError, match="max_invalid_retries"):
        SignallingGame(max_invalid_retries=-1)


def test_signalling_observers_are_extra_listeners():
    env = SignallingGame(observers=2)
    assert env.possible_agents == ["speaker", "listener", "observer_0", "observer_1"]
    assert [env.role_of(a) for a in env.possible_agents] == ["speaker", "listener", "observer", "observer"]
    assert "observer" in env.system_prompt("observer_1")
    quiet_api_test(env)
    scripted = {agent: (lambda obs, agent=agent: env.scripted_action(agent)) for agent in env.possible_agents}
    assert play(env, scripted, seed=4) == dict.fromkeys(env.possible_agents, 1.0)
    env.reset(seed=4)
    assert env.orders["observer_0"] != env.orders["listener"] or env.orders["observer_1"] != env.orders["listener"]
    env.step(env.target)
    assert env.agent_selection == "listener"
    env.step(env.target)
    assert env.agent_selection == "observer_0" and not any(env.terminations.values())
    assert "picked" not in env.observe("observer_0")  # nobody sees another's guess
    env.step("nothing")
    env.step("nothing")
    env.step("nothing")  # observer_0 falls back: picks nothing
    env.step(env.target)
    assert env.outcome() == {"speaker": 2 / 3, "listener": 1.0, "observer_0": 0.0, "observer_1": 1.0}
    assert env.outcome_by_role() == {"speaker": 2 / 3, "listener": 1.0, "observer": 0.5}
    assert env.fallbacks_by_role == {"speaker": 0, "listener": 0, "observer": 1}
    position = {g: f"pick {env.orders[g].index(env.target) + 1}" for g in ("listener", "observer_1")}
    assert env.action_labels() == {"speaker": ["names target"], "listener": [position["listener"]],
                                   "observer_0": ["pick none"], "observer_1": [position["observer_1"]]}
    assert [env.goal_met(a) for a in env.possible_agents] == [True, True, False, True]


def test_signalling_dealt_roles():
    assert SignallingGame().dealt_roles() == {"speaker": RoleInfo("speaker"), "listener": RoleInfo("listener")}
    env = SignallingGame(observers=3)
    assert isinstance(env, GameEnv)  # the whole contract, before reset
    assert env.dealt_roles() == {"speaker": RoleInfo("speaker"), "listener": RoleInfo("listener"),
                                 "observer": RoleInfo("observer", 3)}


def test_signalling_naming_bonus_shapes_only_the_speaker():
    env = SignallingGame(naming_bonus=0.5)
    env.reset(seed=3)
    other = next(item for item in env.items if item != env.target)
    cases = [  # (speaker's message, listener's pick, expected rewards)
        (f"The target is the {env.target}.", env.target, {"speaker": 1.5, "listener": 1.0}),
        (f"The {env.target}!", other, {"speaker": 0.5, "listener": 0.0}),  # named but misread: bonus only
        (f"{env.target} or {other}", env.target, {"speaker": 1.0, "listener": 1.0}),  # two items named: no bonus
        ("2", env.target, {"speaker": 1.0, "listener": 1.0}),  # a number names no item
    ]
    for message, pick, rewards in cases:
        env.reset(seed=3)
        env.step(message)
        env.step(pick)
        assert env.outcome() == rewards, message
        assert env.infos["speaker"]["names_target"] == (rewards["speaker"] % 1 == 0.5)
    env = SignallingGame()  # off by default
    env.reset(seed=3)
    env.step(env.target)
    env.step(other)
    assert env.outcome() == {"speaker": 0.0, "listener": 0.0}


def test_signalling_fallbacks():
    env = SignallingGame()
    env.reset(seed=1)
    for _ in range(3):
        env.step("   ")  # empty speech is invalid
    assert env.fallbacks["speaker"] == 1 and env.message == "" and env.agent_selection == "listener"
    assert "The speaker said nothing." in env.observe("listener")
    for _ in range(3):
        env.step("maybe")
    assert env.fallbacks["listener"] == 1 and env.choice == ""
    assert env.outcome() == {"speaker": 0.0, "listener": 0.0}  # the listener's fallback picks nothing: a loss
    assert env.invalid_actions_by_role == {"speaker": 3, "listener": 3}
    assert env.replies_by_role == {"speaker": 3, "listener": 3}  # every reply, valid or not


def test_signalling_prompts_and_bad_arguments():
    env = SignallingGame()
    assert "Pick" in env.system_prompt("listener") and "speaker" in env.system_prompt("speaker")
    assert env.role_of("speaker") == "speaker" and env.team_of("listener") == "listener"
    with pytest.raises(ValueError, match="num_items"):
        SignallingGame(num_items=len(ITEMS) + 1)
    with pytest.raises(ValueError, match="naming_bonus"):
        SignallingGame(naming_bonus=-1)
    for item in ITEMS:  # no item's text is inside another's: a named item is never ambiguous
        assert [other for other in ITEMS if item in other] == [item]


# --- the adapter ---------------------------------------------------------------------------------------------------

class TinyTicTacToe(AECEnv):
    """Tic-tac-toe with PettingZoo tictactoe_v3's agents, observations, mask and cell numbering (which needs pygame)."""

    metadata = {"name": "tiny_tictactoe_v0", "render_modes": []}
    LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]

    def __init__(self):
        super().__init__()
        self.possible_agents = ["player_1", "player_2"]
        self._obs = {a: Dict({"observation": Box(0, 1, (3, 3, 2), np.int8), "action_mask": Box(0, 1, (9,), np.int8)})
                     for a in self.possible_agents}
        self._act = {a: Discrete(9) for a in self.possible_agents}

    def observation_space(self, agent):
        return self._obs[agent]

    def action_space(self, agent):
        return self._act[agent]

    def reset(self, seed=None, options=None):
        self.squares = [0] * 9
        self.agents = self.possible_agents[:]
        self.rewards = dict.fromkeys(self.agents, 0)
        self._cumulative_rewards = dict.fromkeys(self.agents, 0)
        self.terminations = dict.fromkeys(self.agents, False)
        self.truncations = dict.fromkeys(self.agents, False)
        self.infos = {a: {} for a in self.agents}
        self._selector = AgentSelector(self.agents)
        self.agent_selection = self._selector.reset()

    def observe(self, agent):
        me = self.possible_agents.index(agent) + 1
        board = np.array(self.squares).reshape(3, 3)
        obs = np.stack([board == me, (board != me) & (board != 0)], axis=-1).astype(np.int8)
        mask = np.array([s == 0 and agent == self.agent_selection for s in self.squares], dtype=np.int8)
        return {"observation": obs, "action_mask": mask}

    def step(self, action):
        if self.terminations[self.agent_selection] or self.truncations[self.agent_selection]:
            return self._was_dead_step(action)
        agent = self.agent_selection
        self._cumulative_rewards[agent] = 0
        self._clear_rewards()
        assert self.squares[action] == 0, "illegal move"
        self.squares[action] = self.possible_agents.index(agent) + 1
        won = any(self.squares[a] == self.squares[b] == self.squares[c] != 0 for a, b, c in self.LINES)
        if won or all(self.squares):
            if won:
                self.rewards[agent], self.rewards[next(a for a in self.agents if a != agent)] = 1, -1
            self.terminations = dict.fromkeys(self.agents, True)
        self._accumulate_rewards()
        self.agent_selection = self._selector.next()


def test_adapted_tictactoe_api():
    quiet_api_test(text_tictactoe(TinyTicTacToe()), num_cycles=30)


def test_the_adapter_keeps_marls_episode_option_from_the_wrapped_env():
    seen = []

    class Recording(TinyTicTacToe):
        def reset(self, seed=None, options=None):
            seen.append(options)
            super().reset(seed=seed, options=options)

    env = text_tictactoe(Recording())
    env.reset(seed=1, options={EPISODE_OPTION: 3})
    env.reset(seed=1, options={EPISODE_OPTION: 3, "board": "empty"})
    assert seen == [None, {"board": "empty"}]


def test_adapted_tictactoe_observation_and_moves():
    env = TextAdapter(TinyTicTacToe(), render=tictactoe_render, actions=tictactoe_actions, roles={"player_1": "x"})
    env.reset(seed=0)
    assert env.role_of("player_1") == "x" and env.role_of("player_2") == "player_2"
    assert "player_1" in env.system_prompt("player_1")
    obs = env.observe("player_1")
    assert "You play X." in obs and ". . .\n. . .\n. . ." in obs
    assert "\n5. center\n" in obs
    env.step("center")  # by name (action 4)
    obs = env.observe("player_2")
    assert "You play O." in obs and ". . .\n. X .\n. . ." in obs
    assert "center" not in [line.split(". ", 1)[-1] for line in obs.splitlines()]  # taken: masked out
    env.step("1")  # option 1 = top left (action 0)
    assert env.env.squares[0] == 2
    env.step("top left")  # taken: invalid, asked again
    assert env.agent_selection == "player_1" and env.invalid_actions["player_1"] == 1
    for move in ["top center", "middle left", "top right", "bottom left"]:
        env.step(move)
    # X: center, top center, top right; O: top left, middle left, bottom left, the left column: O wins
    assert env.outcome() == {"player_1": -1.0, "player_2": 1.0}
    assert all(env.terminations.values())
    for _ in env.agent_iter():
        env.step(None)
    assert env.agents == []


def test_adapted_tictactoe_scripted_and_fallback_games_finish():
    env = text_tictactoe(TinyTicTacToe())
    for seed in range(10):
        outcome = play(env, {a: (lambda obs, a=a: env.scripted_action(a)) for a in env.possible_agents}, seed=seed)
        assert sorted(outcome.values()) in ([-1.0, 1.0], [0.0, 0.0])
        assert sum(env.invalid_actions.values()) == 0
    outcome = play(env, {a: (lambda obs: "no idea") for a in env.possible_agents}, seed=0)
    assert env.fallbacks["player_1"] >= 3 and sum(env.invalid_actions.values()) == 3 * sum(env.fallbacks.values())
    assert outcome == {"player_1": 1.0, "player_2": -1.0}  # fallbacks take the first free cell: X wins on a diagonal


def test_adapted_options_are_renumbered_as_the_board_fills():
    """What docs/envs.md says a model sees: options are numbered among the legal moves only."""
    env = text_tictactoe(TinyTicTacToe())
    env.reset()
    assert "\n5. center\n" in env.observe("player_1")
    env.step("5")  # center
    obs = env.observe("player_2")
    assert "\n4. top center\n5. bottom center\n6. top right\n" in obs  # center is gone: the rest move up
    env.step("5")
    assert env.env.squares[TICTACTOE_CELLS.index("bottom center")] == 2


def test_adapter_dealt_roles_follow_the_role_and_team_tables():
    assert text_tictactoe(TinyTicTacToe()).dealt_roles() == {"player_1": RoleInfo("player_1"),
                                                             "player_2": RoleInfo("player_2")}
    render = tictactoe_render
    env = TextAdapter(TinyTicTacToe(), render, roles={"player_1": "x"}, teams=lambda agent: "board")
    assert env.dealt_roles() == {"x": RoleInfo("board"), "player_2": RoleInfo("board")}
    env = TextAdapter(TinyTicTacToe(), render, roles=lambda agent: "player", teams={"player_1": "board"})
    with pytest.raises(ValueError, match="role 'player' is dealt to agents of two teams"):
        env.dealt_roles()
    env = TextAdapter(TinyTicTacToe(), render, roles=lambda agent: "player", teams=lambda agent: "board")
    assert env.dealt_roles() == {"player": RoleInfo("board", 2)}


def test_adapter_default_actions_use_the_mask():
    env = TextAdapter(TinyTicTacToe(), render=lambda agent, obs, info: "Board.")
    env.reset()
    env.step("action 4")
    assert env.env.squares[4] == 1
    assert "action 4" not in env.legal_actions()


def test_real_pettingzoo_tictactoe():
    pytest.importorskip("pygame", reason="pettingzoo.classic.tictactoe_v3 imports pygame")
    quiet_api_test(text_tictactoe(), num_cycles=30)
