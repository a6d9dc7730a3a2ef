"""A policy that stops exploring shows it: per step and per role, the share of groups whose replies are all the
same tokens and the mean -logprob of generated tokens (servers.trainers.step_metrics.reply_diversity), in
metrics.jsonl, in /metrics and in the live tables; `marl run` warns once when a role is collapsed and flat
(marl.watching.collapse.CollapseWatch)."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import admin_http, begin_lease, start_rolling, wait_version
from prometheus_client.parser import text_string_to_metric_families

from marl.protocol import agent_headers
from marl.watching.collapse import CollapseWatch, collapsed
from servers.backends import Group
from servers.episodes.samples import Sample
from servers.trainers.step_metrics import reply_diversity


def _sample(episode: str, agent: str, reply: list[int], logprob: float) -> Sample:
    prompt = [1, 2, 3]
    return Sample(episode_id=episode, agent=agent, token_ids=prompt + reply, loss_mask=[0] * 3 + [1] * len(reply),
                  logprobs=[0.0] * 3 + [logprob] * len(reply), reward=0.0, policy_version=0, num_calls=1)


def test_reply_diversity_counts_groups_of_one_reply_and_the_nll_per_role():
    listen, speak = "listener", "speaker"
    groups = [Group("j", "t1", listen, [_sample("a", listen, [7], -0.01), _sample("b", listen, [7], -0.01)]),
              Group("j", "t2", listen, [_sample("c", listen, [7], -0.01), _sample("d", listen, [8], -0.5)]),
              Group("j", "t1", speak, [_sample("e", speak, [4, 5], -1.0), _sample("f", speak, [5, 4], -2.0)])]
    m = reply_diversity(groups)
    assert m["groups_same_reply/listener"] == pytest.approx(0.5)
    assert m["groups_same_reply/speaker"] == 0.0
    assert m["groups_same_reply"] == pytest.approx(1 / 3)
    assert m["reply_nll/listener"] == pytest.approx((0.01 * 3 + 0.5) / 4)
    assert m["reply_nll/speaker"] == pytest.approx(1.5)
    silent = Sample(episode_id="g", agent=speak, token_ids=[], loss_mask=[], logprobs=[], reward=0.0,
                    policy_version=0, num_calls=0)  # a role that made no call: no reply, so no "same" reply either
    groups.append(Group("j", "t2", speak, [silent, silent.model_copy(update={"episode_id": "h"})]))
    assert reply_diversity(groups) == m


def _play(http, task: str, reward: float, temperature: float, max_tokens: int) -> None:
    lease = begin_lease(http)
    client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"],
                           default_headers=agent_headers("listener"))
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"pick one: {task}"}],
                                   max_tokens=max_tokens, temperature=temperature)
    r = http.post(f"/episodes/{lease['episode_id']}/end", json={"client_id": "c", "task_id": task, "reward": reward})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("temperature", "max_tokens", "same"), [(0.0, 1, 1.0), (1.0, 6, 0.0)],
                         ids=["forced to one token", "sampling freely"])
def test_a_server_reports_a_role_whose_replies_are_all_the_same(local_server, tmp_path, temperature, max_tokens, same):
    with local_server() as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=2, num_repeat=2, save_freq=0)
        for task in ("t1", "t2"):
            for reward in (0.0, 1.0):  # a reward spread, so that the step trains
                _play(http, task, reward, temperature, max_tokens)
        wait_version(http, 1)
        (step,) = [json.loads(line) for line in (tmp_path / "server" / "metrics.jsonl").read_text().splitlines()]
        assert step["groups_same_reply/listener"] == same
        assert step["reply_nll/listener"] > 0.0
        gauges = {s.name: s.value for family in text_string_to_metric_families(http.get("/metrics").text)
                  for s in family.samples}
        assert gauges["marl_last_step_groups_same_reply"] == same
        assert gauges["marl_last_step_reply_nll"] == pytest.approx(step["reply_nll"])


def _step(same: float, nll: float, reward: float) -> dict[str, float]:
    return {"reply_nll/listener": nll, "groups_same_reply/listener": same, "reward_mean/listener": reward}


def test_the_watch_warns_once_when_a_role_is_collapsed_and_its_reward_flat():
    watch = CollapseWatch(steps=3)
    assert watch.observe("team.listener", _step(1.0, 0.01, 0.33)) == []
    assert watch.observe("team.listener", _step(1.0, 0.01, 0.34)) == []
    (warning,) = watch.observe("team.listener", _step(0.95, 0.01, 0.33))
    assert "team.listener: role listener may have collapsed" in warning and "95%" in warning
    assert watch.observe("team.listener", _step(1.0, 0.01, 0.33)) == []  # once per learner and role


def test_the_watch_sees_a_collapse_in_what_the_replies_mean_while_their_tokens_still_vary():
    """"2", "2." and invalid ramblings differ as tokens; the env's labels say the listener picks 2 whatever it hears."""
    watch, moves = CollapseWatch(steps=3), {"listener": {"pick 2": 9, "pick none": 1}}
    assert watch.observe("team.listener", _step(0.0, 1.4, 0.25), moves) == []
    assert watch.observe("team.listener", _step(0.0, 1.4, 0.20), moves) == []
    (warning,) = watch.observe("team.listener", _step(0.0, 1.4, 0.25), moves)
    assert "90% of its recent moves were 'pick 2'" in warning
    quiet = CollapseWatch(steps=3)
    assert all(quiet.observe("a", _step(0.0, 1.4, 0.25), {"listener": {"pick 1": 4, "pick 2": 3, "pick 3": 3}}) == []
               for _ in range(5))
    # a model that cannot play yet: its replies refused (label "invalid") are not one answer it settled on
    learning = CollapseWatch(steps=3)
    assert all(learning.observe("a", _step(0.0, 1.4, -0.4), {"listener": {"invalid": 87, "[check]": 13}}) == []
               for _ in range(5))


def test_the_watch_stays_quiet_while_a_collapsed_role_still_gains_or_a_role_still_explores():
    rising, exploring = CollapseWatch(steps=3), CollapseWatch(steps=3)
    for i in range(6):
        assert rising.observe("a", _step(1.0, 0.01, 0.3 + 0.1 * i)) == []
        assert exploring.observe("a", _step(0.2, 0.8, 0.33)) == []
    assert collapsed(0.01, 0.0) and collapsed(0.9, 0.9) and collapsed(1.0, 0.0, 0.85) and not collapsed(0.5, 0.5, 0.5)
