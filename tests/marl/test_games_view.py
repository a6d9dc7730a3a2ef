"""Transcripts in games.jsonl (`run.transcripts`: full, summary, off; the size bounds) and `marl games show/list`."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from functools import partial

import pytest
import yaml
from rich.console import Console

from envs.base import TextAECEnv
from envs.signalling import SignallingGame
from marl.games.record import ROW_CHARS, SUMMARY_CHARS, TEXT_CHARS, GameRecord, append_game, read_games
from marl.games.table import GameSettings, GameTable
from marl.games.view import GamesViewError, list_games, pick_game, show_game
from marl.topology import Topology, TopologyError
from tests.marl.test_run import write_topology

PWNED = "\x1b]0;pwned\x07\x1b[2J"  # sets the window title, clears the screen


class Replies:
    """A player that sends the given replies in turn, then the env's scripted move."""

    def __init__(self, env, agent, replies):
        self.env, self.agent, self.replies = env, agent, list(replies)

    def act(self, observation: str) -> str:
        return self.replies.pop(0) if self.replies else self.env.scripted_action(self.agent)


def play_signalling(transcripts="full", replies=None, seed=5) -> GameRecord:
    """One SignallingGame played here by scripted players (with `replies[agent]` sent first)."""
    def player(seat):
        return Replies(seat.env, seat.agent, (replies or {}).get(seat.agent, []))

    table = GameTable(partial(SignallingGame, num_items=3), {"speaker": None, "listener": None},
                      GameSettings(transcripts=transcripts), player_factory=player)
    return table.play("sig-0", seed, {}, {})


def test_the_table_tells_the_env_which_episode_of_its_task_a_game_is():
    table = GameTable(partial(SignallingGame, orders="episode"), {"speaker": None, "listener": None}, GameSettings())
    records = [table.play("sig-0", 5, {}, {}, episode=episode) for episode in range(3)]
    assert [record.episode for record in records] == [0, 1, 2]
    assert len({record.summary["target"] for record in records}) == 1  # one task
    positions = [record.summary["orders"]["listener"].index(record.summary["target"]) for record in records]
    assert sorted(positions) == [0, 1, 2]  # the env drew each episode's order
    assert GameRecord.model_validate_json(records[2].model_dump_json()).episode == 2
    assert GameRecord(role_rewards={}).episode == 0  # an older row


def test_a_signalling_row_shows_the_target_both_messages_and_the_invalid_reply():
    record = play_signalling(replies={"listener": ["banana"]})
    summary = record.summary
    assert summary["target"] in summary["items"] and summary["message"] == summary["target"]
    assert record.transcript_mode == "full"
    turns = [(t.agent, t.role, t.invalid) for t in record.transcript]
    assert turns == [("speaker", "speaker", False), ("listener", "listener", True), ("listener", "listener", False)]
    speaker, wrong, right = record.transcript
    assert speaker.action == summary["target"] and summary["target"] in speaker.observation
    assert wrong.action == "banana" and f'The speaker said: "{summary["target"]}"' in wrong.observation
    assert 'Your reply "banana" was not valid' in right.observation  # the retry's observation says why
    assert summary["choices"]["listener"] == summary["target"] and record.role_rewards["listener"] == 1.0
    row = json.loads(record.model_dump_json())  # what games.jsonl holds
    assert row["transcript"][0]["action"] == summary["target"] and row["summary"]["target"] == summary["target"]


def test_the_game_table_still_pickles_for_ray_tasks():
    table = GameTable(partial(SignallingGame, num_items=3), {"speaker": None, "listener": None},
                      GameSettings(transcripts="summary"))
    copy = pickle.loads(pickle.dumps(table))
    assert copy.settings.transcripts == "summary"
    assert copy.play("t", 1, {}, {}).transcript_mode == "summary"


def test_summary_keeps_the_env_summary_and_the_actions_and_off_keeps_neither():
    summary = play_signalling("summary")
    assert summary.summary["target"] and [t.action for t in summary.transcript][0] == summary.summary["target"]
    assert all(t.observation is None for t in summary.transcript) and len(summary.transcript) == 2
    off = play_signalling("off")
    assert off.transcript_mode == "off" and off.transcript == [] and off.summary == {}
    assert off.role_rewards == summary.role_rewards  # the game itself is the same
    with pytest.raises(ValueError, match="full, summary, off"):
        play_signalling("everything")


class Chatter(TextAECEnv):
    """`turns` turns of one agent; each observation is 5000 characters; a summary of `summary_chars` characters."""

    possible_agents = ["talker"]

    def __init__(self, turns=40, summary_chars=10):
        super().__init__()
        self.turns, self.summary_chars = turns, summary_chars

    def _reset_game(self, seed, options):
        self.said = 0

    def _observe_text(self, agent):
        return f"start-{self.said} " + "o" * 5000 + f" end-{self.said}"

    def _apply(self, agent, action):
        self.said += 1
        self.terminations[agent] = self.said >= self.turns

    def summary(self):
        return {"notes": "s" * self.summary_chars}


def play_chatter(replies: list[str], **env_args) -> GameRecord:
    table = GameTable(partial(Chatter, **env_args), {"talker": None}, GameSettings(),
                      player_factory=lambda seat: Replies(None, seat.agent, replies))
    return table.play("chat", 0, {}, {})


def test_full_transcripts_keep_within_the_text_and_row_budgets():
    record = play_chatter(["r" * 10_000] + ["a" * 1500] * 39, turns=40, summary_chars=SUMMARY_CHARS - 100)
    first = record.transcript[0]
    assert len(first.observation) == TEXT_CHARS and first.observation.endswith(" end-0")  # the end is kept
    assert len(first.action) == TEXT_CHARS and first.action.startswith("rrr") and first.action.endswith("...")
    text = sum(len(t.action) + len(t.observation or "") for t in record.transcript)
    assert text + len(json.dumps(record.summary)) <= ROW_CHARS
    assert len(record.summary["notes"]) == SUMMARY_CHARS - 100
    # 2000 + 2000, then 12 turns of 2000 + 1500: the 14th turn's observation does not fit, its action does
    assert [t.observation is None for t in record.transcript] == [False] * 13 + [True]
    assert record.omitted_turns == 40 - 14  # then whole turns go
    assert record.turns == 40
    assert len(record.model_dump_json()) < ROW_CHARS + 100 * 40  # JSON keys and quotes on top of the text


def test_an_oversized_or_broken_summary_is_replaced_by_a_note_and_the_game_still_counts():
    big = play_chatter(["ok", "ok"], turns=2, summary_chars=SUMMARY_CHARS + 1)
    assert list(big.summary) == ["omitted"] and "over the limit" in big.summary["omitted"]

    class Broken(SignallingGame):
        def summary(self):
            raise KeyError("oops")

    table = GameTable(Broken, {"speaker": None, "listener": None}, GameSettings())
    record = table.play("b", 0, {}, {})
    assert "Broken.summary() raised KeyError('oops')" in record.summary["error"]
    assert record.role_rewards == {"speaker": 1.0, "listener": 1.0} and len(record.transcript) == 2


# --- marl games show / list ---------------------------------------------------------------------------------------


def write_games(path, records) -> None:
    with open(path, "w") as f:
        for record in records:
            append_game(f, record)


def shown(run_dir, which=None) -> str:
    console = Console(file=io.StringIO(), width=200)
    show_game(run_dir, which, console=console)
    return console.file.getvalue()


def test_games_show_prints_the_header_the_summary_and_every_turn(tmp_path):
    records = [play_signalling(seed=seed) for seed in range(3)]
    records[1] = records[1].model_copy(update={"task_id": "sig-1"})
    write_games(tmp_path / "games.jsonl", records)
    out = shown(tmp_path, "sig-1")
    game = records[1]
    assert out.startswith(f"game 2 of 3 (row 1) · task sig-1 · seed {game.seed} · episode 0")
    assert "players   listener: scripted, speaker: scripted" in out and "rewards   speaker 1, listener 1" in out
    assert f"target       {game.summary['target']}" in out and f"items        {', '.join(game.summary['items'])}" in out
    assert f"  1. speaker\n     | Items: {', '.join(game.summary['items'])}." in out
    assert f"     > {game.summary['target']}\n  2. listener\n" in out
    assert shown(tmp_path).startswith("game 3 of 3 (row 2) · task sig-0")  # default: the latest
    assert shown(tmp_path, "0").startswith("game 1 of 3 (row 0)") and shown(tmp_path, "-3").startswith("game 1 of 3")
    assert "same task rows 0, 2" in shown(tmp_path, "0")


def test_games_show_and_list_read_old_rows_and_refuse_bad_arguments(tmp_path):
    old = {"task_id": "t-0", "seed": 0, "role_rewards": {"speaker": 1.0}, "policy_versions": {"m": 0}, "turns": 2}
    (tmp_path / "games.jsonl").write_text(json.dumps(old) + "\n")
    assert read_games(tmp_path / "games.jsonl")[0].transcript == []
    out = shown(tmp_path)
    assert "task t-0" in out and "m v0" in out and "no transcript: this row was written before" in out
    console = Console(file=io.StringIO(), width=200)
    list_games(tmp_path, console=console)
    assert "    0  t-0  -  speaker 1  2 turns  m v0" in console.file.getvalue()
    games = read_games(tmp_path / "games.jsonl")
    with pytest.raises(GamesViewError, match="no row 5: the run has 1 games"):
        pick_game(games, "5")
    with pytest.raises(GamesViewError, match="no game of task 'nope'"):
        pick_game(games, "nope")
    with pytest.raises(GamesViewError, match="no games at"):
        shown(tmp_path / "elsewhere")


def marl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marl", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def test_games_show_and_list_escape_what_agents_sent(tmp_path):
    record = play_signalling(replies={"listener": [f"pick {PWNED} [bold]2[/bold]"]})
    record = record.model_copy(update={"task_id": f"t{PWNED}", "role_rewards": {f"r{PWNED}": 1.0}})
    write_games(tmp_path / "games.jsonl", [record])
    for args in (("show",), ("show", f"t{PWNED}"), ("list",)):
        result = marl("games", args[0], str(tmp_path), *args[1:])
        assert result.returncode == 0, result.stderr
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout
        assert "\\x1b]0;pwned\\x07\\x1b[2J" in result.stdout  # shown, escaped
    assert "[bold]2[/bold]" in marl("games", "show", str(tmp_path)).stdout  # not read as rich markup
    missing = marl("games", "show", str(tmp_path), "7")
    assert missing.returncode == 2 and "marl games show: error: no row 7" in missing.stderr


# --- the setting, and a real run ----------------------------------------------------------------------------------


def test_run_transcripts_is_validated_and_off_may_be_written_bare(tmp_path, tiny_model):
    path = write_topology(tmp_path, tiny_model)
    assert Topology.load(path, check_env=False).spec.run.transcripts == "full"
    assert Topology.load(path, ["run.transcripts=off"], check_env=False).spec.run.transcripts == "off"
    spec = yaml.safe_load(open(path))
    spec["run"]["transcripts"] = "everything"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(TopologyError, match=r"bad.yaml:\d+: run.transcripts: Input should be 'full', 'summary'"):
        Topology.load(str(tmp_path / "bad.yaml"), check_env=False)


@pytest.mark.heavy  # a `marl run` of two servers (tests/conftest.py's HEAVY_FILES marks whole files)
def test_a_tiny_signalling_run_writes_transcripts_that_games_show_prints(tiny_model, tmp_path):
    path = write_topology(tmp_path, tiny_model)
    result = subprocess.run([sys.executable, "-m", "marl.cli", "run", path, "run.games=2", "run.max_steps=1000"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stdout + result.stderr
    games = read_games(tmp_path / "run" / "games.jsonl")
    assert len(games) == 2
    game = games[-1]
    target, message = game.summary["target"], game.summary["message"]
    assert target in game.summary["items"] and game.transcript[0].role == "speaker"
    assert f"Target: {target}." in game.transcript[0].observation
    listener = [t for t in game.transcript if t.role == "listener"]
    assert listener and all(t.invalid is not None for t in game.transcript)
    if message:  # the tiny model may say nothing valid (the fallback: silence)
        assert f'The speaker said: "{message}"' in listener[0].observation
    shown_game = marl("games", "show", str(tmp_path / "run"))
    assert shown_game.returncode == 0, shown_game.stderr
    assert f"target       {target}" in shown_game.stdout and "  1. speaker" in shown_game.stdout
    assert f"task {game.task_id}" in shown_game.stdout and "listener: listener_model v" in shown_game.stdout
