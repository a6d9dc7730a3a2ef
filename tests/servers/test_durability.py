"""Durability: the ledger survives SIGKILL, and every acknowledged episode reaches the trainer exactly once."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time

import pytest
from conftest import admin_http, play_episode, server_process, start_rolling, wait_version

from servers.episodes.ledger import GroupKey, Ledger, LedgerThread
from servers.episodes.prepared import PreparedEpisodes
from servers.episodes.samples import Sample


def test_sigkill_right_after_end_loses_nothing_and_trains_once(tiny_model, tmp_path):
    data = tmp_path / "data"
    config = dict(batch_size=1, num_repeat=2, save_freq=1)
    with server_process(tiny_model, data) as (proc, url), admin_http(url) as http:
        start_rolling(http, **config)
        first = play_episode(http, "t", reward=1.0)
        proc.kill()  # SIGKILL the instant end returned
    with server_process(tiny_model, data) as (proc, url), admin_http(url) as http:
        assert http.get("/control/pool").json()["pending_episodes"] == 1  # recovered before the engine starts
        start_rolling(http, **config)
        second = play_episode(http, "t", reward=0.0)  # completes the group of two: one training step
        wait_version(http, 1)
        proc.kill()
    db = sqlite3.connect(data / "ledger.sqlite")
    consumed = dict(db.execute("SELECT episode_id, consumed_step FROM samples").fetchall())
    assert consumed == {first: 1, second: 1}
    db.close()
    (record,) = [json.loads(line) for line in (data / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and record["samples"] == 2  # the step trained on both episodes
    with server_process(tiny_model, data) as (proc, url), admin_http(url) as http:
        start_rolling(http, **config)
        status = http.get("/control/status").json()
        assert status["policy_version"] == 1  # resumed from the step-1 checkpoint
        assert status["pool"]["pending_episodes"] == 0  # nothing is handed to the trainer again


def test_sigkill_during_an_overlapped_step_loses_nothing_and_trains_once(tiny_model, tmp_path):
    """`overlap`: episodes are acknowledged while a step trains; SIGKILL lands mid-step. The claimed batch returns to
    the pool, and every acknowledged episode is trained exactly once by the steps after the restart."""
    data = tmp_path / "data"
    slow = dict(batch_size=1, num_repeat=2, save_freq=1, overlap=True, grpo={"ppo_epochs": 2000})  # a long step
    with server_process(tiny_model, data) as (proc, url), admin_http(url) as http:
        start_rolling(http, **slow)
        acked = [play_episode(http, "t1", reward=r) for r in (0.0, 1.0)]  # a complete batch: step 1 starts
        deadline = time.monotonic() + 60
        while http.get("/control/monitor").json()["training"] is None:
            assert time.monotonic() < deadline, "step 1 never started"
            time.sleep(0.02)
        acked.append(play_episode(http, "t2", reward=1.0))  # acknowledged while step 1 trains
        assert http.get("/control/monitor").json()["training"] is not None  # still mid-step
        assert http.get("/control/pool").json()["pending_episodes"] == 1  # t1's two are claimed by step 1
        proc.kill()
    with server_process(tiny_model, data) as (proc, url), admin_http(url) as http:
        start_rolling(http, **{**slow, "grpo": {}})
        acked.append(play_episode(http, "t2", reward=0.0))  # both groups complete: steps 1 and 2
        wait_version(http, 2)
        proc.kill()
    db = sqlite3.connect(data / "ledger.sqlite")
    rows = db.execute("SELECT episode_id, task_id, consumed_step FROM samples").fetchall()
    db.close()
    assert sorted(e for e, _, _ in rows) == sorted(acked)  # each acknowledged episode once, nothing else
    by_task = {task: {step for _, t, step in rows if t == task} for _, task, _ in rows}
    assert sorted(by_task.values(), key=min) == [{1}, {2}]  # each group trained by exactly one step
    records = [json.loads(line) for line in (data / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["samples"]) for r in records] == [(1, 2), (2, 2)]  # the killed step left no record


def _sample(episode: str, agent: str = "a") -> Sample:
    return Sample(episode_id=episode, agent=agent, token_ids=[1, 2, 3], loss_mask=[0, 1, 1],
                  logprobs=[0.0, -0.5, -0.25], reward=1.0, policy_version=0, num_calls=1)


def test_ends_that_arrive_together_are_committed_together_and_a_bad_one_fails_alone(tmp_path):
    ledger = Ledger(tmp_path / "l.sqlite")
    ledger.record_episode(episode_id="taken", job="j", task_id="t", client_id="c", reward=1.0, agent_rewards=None,
                          metadata={}, num_calls=1, samples=[_sample("taken")])
    commits = []
    real = ledger.record_episodes
    ledger.record_episodes = lambda episodes: commits.append(len(episodes)) or real(episodes)  # counts, then commits

    async def end_all() -> list:
        thread = LedgerThread(ledger)
        ids = [f"e{i}" for i in range(40)] + ["taken"] + [f"e{i}" for i in range(40, 80)]  # one id recorded before
        outcomes = await asyncio.gather(*(thread.record_episode(
            episode_id=episode, job="j", task_id="t", client_id="c", reward=1.0, agent_rewards=None, metadata={},
            num_calls=1, samples=[_sample(episode)]) for episode in ids), return_exceptions=True)
        await thread.close()
        return outcomes

    outcomes = asyncio.run(end_all())
    assert [type(o).__name__ for o in outcomes if o is not None] == ["IntegrityError"]  # the duplicate alone failed
    assert outcomes[40] is not None and sum(commits) == 81 and len(commits) < 10  # a few transactions, not 81
    db = sqlite3.connect(tmp_path / "l.sqlite")
    assert db.execute("SELECT COUNT(*) FROM episodes").fetchone()[0] == 81  # 80 new + the one before
    assert db.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 81  # the duplicate's sample rolled back
    db.close()


def test_ledger_claims_once_and_recovers_uncheckpointed_steps(tmp_path):
    ledger = Ledger(tmp_path / "l.sqlite")
    for i in range(3):
        ledger.record_episode(episode_id=f"e{i}", job="j", task_id="t", client_id="c", reward=1.0,
                              agent_rewards=None, metadata={}, num_calls=1, samples=[_sample(f"e{i}")])
    key = GroupKey("j", "t", "a")
    assert ledger.pool_groups() == {key: 3}
    claimed = ledger.claim_batch(1, [key])
    assert [s.episode_id for s in claimed[key]] == ["e0", "e1", "e2"]
    assert claimed[key][0].logprobs == [0.0, -0.5, -0.25]
    assert ledger.claim_batch(2, [key]) == {key: []}  # claimed at most once
    ledger.close()
    reopened = Ledger(tmp_path / "l.sqlite")
    assert reopened.recover(resume_step=1) == 0  # step 1 was kept: its claim stands
    assert reopened.recover(resume_step=0) == 3  # step 1 was lost: its samples return to the pool
    assert reopened.pool_groups() == {key: 3}
    assert reopened.drop_stale(min_version=1) == 3 and reopened.pool_groups() == {}


def test_compaction_empties_trained_tokens_and_keeps_every_episode_and_what_may_be_recovered(tmp_path):
    ledger = Ledger(tmp_path / "l.sqlite")
    for i, task in enumerate(["t1", "t1", "t2", "t2", "t3"]):
        ledger.record_episode(episode_id=f"e{i}", job="j", task_id=task, client_id="c", reward=1.0,
                              agent_rewards=None, metadata={}, num_calls=1, samples=[_sample(f"e{i}")])
    ledger.claim_batch(1, [GroupKey("j", "t1", "a")])
    ledger.claim_batch(2, [GroupKey("j", "t2", "a")])
    assert ledger.compact(through_step=1) == 2
    assert ledger.compact(through_step=1) == 0  # once
    assert [s.token_ids for s in ledger.samples_of("e0")] == [[]]  # trained by step 1: tokens gone, row kept
    assert ledger.samples_of("e2")[0].token_ids == [1, 2, 3]  # step 2: may still be recovered
    assert ledger.samples_of("e4")[0].token_ids == [1, 2, 3]  # in the pool
    assert ledger.recover(resume_step=1) == 2 and ledger.pool_groups()[GroupKey("j", "t2", "a")] == 2
    episodes = ledger.db.execute("SELECT COUNT(*) FROM episodes").fetchone()[0]
    ledger.close()
    assert episodes == 5  # every acknowledged episode is still on record


def test_a_server_keeping_one_step_of_sample_tokens_compacts_after_each_checkpoint(tiny_model, tmp_path):
    data = tmp_path / "data"
    with server_process(tiny_model, data) as (proc, url), admin_http(url) as http:
        start_rolling(http, batch_size=1, num_repeat=2, save_freq=1, keep_sample_tokens_steps=1)
        episodes = [play_episode(http, task, reward=r) for task in ("t1", "t2") for r in (0.0, 1.0)]
        wait_version(http, 2)
    ledger = Ledger(data / "ledger.sqlite")
    try:
        tokens = [len(ledger.samples_of(e)[0].token_ids) for e in episodes]
    finally:
        ledger.close()
    assert tokens[:2] == [0, 0] and min(tokens[2:]) > 0  # step 1's emptied at step 2's checkpoint; step 2's kept


def test_the_pools_kept_counts_equal_sqlites_after_every_kind_of_write(tmp_path):
    ledger = Ledger(tmp_path / "l.sqlite")
    prepared = PreparedEpisodes(ledger)

    def record(episode: str, task: str, agents: tuple[str, ...] = ("a",), version: int = 0) -> None:
        samples = [Sample(**{**vars(_sample(episode, agent)), "policy_version": version}) for agent in agents]
        ledger.record_episode(episode_id=episode, job="j", task_id=task, client_id="c", reward=1.0,
                              agent_rewards=None, metadata={}, num_calls=1, samples=samples)

    def agrees() -> bool:
        return (list(ledger.pool_groups().items()) == list(ledger.count_pool_groups().items())  # and their order
                and ledger.pending_episodes() == ledger.count_pending_episodes())

    assert ledger.pool_groups() == {} and agrees()
    record("e0", "t1", ("a", "b"))
    record("e1", "t2")
    record("e2", "t1", ("a", "a"))  # two samples of one agent: one episode of the group
    record("e3", "t3", ())  # no samples: nothing joins the pool
    assert ledger.pool_groups() == {GroupKey("j", "t1", "a"): 2, GroupKey("j", "t1", "b"): 1,
                                    GroupKey("j", "t2", "a"): 1} and ledger.pending_episodes() == 3 and agrees()
    with pytest.raises(sqlite3.IntegrityError):  # a second e1: the transaction rolls back, nothing is counted
        record("e1", "t2")
    assert ledger.pending_episodes() == 3 and agrees()
    prepared.prepare(game_id="g", timeout_s=60, decision_log=None, request_digest="d", samples=[_sample("p0")],
                     episode_id="p0", job="j", task_id="t4", client_id="c", reward=1.0, agent_rewards=None,
                     metadata={}, num_calls=1)
    assert GroupKey("j", "t4", "a") not in ledger.pool_groups() and agrees()  # prepared: not in the pool yet
    prepared.commit("p0")
    assert ledger.pool_groups()[GroupKey("j", "t4", "a")] == 1 and agrees()
    ledger.claim_batch(1, [GroupKey("j", "t1", "a")])
    assert GroupKey("j", "t1", "a") not in ledger.pool_groups() and agrees()
    record("e4", "t1", version=1)  # the group comes back, as the newest
    assert list(ledger.pool_groups())[-1] == GroupKey("j", "t1", "a") and agrees()
    assert ledger.recover(resume_step=0) == 3 and agrees()  # e0's and e2's samples of agent a
    assert ledger.drop_stale(min_version=1) == 6 and list(ledger.pool_groups().values()) == [1] and agrees()
    # a group whose agent never called the model (its empty samples only) waits outside until one that called joins
    silent = Sample(episode_id="e5", agent="v", token_ids=[], loss_mask=[], logprobs=[], reward=0.0, policy_version=1,
                    num_calls=0)
    ledger.record_episode(episode_id="e5", job="j", task_id="t5", client_id="c", reward=0.0, agent_rewards={"v": 0.0},
                          metadata={}, num_calls=0, samples=[silent])
    assert GroupKey("j", "t5", "v") not in ledger.pool_groups() and ledger.pending_episodes() == 2 and agrees()
    record("e6", "t5", ("v",), version=1)
    assert ledger.pool_groups()[GroupKey("j", "t5", "v")] == 2 and agrees()  # both episodes, at the e5's place
    assert list(ledger.pool_groups())[-1] == GroupKey("j", "t5", "v")


def test_a_complete_group_whose_agent_never_called_the_model_leaves_the_pool(tmp_path):
    """Issue 55: a role that never speaks must not pile up groups nothing can train on; a group still short of
    num_repeat waits (an episode that called may join it), one that called is kept."""
    ledger = Ledger(tmp_path / "l.sqlite")

    def record(episode: str, task: str, called: bool) -> None:
        sample = _sample(episode, "v") if called else Sample(
            episode_id=episode, agent="v", token_ids=[], loss_mask=[], logprobs=[], reward=0.0, policy_version=0,
            num_calls=0)
        ledger.record_episode(episode_id=episode, job="j", task_id=task, client_id="c", reward=0.0,
                              agent_rewards={"v": 0.0}, metadata={}, num_calls=int(called), samples=[sample])

    try:
        for i in range(3):
            record(f"s{i}", "silent", called=False)
        record("w0", "waiting", called=False)
        record("m0", "mixed", called=False)
        record("m1", "mixed", called=True)
        assert ledger.drop_silent(num_repeat=2) == 3  # the 3 episodes of the complete silent group
        assert ledger.drop_silent(num_repeat=2) == 0
        assert ledger.pool_groups() == {GroupKey("j", "mixed", "v"): 2}
        assert ledger.pending_episodes() == ledger.count_pending_episodes() == 3  # w0 waits, m0 and m1 stay
        assert ledger.recover(resume_step=0) == 0  # dropped is not claimed: a failed step never brings it back
    finally:
        ledger.close()
