"""OpenSpiel's games as marl envs (`envs/openspiel_env.py`): four kinds under PettingZoo's `api_test` and played to
the end, OpenSpiel's returns as rewards, seeds that replay a deal, replies parsed as a person writes a move, invalid
replies retried and counted, solver policies as scripted players, and the games marl refuses (with the reason, at
the topology's key)."""

from __future__ import annotations

import warnings

import pytest
from pettingzoo.test import api_test

from envs.base import play
from marl.topology import Topology, TopologyError

pyspiel = pytest.importorskip("pyspiel")  # an optional extra: pip install 'marl[openspiel]'

from envs.openspiel_env import CHANCE_OPTION, GameRefused, OpenSpielEnv, equally_likely_openings  # noqa: E402
from envs.openspiel_policies import parse_policy  # noqa: E402

#: Four kinds: a card game with a deal, one with a public card and two rounds, a perfect-information board game, and
#: a dice game of bids.
GAMES = [("kuhn_poker", {}), ("leduc_poker", {}), ("tic_tac_toe", {}), ("liars_dice", {})]


def scripted_game(env: OpenSpielEnv, seed: int) -> dict[str, float]:
    return play(env, {a: (lambda obs, a=a: env.scripted_action(a)) for a in env.possible_agents}, seed=seed)


@pytest.mark.parametrize("game, params", GAMES, ids=[g for g, _ in GAMES])
def test_api_test_passes(game, params):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # api_test warns that text spaces are not Box/Discrete
        api_test(OpenSpielEnv(game, params), num_cycles=20)


@pytest.mark.parametrize("game, params", GAMES, ids=[g for g, _ in GAMES])
def test_a_game_plays_to_the_end_with_openspiels_returns(game, params):
    env = OpenSpielEnv(game, params)
    outcome = scripted_game(env, seed=5)
    assert env.agents == [] and env.state.is_terminal()
    assert outcome == dict(zip(env.possible_agents, env.state.returns()))  # chips in the poker games
    assert env.summary()["returns"] == outcome and env.summary()["history"] == env.state.history()
    assert sum(outcome.values()) == pytest.approx(0.0)  # zero-sum
    moves = env.action_labels()
    assert moves and all(m == m.lower() for ms in moves.values() for m in ms)


def test_each_turn_tells_the_rules_once_the_news_the_private_card_and_the_moves():
    env = OpenSpielEnv("kuhn_poker")
    env.reset(seed=0, options={CHANCE_OPTION: [2, 0]})  # player 0 holds the King, player 1 the Jack
    first = str(env.observe("player_0"))
    assert "Kuhn Poker" in first and "Your card: King." in first and first.endswith("- Pass\n- Bet\nReply with one"
                                                                                    " move from the list.")
    env.step("Pass")
    second = str(env.observe("player_1"))
    assert "Kuhn Poker" in second and "Player 0 checks." in second and "Your card: Jack." in second
    assert "King" not in second.split("Player 0 checks.")[1]  # the other card is never told
    env.step("bet")
    third = str(env.observe("player_0"))
    assert "Kuhn Poker" not in third and third.startswith("Player 1 bets.\nYour card: King.")
    quiet = OpenSpielEnv("kuhn_poker", rules=False)
    quiet.reset(seed=0, options={CHANCE_OPTION: [2, 0]})
    assert str(quiet.observe("player_0")).startswith("Your card: King.\n- Pass")


def test_replies_are_parsed_as_a_person_writes_a_move():
    env = OpenSpielEnv("kuhn_poker")
    env.reset(seed=0, options={CHANCE_OPTION: [2, 0]})
    for reply, action in (("Pass", 0), ("BET", 1), ("[Bet]", 1), ("I will [pass].", 0), ("check", 0), ("call", 1),
                          ("- Bet", 1), ("raise", None), ("pass or bet", None), ("1", None), ("", None)):
        assert env.action_of("player_0", reply) == action, reply
    ttt = OpenSpielEnv("tic_tac_toe")
    ttt.reset(seed=0)
    assert ttt.action_of("player_0", "x(1,1)") == 4 and ttt.action_of("player_0", "[X(2,0)]") == 6
    assert ttt.action_of("player_0", "o(1,1)") is None


def test_invalid_replies_are_retried_then_the_first_legal_move_is_played_and_counted():
    env = OpenSpielEnv("kuhn_poker", invalid_penalty=0.25)
    env.reset(seed=0, options={CHANCE_OPTION: [0, 2]})
    env.step("fly away")
    assert env.agent_selection == "player_0" and "was not valid" in str(env.observe("player_0"))
    env.step("???")
    env.step("still no")  # the third invalid reply in a row: the fallback (Pass) is played
    assert env.invalid_actions["player_0"] == 3 and env.fallbacks["player_0"] == 1
    assert env.action_labels() == {"player_0": ["invalid"]}
    assert env.agent_selection == "player_1" and "Player 0 checks." in str(env.observe("player_1"))
    env.step("Pass")  # check, check: the King wins the antes
    assert env.final_rewards == {"player_0": -1.0, "player_1": 1.0}
    assert env.outcome() == {"player_0": -1.75, "player_1": 1.0}  # each invalid reply cost 0.25


def test_a_seed_replays_a_deal_and_deals_per_episode_differ():
    def deal(env, seed, episode=0):
        env.reset(seed=seed, options={"episode": episode})
        return env.state.history()[:2]
    task = OpenSpielEnv("kuhn_poker")
    assert deal(task, 7) == deal(task, 7) == deal(task, 7, episode=3)
    per_episode = OpenSpielEnv("kuhn_poker", deals="episode")
    assert deal(per_episode, 7, 1) == deal(per_episode, 7, 1)
    assert len({tuple(deal(per_episode, 7, e)) for e in range(12)}) > 1
    assert len({tuple(deal(task, s)) for s in range(30)}) == 6  # every deal of three cards comes up


def test_stratified_deals_give_consecutive_task_seeds_every_opening_in_turn():
    def opening(env, seed, episode=0, **options):
        env.reset(seed=seed, options={"episode": episode, **options})
        return tuple(env.state.history()[:2])
    kuhn = OpenSpielEnv("kuhn_poker", deals="stratified")
    assert sorted(opening(kuhn, s) for s in range(1000, 1006)) == sorted(equally_likely_openings(kuhn.game))
    assert opening(kuhn, 1003) == opening(kuhn, 1003, episode=5) == opening(kuhn, 1009)  # a task: one deal
    assert opening(kuhn, 1003, chance_outcomes=[2, 0]) == (2, 0)  # an asked-for deal still wins
    leduc = OpenSpielEnv("leduc_poker", deals="stratified")
    assert len({opening(leduc, s) for s in range(30)}) == 30
    public, dealt = set(), opening(leduc, 7)
    for seed in range(7, 307, 30):  # one private deal; the public card (after two checks) is drawn from the seed
        play(leduc, {a: (lambda obs: "Call") for a in leduc.possible_agents}, seed=seed)
        assert tuple(leduc.state.history()[:2]) == dealt
        public.add(leduc.state.history()[4])
    assert len(public) > 1


class _UnevenDeal:
    """A game whose one chance node deals 0 with probability 0.25 and 1 with 0.75, then a player moves."""

    def __init__(self, history=()):
        self.history = history

    def new_initial_state(self):
        return _UnevenDeal()

    def is_chance_node(self):
        return not self.history

    def chance_outcomes(self):
        return [(0, 0.25), (1, 0.75)]

    def child(self, action):
        return _UnevenDeal((*self.history, action))


def test_stratified_deals_refuse_games_they_would_change():
    with pytest.raises(GameRefused, match="not equally likely") as refused:
        equally_likely_openings(_UnevenDeal())
    assert refused.value.arg == "deals"
    refusals = (("tic_tac_toe", "opens with a move"), ("bridge", "more than 10000"), ("blackjack", "more than 10000"))
    for game, words in refusals:
        with pytest.raises(GameRefused, match=words):
            OpenSpielEnv(game, deals="stratified")


def test_solver_policies_play_scripted_roles():
    game = pyspiel.load_game("kuhn_poker")
    state = game.new_initial_state()
    for action in (0, 1):  # player 0 holds the Jack
        state.apply_action(action)
    cfr = parse_policy(game, "cfr:300")
    assert cfr.probabilities(state, 0)[1] <= 1 / 3 + 0.02  # a Jack bluffs at most a third of the time
    assert parse_policy(game, "first").probabilities(state, 0) == {0: 1.0}
    assert parse_policy(game, "uniform").probabilities(state, 0) == {0: 0.5, 1: 0.5}
    table = parse_policy(game, {"table": {"0": {"Bet": 0.25, "pass": 0.75}}})
    assert table.probabilities(state, 0) == {1: 0.25, 0: 0.75}
    for bad in ("cfr:0", "cfr:x", "minimax", {"table": {"0": {"Bet": 2}}}, {"tables": {}}):
        with pytest.raises(ValueError):
            parse_policy(game, bad)
    env = OpenSpielEnv("kuhn_poker", scripted_policy={"player_1": "first"})
    assert env.scripted["player_1"].name == "first" and env.scripted["player_0"].name == "uniform"
    for seed in range(8):
        scripted_game(env, seed)
        assert set(env.action_labels().get("player_1", ["pass"])) == {"pass"}


def test_a_cfr_policy_is_solved_at_its_first_draw_not_when_the_env_is_built():
    from envs.openspiel_policies import _cfr_policy
    _cfr_policy.cache_clear()
    env = OpenSpielEnv("kuhn_poker", scripted_policy="cfr:7")  # every agent's policy, though no role need be scripted
    assert _cfr_policy.cache_info().currsize == 0
    scripted_game(env, seed=0)
    assert _cfr_policy.cache_info().currsize == 1 and env.scripted["player_0"].name == "cfr:7"


def test_games_marl_cannot_play_are_refused_with_the_reason():
    for game, params, arg, words in (("matrix_rps", {}, "game", "simultaneous"),
                                     ("goofspiel", {}, "game", "simultaneous"),
                                     ("kuhn_pokr", {}, "game", "did you mean 'kuhn_poker'"),
                                     ("kuhn_poker", {"players": 99}, "params", "refuses params"),
                                     ("kuhn_poker", {"no_such_param": 1}, "params", "refuses params")):
        with pytest.raises(GameRefused) as refused:
            OpenSpielEnv(game, params)
        assert refused.value.arg == arg and words in str(refused.value), (game, str(refused.value))
    with pytest.raises(GameRefused, match="deals must be one of"):
        OpenSpielEnv("kuhn_poker", deals="game")
    with pytest.raises(GameRefused) as refused:
        OpenSpielEnv("kuhn_poker", scripted_policy={"player_9": "cfr"})
    assert refused.value.arg == "scripted_policy" and "player_9" in str(refused.value)


def kuhn_topology(**env) -> dict:
    return {"name": "kuhn", "servers": {}, "roles": {"player_0": {"scripted": True}, "player_1": {"scripted": True}},
            "env": {"openspiel": "kuhn_poker", **env}, "run": {"games": 1}}


def load_problems(data: dict) -> dict[str, str]:
    with pytest.raises(TopologyError) as info:
        Topology.from_dict(data)
    return {p.key: p.message for p in info.value.problems}


def test_a_topology_names_an_openspiel_game_and_is_refused_at_the_key():
    env = Topology.from_dict(kuhn_topology(args={"params": {"players": 2}})).make_env()
    assert isinstance(env, OpenSpielEnv) and env.game_name == "kuhn_poker"
    assert "did you mean 'kuhn_poker'" in load_problems(kuhn_topology(openspiel="kuhn_pokr"))["env.openspiel"]
    assert "refuses params" in load_problems(kuhn_topology(args={"params": {"player": 2}}))["env.args.params"]
    assert "simultaneous" in load_problems(kuhn_topology(openspiel="matrix_rps"))["env.openspiel"]
    assert any("both textarena: and openspiel:" in m
               for m in load_problems(kuhn_topology(textarena="KuhnPoker-v0")).values())
    shared = kuhn_topology(args={"shared_role": "player"})
    shared["roles"] = {"player": {"scripted": True}}
    assert Topology.from_dict(shared).make_env().dealt_roles()["player"].count == 2
