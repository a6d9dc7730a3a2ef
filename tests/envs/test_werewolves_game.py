"""Werewolves with LLM players on real local servers (tiny models) through the coordinator: the werewolves' server
and the seer's server each receive their own linked episode, tagged with their own role, with the right reward."""

from __future__ import annotations

from conftest import LocalServer, ledger_samples, trainable
from tiny_model import build_tiny_model

from envs.werewolves import Werewolves
from marl.transaction.coordinator import Coordinator, GameSettings


def samples(data_dir) -> list[tuple]:
    return ledger_samples(data_dir, "e.episode_id, e.task_id, s.agent, s.reward, s.num_calls, e.num_calls")


def test_llm_werewolves_and_seer_train_on_their_own_servers(tmp_path):
    # Werewolves conversations are long and the tiny tokenizer spends ~4 tokens a word: give it SmolLM2's context.
    tiny_model = build_tiny_model(tmp_path / "model", max_position_embeddings=8192)
    with LocalServer(tiny_model, tmp_path / "wolves") as wolves, LocalServer(tiny_model, tmp_path / "seer") as seer:
        coordinator = Coordinator(
            env_factory=lambda: Werewolves(max_rounds=2),
            role_servers={"werewolf": "wolves_model", "seer": "seer_model", "villager": None, "witch": None,
                          "hunter": None},
            endpoints={"wolves_model": trainable("wolves_model", wolves.url, job="werewolves", batch_size=4),
                       "seer_model": trainable("seer_model", seer.url, job="werewolves", batch_size=4)},
            settings=GameSettings(max_tokens=8, lease_timeout_s=60))
        try:
            result = coordinator.play_game("ww-0", seed=3)
        finally:
            coordinator.close()

    env = Werewolves(max_rounds=2)
    env.reset(seed=3)
    wolves_seats = [a for a in env.possible_agents if env.role_of(a) == "werewolf"]
    assert len(wolves_seats) == 3
    assert set(result.role_rewards) == {"werewolf", "seer", "villager", "witch", "hunter"}
    assert result.role_rewards["seer"] == result.role_rewards["villager"]  # one team, one result
    assert result.teams == {"werewolf": "werewolves", "seer": "village", "villager": "village", "witch": "village",
                            "hunter": "village"}
    assert result.winner in ("werewolves", "village", "draw")
    village_won = {"werewolves": 0.0, "village": 1.0, "draw": 0.0}[result.winner]  # draw_reward defaults to 0
    assert result.role_rewards["villager"] == village_won

    for server, data, role in (("wolves_model", "wolves", "werewolf"), ("seer_model", "seer", "seer")):
        rows = samples(tmp_path / data)
        assert {episode for episode, *_ in rows} == {result.episodes[server]}  # exactly this game's episode
        for _, task, agent, reward, _sample_calls, _episode_calls in rows:
            assert (task, agent) == ("ww-0", role)  # only its own role's calls
            assert reward == result.role_rewards[role]
        assert sum(r[4] for r in rows) == rows[0][5] > 0  # every call of the episode is in some sample
    # three werewolves share one server and one tag, but each keeps its own conversation: one sample per werewolf
    assert len(samples(tmp_path / "wolves")) == 3
    assert len(samples(tmp_path / "seer")) == 1
