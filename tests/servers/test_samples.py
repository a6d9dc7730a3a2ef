"""Timeline merging on hand-made calls: which calls become one sample, and the exact tokens, masks and logprobs."""

from servers.episodes.samples import CallRecord, merge_calls, unmerged_tokens


def call(agent, prompt, completion, version=0):
    return CallRecord(agent=agent, prompt_ids=list(prompt), completion_ids=list(completion),
                      logprobs=[-0.1 * (i + 1) for i in range(len(completion))], policy_version=version)


def test_five_turn_conversation_is_one_sample():
    calls, history = [], [1, 2, 3]  # system + first user turn
    for turn in range(5):
        completion = [100 + turn, 101 + turn]
        calls.append(call("a", history, completion, version=turn))
        history = history + completion + [50 + turn, 51 + turn]  # the template glue + next user turn
    (sample,) = merge_calls("ep", calls, reward=1.0)
    assert sample.num_calls == 5
    assert sample.token_ids == calls[-1].prompt_ids + calls[-1].completion_ids
    assert len(sample.token_ids) == len(sample.loss_mask) == len(sample.logprobs) == 3 + 5 * 2 + 4 * 2
    assert sum(sample.loss_mask) == 10
    assert sample.policy_version == 0
    # mask is 1 exactly on generated tokens, and their logprobs sit on them
    for c in calls:
        start = next(i for i in range(len(sample.token_ids)) if sample.token_ids[i:i + 2] == c.completion_ids)
        assert sample.loss_mask[start:start + 2] == [1, 1]
        assert sample.logprobs[start:start + 2] == c.logprobs
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask) if m == 0)


def test_two_interleaved_agents_are_two_samples():
    a1, b1 = call("a", [1, 2], [10]), call("b", [1, 3], [20])
    a2, b2 = call("a", [1, 2, 10, 4], [11]), call("b", [1, 3, 20, 5], [21])
    samples = merge_calls("ep", [a1, b1, a2, b2], reward=0.0, agent_rewards={"a": 1.0, "b": -1.0})
    assert [(s.agent, s.num_calls, s.reward) for s in samples] == [("a", 2, 1.0), ("b", 2, -1.0)]
    assert samples[0].token_ids == [1, 2, 10, 4, 11] and samples[0].loss_mask == [0, 0, 1, 0, 1]
    assert samples[1].token_ids == [1, 3, 20, 5, 21] and samples[1].loss_mask == [0, 0, 1, 0, 1]


def test_an_agent_rewarded_without_a_call_gets_an_empty_sample_at_the_episodes_version():
    samples = merge_calls("ep", [call("a", [1], [2])], reward=0.5, agent_rewards={"a": 1.0, "b": -1.0},
                          policy_version=3)
    assert [(s.agent, s.num_calls, s.reward) for s in samples] == [("a", 1, 1.0), ("b", 0, -1.0)]
    assert samples[1].token_ids == samples[1].loss_mask == samples[1].logprobs == []
    assert samples[1].policy_version == 3
    assert len(merge_calls("ep", [call("a", [1], [2])], reward=0.5)) == 1  # only agents named in agent_rewards


def test_same_tokens_from_another_agent_do_not_merge():
    first, second = call("a", [1, 2], [3]), call("b", [1, 2, 3, 4], [5])
    assert len(merge_calls("ep", [first, second], reward=0.0)) == 2


def test_diverging_retry_is_a_separate_sample():
    first = call("a", [1, 2, 3], [7, 8])
    retry = call("a", [1, 2, 3], [9])  # same prompt, sampled again: does not extend [1,2,3,7,8]
    follow = call("a", [1, 2, 3, 9, 4], [6])  # continues the retry
    samples = merge_calls("ep", [first, retry, follow], reward=0.5)
    assert [s.token_ids for s in samples] == [[1, 2, 3, 7, 8], [1, 2, 3, 9, 4, 6]]
    assert [sum(s.loss_mask) for s in samples] == [2, 2]
    assert [s.num_calls for s in samples] == [1, 2]


def test_unrelated_calls_stay_separate():
    samples = merge_calls("ep", [call("a", [1], [2]), call("a", [5], [6]), call("a", [1, 2, 3], [4])], reward=0)
    assert [s.token_ids for s in samples] == [[1, 2, 3, 4], [5, 6]]
    assert samples[0].loss_mask == [0, 1, 0, 1]


def test_unmerged_tokens_counts_every_call_as_its_own_sample():
    calls, prompt = [], [1, 2, 3]
    for turn in range(4):  # each call re-sends the conversation so far plus a new observation
        completion = [10 + turn] * (turn + 1)
        calls.append(call("a", prompt, completion))
        prompt = prompt + completion + [7, 7]
    (sample,) = merge_calls("e", calls, reward=1.0)
    assert unmerged_tokens(sample) == sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
    assert len(sample.token_ids) < unmerged_tokens(sample)
