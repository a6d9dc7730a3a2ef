"""`StallWatch`: a learner that can never fill a batch is noticed within its bound, with the reason (issue 55)."""

from __future__ import annotations

from marl.games.record import GameRecord
from marl.runner.stall_watch import LearnerNeeds, StallWatch


def game(village_replies: int) -> GameRecord:
    return GameRecord(role_rewards={"mafia": 1.0, "village": -1.0}, replies={"mafia": 2, "village": village_replies})


def test_a_silent_role_is_reported_once_past_the_bound_and_a_step_starts_the_count_again():
    watch = StallWatch({"mafia_model": LearnerNeeds(("mafia",), 4), "village_model": LearnerNeeds(("village",), 8)},
                       stall_batches=3, in_flight=2)
    assert watch.bounds == {"mafia_model": 14, "village_model": 26}
    versions = {"mafia_model": 0, "village_model": 0}
    reasons = []
    for i in range(40):
        versions["mafia_model"] = i // 4  # the mafia's server steps every 4 games: never stalled
        reasons += watch.observe(game(0), versions)
    assert reasons == ["village's episodes have no tokens: every game ended before village called the model; 27"
                       " games, so village_model can never fill a batch"]
    versions["village_model"] = 1
    for i in range(26):  # a step: counted from 0 again
        versions["mafia_model"] = 10 + i // 4
        assert watch.observe(game(0), versions) == []


def test_a_role_that_speaks_but_never_trains_gets_the_general_reason():
    watch = StallWatch({"village_model": LearnerNeeds(("village", "seer"), 2)}, stall_batches=2)
    reasons = [r for i in range(5) for r in watch.observe(game(i % 2), {"village_model": 3})]
    assert reasons == ["village_model took no training step in 5 games (4 allowed, a batch being 2 games);"
                       " village/seer called the model in 2 of them"]
