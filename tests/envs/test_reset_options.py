"""Every option an env reads from `reset` is checked: a bad one is a ValueError naming it, never a bare TypeError or
a silently different game (issue 55, item 4)."""

from __future__ import annotations

import numpy as np
import pytest

from envs.base import EPISODE_OPTION, MAX_OPTION_COUNT
from envs.signalling import SignallingGame

BAD_COUNTS = ["1", 1.5, float("nan"), None, [1], True, -1, 10**30, MAX_OPTION_COUNT + 1]


@pytest.mark.parametrize("value", BAD_COUNTS, ids=repr)
@pytest.mark.parametrize("orders", ["episode", "task"])
def test_a_bad_episode_option_is_a_value_error_naming_it(orders, value):
    env = SignallingGame(orders=orders)
    env.reset(seed=3, options={EPISODE_OPTION: 1})
    before = (env.items, env.target, env.orders)
    with pytest.raises(ValueError, match=f"reset option '{EPISODE_OPTION}' must be an int from 0"):
        env.reset(seed=3, options={EPISODE_OPTION: value})
    assert (env.items, env.target, env.orders) == before  # refused before anything changed


def test_good_episode_options_play_their_game():
    games = []
    for value in (0, 2, np.int64(2), MAX_OPTION_COUNT):
        env = SignallingGame(orders="episode")
        env.reset(seed=3, options={EPISODE_OPTION: value})
        games.append(env.orders)
    assert games[1] == games[2] != games[0]  # numpy's 2 is 2


@pytest.mark.parametrize("options", [[("episode", 1)], "episode", 3])
def test_options_that_are_not_a_dict_are_refused(options):
    with pytest.raises(ValueError, match="options must be a dict"):
        SignallingGame().reset(seed=0, options=options)


@pytest.mark.parametrize("value", ["01", 7, [0, "1"], [0, -1], [True, 1], [0.5, 1]], ids=repr)
def test_openspiel_chance_outcomes_are_checked(value):
    pytest.importorskip("pyspiel")
    from envs.openspiel_env import CHANCE_OPTION, OpenSpielEnv

    env = OpenSpielEnv("kuhn_poker", deals="episode")
    with pytest.raises(ValueError, match=CHANCE_OPTION):
        env.reset(seed=1, options={CHANCE_OPTION: value})
    with pytest.raises(ValueError, match=EPISODE_OPTION):
        env.reset(seed=1, options={EPISODE_OPTION: "1"})
    env.reset(seed=1, options={CHANCE_OPTION: [2, 0], EPISODE_OPTION: 4})  # King to player 0, Jack to player 1
    assert "Your card: King." in env.observe(env.agent_selection)
