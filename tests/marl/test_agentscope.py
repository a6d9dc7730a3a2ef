"""AgentScope agents over a real local server with a tiny model: role tags, timeline merging, the example end to end."""

from __future__ import annotations

import importlib.util
import re
import sqlite3
from array import array
from pathlib import Path

import pytest
from transformers import AutoTokenizer

pytest.importorskip("agentscope")

from conftest import ADMIN, LocalServer
from tiny_model import build_tiny_model

from marl import EpisodeOutput, SwarmClient
from marl.agents import ScriptedAgent
from marl.agents.agentscope import (
    AgentScopePlayer,
    Fallback,
    agentscope_players,
    role_model,
)
from marl.games.table import Seat

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agentscope_werewolves.py"
CLOCK = re.compile(r"\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2}:\d{2}|current-time|timezone", re.IGNORECASE)


def samples(data_dir: Path) -> list[tuple]:
    """(episode_id, task_id, agent, reward, num_calls, prompt_ids) of every sample in a server's ledger; prompt_ids:
    the tokens the model did not generate (loss mask 0)."""
    db = sqlite3.connect(data_dir / "ledger.sqlite")
    try:
        rows = db.execute("SELECT episode_id, task_id, agent, reward, num_calls, token_ids, loss_mask"
                          " FROM samples").fetchall()
    finally:
        db.close()
    return [(*row[:5], [t for t, m in zip(array("i", row[5]), array("b", row[6])) if not m]) for row in rows]


def test_role_model_tags_the_calls_and_a_seats_turns_merge_into_one_sample(tiny_model, tmp_path):
    with LocalServer(tiny_model, tmp_path / "server") as server, SwarmClient(server.url, admin_token=ADMIN) as client:
        client.auto_sync_train_config_and_start_engine({"batch_size": 4, "num_repeat": 1, "save_freq": 0})
        episode_id, lease = client.begin_episode()
        seer = Seat("player_3", "seer", "server", system_prompt="You are the seer.", base_url=lease.base_url,
                    api_key=lease.api_key, model=lease.model, trainable=True, max_tokens=4, temperature=1.0)
        villager = Seat("player_5", "villager", None, system_prompt="You are a villager.", max_tokens=4)
        # The fallback is any OpenAI-compatible endpoint; pointing it at this lease shows its calls and their tag.
        fallback = Fallback(lease.base_url, lease.model, lease.api_key)
        players = [AgentScopePlayer(seer, role_model(seer)), agentscope_players(fallback)(villager)]
        for turn in range(3):
            for player in players:
                assert isinstance(player.act(f"Night {turn}. Who do you check?"), str)
        for player in players:
            player.close()
        client.end_episode("task-0", episode_id, EpisodeOutput(reward=0.5, agent_rewards={"seer": 1.0}))
        assert isinstance(agentscope_players()(villager), ScriptedAgent)  # no fallback: scripted by the env

    rows = samples(tmp_path / "server")
    assert sorted((agent, reward, calls) for _, _, agent, reward, calls, _ in rows) == [
        ("seer", 1.0, 3), ("villager", 0.5, 3)]  # tagged by role, each seat's three turns merged into one sample


def _run_example(argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("agentscope_werewolves", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


@pytest.fixture(scope="module")
def long_tiny_model(tmp_path_factory) -> Path:
    """The tiny model with an 8k context: a werewolf's conversation of one round is about 2.5k tiny-model tokens."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-8k"), max_position_embeddings=8192)


def test_example_plays_werewolves_with_agentscope_agents_against_a_local_server(long_tiny_model, tmp_path, capsys):
    with LocalServer(long_tiny_model, tmp_path / "server") as server:
        # One round (then a draw): the random tiny model's votes are mostly invalid, so full games drag on. The
        # bonus for valid first replies gives the roles different rewards to check.
        rc = _run_example(["--server", server.url, f"--admin-token={ADMIN}", "--env", "envs.werewolves:Werewolves",
                           "--env-arg", "max_rounds=1", "--env-arg", "valid_action_bonus=1.0",
                           "--roles", "werewolf,seer", "--games", "1", "--max-tokens", "6"])
        out = capsys.readouterr().out
        assert rc == 0, out
        with SwarmClient(server.url, admin_token=ADMIN) as client:
            assert client.status().pool.running_leases == 0

    printed = re.search(r"agentscope-0 \(seed \d+\): winner \w+, \d+ turns, .* rewards (.*); episode (\S+)", out)
    assert printed, out
    rewards = {role: float(value) for role, value in re.findall(r"(\w+) ([+-]\d+\.\d+)", printed.group(1))}
    rows = samples(tmp_path / "server")
    assert {episode for episode, *_ in rows} == {printed.group(2)}  # exactly the one game's episode
    # 3 werewolves and the seer: each seat's turns merged into one sample, recorded under its role
    assert sorted(agent for _, _, agent, *_ in rows) == ["seer", "werewolf", "werewolf", "werewolf"]
    assert all(calls >= 2 for *_, calls, _ in rows)  # every seat had two turns or more in the round
    for _, task, agent, reward, _, _ in rows:
        assert task == "agentscope-0" and reward == pytest.approx(rewards[agent], abs=0.005)  # printed: 2 decimals

    tokenizer = AutoTokenizer.from_pretrained(long_tiny_model)
    for *_, calls, prompt_ids in rows:
        text = tokenizer.decode(prompt_ids)
        # system, then one user turn per call (the observation) and the replies as assistant turns: not folded
        assert text.startswith("<|im_start|>system\nYou are Player ") and text.count("<|im_start|>system") == 1
        assert text.count("<|im_start|>user\n") == calls and text.count("<|im_start|>assistant\n") == calls
        assert not CLOCK.search(text), text  # no runtime state (time, date) injected into the prompts
