"""Werewolves (envs/werewolves.py): the API, the rules audited over many scripted games, parsing, news, rewards."""

from __future__ import annotations

import re
import warnings
from collections import Counter

import pytest
from pettingzoo.test import api_test

from envs.base import GameEnv, RoleInfo, TextAECEnv, match_choice, play
from envs.werewolves import (
    HUNTER,
    NOBODY,
    ROLES,
    SEER,
    VILLAGER,
    WEREWOLF,
    WITCH,
    Werewolves,
    label,
    pick,
)


def quiet_api_test(env, num_cycles=20):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # api_test warns that text spaces are not Box/Discrete
        api_test(env, num_cycles=num_cycles)


def drive(env, seed, reply=None, until=None):
    """Play a game with scripted players; `reply(env, agent)` may return a reply instead (None: scripted).

    Stops before the first turn where `until(env)` is true (then returns None); else plays to the end and returns
    ({agent: [observations it was given on its turns]}, {agent: its last info}).
    """
    env.reset(seed=seed)
    seen, infos = {a: [] for a in env.possible_agents}, {}
    for agent in env.agent_iter():
        observation, _, terminated, truncated, info = env.last()
        if terminated or truncated:
            infos[agent] = info
            env.step(None)
            continue
        if until is not None and until(env):
            return None
        seen[agent].append(str(observation))
        answer = reply(env, agent) if reply is not None else None
        env.step(env.scripted_action(agent) if answer is None else answer)
    return seen, infos


def of_role(env, role):
    return [a for a in env.possible_agents if env.roles[a] == role]


def at(kind, agent_role=None):
    """A stop condition for `drive`: the first turn of this kind (by an agent of that role)."""
    return lambda env: env.turn == kind and (agent_role is None or env.roles[env.agent_selection] == agent_role)


def events(env, kind):
    return [e for e in env.events if e["type"] == kind]


# --- the API -----------------------------------------------------------------------------------------------------

def test_api():
    quiet_api_test(Werewolves())


def test_roles_prompts_render_and_arguments():
    env = Werewolves(render_mode="ansi")
    with pytest.raises(RuntimeError, match="reset"):
        env.role_of("player_1")
    env.reset(seed=0)
    assert sorted(env.roles.values()) == sorted(ROLES) and env.possible_agents[-1] == "player_9"
    assert env.metadata["name"] == "werewolves_v0" and env.max_steps == 400
    for agent in env.possible_agents:
        prompt = env.system_prompt(agent)
        assert f"You are {label(agent)}" in prompt and env.role_of(agent) in prompt
        assert env.team_of(agent) == ("werewolves" if env.role_of(agent) == WEREWOLF else "village")
        assert env.infos[agent]["role"] == env.role_of(agent)
    assert env.render() == env.observe(env.agent_selection)
    for bad in [{"max_rounds": 0}, {"max_rounds": 2.5}, {"draw_reward": 1.5}, {"valid_action_bonus": -0.1}]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            Werewolves(**bad)


def test_dealt_roles_before_reset_match_every_deal():
    env = Werewolves()
    assert isinstance(env, GameEnv)  # the whole contract, before reset
    dealt = env.dealt_roles()  # before reset, when role_of still raises
    assert dealt == {WEREWOLF: RoleInfo("werewolves", 3), "villager": RoleInfo("village", 3),
                     "seer": RoleInfo("village"), "witch": RoleInfo("village"), "hunter": RoleInfo("village")}
    for seed in range(5):  # every deal hands out exactly these roles, in these teams
        env.reset(seed=seed)
        assert Counter(env.role_of(a) for a in env.possible_agents) == {r: i.count for r, i in dealt.items()}
        assert all(env.team_of(a) == dealt[env.role_of(a)].team for a in env.possible_agents)


# --- the rules, audited over 200 scripted games --------------------------------------------------------------------

_REVEAL = re.compile(r"Player (\d) (?:is|was) (not )?(?:a|an|the) (\w+)")


def audit(env, seen, infos):
    """Check a finished game's event log and observations against the rules; return its winner."""
    roles, dead, spoke_last, shots = env.roles, {}, set(), set()
    save = [e for e in env.events if e["type"] == "save"]
    poison = [e for e in env.events if e["type"] == "poison"]
    assert len(save) <= 1 and len(poison) <= 1  # each potion at most once
    assert all(e["actor"] != e["target"] and roles[e["actor"]] == WITCH for e in save + poison)
    attack = {}
    for i, e in enumerate(env.events):
        kind, actor, target = e["type"], e["actor"], e["target"]
        if kind == "attack":
            attack[e["round"]] = target
        if kind in ("attack", "poison", "vote", "wolf_vote", "check", "shoot", "save", "voted_out") and target:
            assert target not in dead, e  # every target is alive
        if kind == "last_words":
            assert actor in dead and actor not in spoke_last, e  # once, after dying
            spoke_last.add(actor)
        elif kind == "shoot":
            assert roles[actor] == HUNTER and actor not in shots and dead.get(actor) in ("werewolves", "vote"), e
            shots.add(actor)
        elif actor is not None:
            assert actor not in dead, e  # the dead never speak, vote or act
        if kind == "wolf_vote" or kind == "wolf_speech":
            assert roles[actor] == WEREWOLF and (target is None or roles[target] != WEREWOLF), e
        if kind == "check":
            assert roles[actor] == SEER and actor != target
            assert target is None or e["result"] == ("werewolf" if roles[target] == WEREWOLF else "village")
        if kind == "death":
            if e["cause"] == "werewolves":
                assert attack[e["round"]] == target, e
                assert not any(s["target"] == target and s["round"] == e["round"] for s in save), e
            if e["cause"] == "poison":
                assert any(p["target"] == target for p in poison), e
            dead[target] = e["cause"]
            alive = [a for a in env.possible_agents if a not in dead]
            wolves = sum(roles[a] == WEREWOLF for a in alive)
            if wolves == 0 or wolves >= len(alive) - wolves:  # won: the game ends at once (deaths at dawn together)
                assert all(later["type"] in ("death", "game_over") for later in env.events[i + 1:]), e
    alive = [a for a in env.possible_agents if a not in dead]
    assert alive == env.alive
    wolves = sum(roles[a] == WEREWOLF for a in alive)
    expected = "village" if wolves == 0 else "werewolves" if wolves >= len(alive) - wolves else "draw"
    assert env.winner == expected and env.events[-1] == {**env.events[-1], "type": "game_over", "winner": expected}
    assert all(infos[a]["winner"] == expected and infos[a]["role"] == roles[a] for a in env.possible_agents)
    if expected == "draw":
        assert env.round == env.max_rounds
    assert not any(env.truncations.values())  # max_steps is only a safety net

    checked = {e["target"]: e["result"] for e in env.events if e["type"] == "check" and e["target"]}
    for agent in env.possible_agents:
        texts = seen[agent] + [str(env.observe(agent))]
        master = "\n".join(re.sub(r'"[^"]*"', '""', t) for t in texts)  # what the game master said
        reveals = {(int(n), bool(neg), word) for n, neg, word in _REVEAL.findall(master)}
        if roles[agent] == SEER:  # only the teams of the players it checked, truthfully
            assert reveals == {(int(t[-1]), result != "werewolf", "werewolf") for t, result in checked.items()}
        else:
            assert reveals == set(), (agent, reveals)
        is_wolf = roles[agent] == WEREWOLF
        assert ("[werewolves only]" in master or "fellow werewolves" in master) == is_wolf
        if is_wolf:
            others = " and ".join(label(a) for a in of_role(env, WEREWOLF) if a != agent)
            assert f"Your fellow werewolves are {others}." in master
    return expected


def test_scripted_games_follow_the_rules():
    env = Werewolves()
    winners, turns = Counter(), []
    for seed in range(200):
        winners[audit(env, *drive(env, seed))] += 1
        assert sum(env.invalid_actions.values()) == 0  # scripted replies always parse
        outcome = env.outcome()
        for agent in env.possible_agents:  # each player gets its team's result, the dead too
            assert outcome[agent] == (1.0 if env.team_of(agent) == env.winner else 0.0)
        assert env.agents == []
        turns.append(env.num_moves)
    assert winners["village"] >= 40 and winners["werewolves"] >= 40, winners
    assert max(turns) < env.max_steps


def test_same_seed_same_game():
    a, b = Werewolves(), Werewolves()
    deals = set()
    for seed in range(20):
        drive(a, seed)
        drive(b, seed)
        assert a.roles == b.roles and a.events == b.events and a.outcome() == b.outcome()
        deals.add(tuple(a.roles.values()))
    assert len(deals) > 15


def test_fallbacks_only_end_in_a_draw():
    env = Werewolves(max_rounds=2, draw_reward=0.25)
    outcome = play(env, {a: (lambda obs: "") for a in env.possible_agents}, seed=3)
    assert env.winner == "draw" and env.round == 2 and outcome == dict.fromkeys(env.possible_agents, 0.25)
    assert not events(env, "death")  # the werewolves never voted: nobody was attacked; nobody voted out
    assert all(e["target"] is None for e in events(env, "vote") + events(env, "wolf_vote") + events(env, "check"))
    assert sum(env.fallbacks.values()) == env.num_moves
    assert sum(env.invalid_actions.values()) == 3 * env.num_moves  # each turn: 3 invalid replies, then the fallback


# --- parsing -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("reply", ["3", "Player 3", "player_3", "P3", "#3", "vote player 3", "I vote for player 3.",
                                   "**Player 3**", "Player 3, because Player 5 defended them",
                                   "Player 5 is fine. I vote for Player 3"])
def test_a_reply_names_seat_3(reply):
    env = Werewolves()
    drive(env, 0, until=at("vote"))
    voter = env.agent_selection
    assert voter != "player_3" and "player_3" in env.alive
    env.step(reply)
    assert events(env, "vote")[-1] == {**events(env, "vote")[-1], "actor": voter, "target": "player_3"}
    assert env.invalid_actions[voter] == 0


def test_pick():
    assert pick("nobody", nobody=True) == NOBODY and pick("I abstain.", nobody=True) == NOBODY
    assert pick("nobody", nobody=False) is None and pick("12", nobody=True) is None
    with pytest.raises(ValueError, match="exactly one player"):
        pick("maybe Player 3 or Player 5", nobody=False)


def test_options_are_unnumbered_and_a_number_is_a_seat():
    env = Werewolves()
    drive(env, 0, until=at("vote"))
    obs = env.observe(env.agent_selection)
    options = [line[2:] for line in obs.splitlines() if line.startswith("- ")]
    assert options == [label(a) for a in env.alive if a != env.agent_selection] + ["nobody"]
    assert obs.splitlines()[-1] == 'Reply with one player: "Player N" or just its number N, or "nobody".'
    env.step("2")  # the 2nd seat, though the 2nd option is another player
    assert events(env, "vote")[-1]["target"] == "player_2"


def test_illegal_targets_are_invalid_then_fall_back():
    env = Werewolves()
    drive(env, 0, until=at("wolf_vote"))
    wolf = env.agent_selection
    other_wolf = next(a for a in of_role(env, WEREWOLF) if a != wolf)
    env.step(label(other_wolf))
    assert env.agent_selection == wolf and not events(env, "wolf_vote")  # asked again
    assert f"{label(other_wolf)} is a werewolf; attack a player who is not" in env.observe(wolf)
    env.step(f"Let us attack {label(wolf)}")
    env.step("the moon")
    assert events(env, "wolf_vote") == [{**events(env, "wolf_vote")[0], "actor": wolf, "target": None}]  # no vote
    assert env.invalid_actions_by_role["werewolf"] == 3 and env.fallbacks_by_role["werewolf"] == 1

    drive(env, 1, until=lambda e: e.turn == "vote" and len(e.alive) < 9)  # someone has died
    dead = next(a for a in env.possible_agents if a not in env.alive)
    voter, role = env.agent_selection, env.roles[env.agent_selection]
    env.step(str(dead[-1]))
    assert env.agent_selection == voter and f"{label(dead)} is dead" in env.observe(voter)
    env.step(label(voter))
    assert "you cannot choose yourself" in env.observe(voter)
    env.step("")
    assert events(env, "vote")[-1] == {**events(env, "vote")[-1], "actor": voter, "target": None}  # abstains
    assert env.invalid_actions_by_role[role] == 3 and env.fallbacks_by_role[role] == 1
    assert sum(env.invalid_actions.values()) == 3


def test_witch_parsing_and_rules():
    env = Werewolves()
    drive(env, 0, until=at("witch"))
    witch, victim = env.agent_selection, env.victim
    obs = env.observe(witch)
    assert f"The werewolves attacked {label(victim)} tonight." in obs and f"- save {label(victim)}" in obs
    assert f"- poison {label(witch)}" not in obs and obs.splitlines()[-1].startswith('Reply with "save"')
    for bad, reason in [("I save and poison 3", "do one thing only"), ("poison", "name the player to poison"),
                        (f"poison {label(witch)}", "you cannot poison yourself"), ("hmm", 'reply with "save"')]:
        env.step(bad)
        assert reason in env.observe(witch).splitlines()[-1], bad
        drive(env, 0, until=at("witch"))
    other = next(a for a in env.alive if a not in (witch, victim))
    for reply, expected in [("save", ("save", victim)), (f"Save {label(victim)}!", ("save", victim)),
                            (f"poison {other[-1]}", ("poison", other)), ("I do nothing tonight", ("pass", None)),
                            ("pass", ("pass", None))]:
        drive(env, 0, until=at("witch"))
        env.step(reply)
        last = env.events[-1]
        assert (last["type"], last["target"]) == expected and last["actor"] == witch, reply

    def attack_the_witch(env, agent):  # the werewolves attack the witch; she cannot save herself
        return label(of_role(env, WITCH)[0]) if env.turn == "wolf_vote" else None

    drive(env, 0, reply=attack_the_witch, until=at("witch"))
    assert env.victim == env.agent_selection and "- save" not in env.observe(env.agent_selection)
    env.step("save")
    assert "you cannot save yourself" in env.observe(env.agent_selection)


def test_hunter_shoots_only_when_killed_by_the_werewolves():
    def attack_hunter(env, agent):
        hunter = of_role(env, HUNTER)[0]
        if env.turn == "wolf_vote":
            return label(hunter)
        if env.turn == "witch":
            return "pass"
        if env.turn == "hunter":
            return label(next(a for a in env.alive if env.roles[a] == WEREWOLF))
        return None

    env = Werewolves()
    drive(env, 0, reply=attack_hunter)
    hunter = of_role(env, HUNTER)[0]
    kinds = [(e["type"], e["actor"], e["target"]) for e in env.events if e["round"] == 1 and e["phase"] == "day"]
    shot = events(env, "shoot")[0]["target"]
    assert env.roles[shot] == WEREWOLF
    assert kinds[:5] == [("death", None, hunter), ("last_words", hunter, None), ("shoot", hunter, shot),
                         ("death", None, shot), ("last_words", shot, None)]

    def poison_hunter(env, agent):
        if env.turn == "witch":
            return f"poison {label(of_role(env, HUNTER)[0])}"
        return None

    drive(env, 0, reply=poison_hunter)
    hunter = of_role(env, HUNTER)[0]
    assert any(e["type"] == "death" and e["target"] == hunter and e["cause"] == "poison" for e in env.events)
    assert not events(env, "shoot")


def test_wolf_vote_tie_goes_to_the_lowest_seat():
    def split(env, agent):
        if env.turn == "wolf_vote":
            targets = [a for a in env.alive if env.roles[a] != WEREWOLF]
            return label(targets[-1 - env.wolves().index(agent)])  # three different targets
        return None

    env = Werewolves()
    drive(env, 0, reply=split, until=at("witch"))
    votes = [e["target"] for e in events(env, "wolf_vote")]
    assert len(set(votes)) == 3 and env.victim == min(votes, key=lambda a: int(a[-1]))


# --- observations: partial, and news delivered once ---------------------------------------------------------------

def test_werewolf_talk_is_hidden_from_the_village():
    def whisper(env, agent):
        return "the moon is bright tonight" if env.turn == "wolf_speech" else None

    env = Werewolves()
    drive(env, 0, reply=whisper, until=at("wolf_vote"))
    wolves = of_role(env, WEREWOLF)
    first, second, third = env.wolves()
    assert env.agent_selection == first
    assert env.observe(first).splitlines()[:2] == [f'[werewolves only] {label(w)} says: "the moon is bright tonight"'
                                                   for w in (second, third)]  # the others' words, not its own
    drive(env, 0, reply=whisper, until=at("speech"))
    for agent in env.possible_agents:
        if agent not in wolves:  # all the news since the game started: nothing from the werewolves' night
            obs = env.observe(agent)
            assert "moon" not in obs and "[werewolves only]" not in obs and "attack" not in obs.lower()


def test_news_is_delivered_once_and_repeated_after_an_invalid_reply():
    env = Werewolves()
    drive(env, 0, until=at("speech", VILLAGER))  # a villager had no turn before: all the news since the start
    speaker = env.agent_selection
    first = env.observe(speaker)
    assert first == env.observe(speaker)  # observe is pure
    assert "--- Night 1 falls. ---" in first and "--- Day 1 breaks. ---" in first and first.rstrip().endswith(
        "Your turn to speak to everyone (one short message).")
    env.step("   ")  # empty speech: invalid
    again = env.observe(speaker)
    assert again.startswith(first) and "was not valid: say something" in again
    env.step("I suspect everybody.")
    later = env.observe(speaker)
    assert "Night 1 falls" not in later and "Day 1 breaks" not in later and "not valid" not in later
    listener = env.agent_selection
    assert f'{label(speaker)} says: "I suspect everybody."' in env.observe(listener)
    assert env.observe(listener).count("I suspect everybody.") == 1


# --- rewards -------------------------------------------------------------------------------------------------------

def test_valid_action_bonus_changes_only_rewards():
    plain, shaped = Werewolves(), Werewolves(valid_action_bonus=0.5)
    assert plain.valid_action_bonus == 0.0
    for seed in range(5):
        drive(plain, seed)
        drive(shaped, seed)
        assert plain.events == shaped.events
        assert shaped.outcome() == {a: r + 0.5 for a, r in plain.outcome().items()}  # every turn valid at once

    def one_invalid(env, agent):
        return "" if env.turn == "speech" and agent == "player_1" and env.invalid_actions[agent] == 0 else None

    drive(shaped, 0, reply=one_invalid)
    drive(plain, 0, reply=one_invalid)
    assert plain.events == shaped.events
    turns = sum(e["actor"] == "player_1" for e in plain.events if e["type"] != "game_over")
    bonus = {a: shaped.outcome()[a] - plain.outcome()[a] for a in plain.possible_agents}
    assert bonus["player_1"] == pytest.approx(0.5 * (turns - 1) / turns)
    assert all(bonus[a] == 0.5 for a in plain.possible_agents if a != "player_1")


# --- the base class's number_options hook ---------------------------------------------------------------------------

def test_unnumbered_options_in_the_base_class():
    class Seats(TextAECEnv):
        possible_agents = ("a",)
        number_options = False

        def _reset_game(self, seed, options):
            self.picked = None

        def _observe_text(self, agent):
            return "Pick a seat."

        def _legal_actions(self, agent):
            return ["seat 5", "seat 3"]

        def _apply(self, agent, action):
            self.picked = action
            self.terminations[agent] = True

    env = Seats()
    env.reset()
    assert env.observe("a").splitlines()[1:3] == ["- seat 5", "- seat 3"]
    env.step("1")  # not an option's index any more
    assert env.picked is None and "reply with one option" in env.observe("a")
    env.step("I take seat 3")
    assert env.picked == "seat 3"
    assert match_choice("2", ["x", "y"]) == 1 and match_choice("2", ["x", "y"], numbers=False) is None
