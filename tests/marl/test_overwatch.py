"""Observability: Prometheus /metrics, the monitor snapshot, `marl overwatch` (textual, headless), `marl plot`,
and the token-level episode viewer. Real servers on loopback, tiny models."""

from __future__ import annotations

import asyncio
import html
import json
import re
import threading
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from marl.protocol import MonitorSnapshot
from marl.watching.overwatch import OverwatchApp, ServerView, Source, resolve_sources, sparkline
from marl.watching.plot import plot_run
from servers.episodes.view import CLOSE, OPEN, list_episodes, safe, show_episode, spans
from tests.conftest import ADMIN, admin_http, play_episode, start_rolling, wait_version


def scrape(http) -> dict[tuple[str, tuple], float]:
    """/metrics parsed by prometheus-client's own parser: {(sample name, sorted labels): value}."""
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_count_leases_calls_tokens_and_steps(local_server):
    with local_server() as srv, admin_http(srv.url) as http:
        assert http.get("/metrics", headers={"Authorization": ""}).status_code == 200  # open, like vLLM's
        offline = scrape(http)
        assert offline["marl_engine_state", (("model", "tiny"), ("policy", "default"), ("state", "OFFLINE"))] == 1
        start_rolling(http, batch_size=1, num_repeat=2, max_leases=4)

        generated = prompt = calls = 0
        for reward in (0.0, 1.0):  # one group of 2 episodes: exactly one training step
            lease = http.post("/episodes/begin", json={"client_id": "c"}).json()
            client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"])
            for turn in range(2):
                out = client.chat.completions.create(model="tiny", max_tokens=3,
                                                     messages=[{"role": "user", "content": f"turn {turn}"}])
                generated += out.usage.completion_tokens
                prompt += out.usage.prompt_tokens
                calls += 1
            http.post(f"/episodes/{lease['episode_id']}/end", json={"client_id": "c", "task_id": "t", "reward": reward})
        # Read the rate right after the calls: a training step on a loaded machine may outlast the rate's window.
        rate = MonitorSnapshot.model_validate(http.get("/control/monitor").json())
        wait_version(http, 1)
        aborted = http.post("/episodes/begin", json={"client_id": "c"}).json()
        http.post(f"/episodes/{aborted['episode_id']}/abort", json={"client_id": "c"})

        m = scrape(http)
        tiny = (("model", "tiny"), ("policy", "default"))  # a server without policies: its one, "default"
        assert m["marl_leases_total", (("event", "begun"), *tiny)] == 3
        assert m["marl_leases_total", (("event", "ended"), *tiny)] == 2
        assert m["marl_leases_total", (("event", "aborted"), *tiny)] == 1
        assert m["marl_calls_total", tiny] == calls == 4
        assert m["marl_tokens_total", (("kind", "generated"), *tiny)] == generated
        assert m["marl_tokens_total", (("kind", "prompt"), *tiny)] == prompt
        assert m["marl_train_steps_total", tiny] == 1
        assert m["marl_policy_version", tiny] == 1
        assert m["marl_engine_state", (*tiny, ("state", "ROLLING"))] == 1
        assert m["marl_engine_state", (*tiny, ("state", "OFFLINE"))] == 0
        assert m["marl_pool_target_groups", tiny] == 1
        assert m["marl_last_step_reward_mean", tiny] == pytest.approx(0.5)

        snap = MonitorSnapshot.model_validate(http.get("/control/monitor").json())
        assert [s.step for s in snap.recent_steps] == [1] and snap.recent_steps[0].metrics["reward_mean"] == 0.5
        assert rate.tokens_per_s == pytest.approx(generated / rate.rate_window_s)
        assert http.get("/control/monitor", headers={"Authorization": "Bearer nope"}).status_code == 401


def screen_text(app) -> str:
    """The whole terminal screen as text (textual's own screenshot, tags stripped)."""
    svg = app.export_screenshot()
    return html.unescape(re.sub(r"<[^>]+>", "", svg)).replace("\xa0", " ")


async def wait_for(pilot, app, predicate, what: str, timeout: float = 30) -> str:
    """Let the app run until the screen satisfies `predicate` (server calls run in threads meanwhile)."""
    deadline = time.monotonic() + timeout
    while True:
        await pilot.pause(0.1)
        text = screen_text(app)
        if predicate(text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"the screen never showed {what}:\n{text}")


def test_overwatch_follows_a_server_through_its_states(local_server):
    with local_server() as srv, admin_http(srv.url) as http:
        asyncio.run(_drive_overwatch(srv, http))


async def _drive_overwatch(srv, http) -> None:
    real_factory = srv.server.lifecycle.trainer_factory
    release = threading.Event()

    def slow_trainer(model_path, config):  # hold the training step, before its first pass, until the screen shows it
        trainer = real_factory(model_path, config)
        accumulate = trainer.accumulate_gradients
        trainer.accumulate_gradients = lambda *args, **kwargs: (release.wait(30), accumulate(*args, **kwargs))[1]
        return trainer

    srv.server.lifecycle.trainer_factory = slow_trainer
    app = OverwatchApp([Source("tiny-server", srv.url, ADMIN), Source("ghost", "http://127.0.0.1:9", ADMIN)],
                       interval_s=0.2)
    async with app.run_test(size=(200, 50)) as pilot:
        # The server nobody runs shows UNREACHABLE; the other panel is unaffected.
        await wait_for(pilot, app, lambda t: "OFFLINE" in t and "UNREACHABLE" in t, "OFFLINE beside UNREACHABLE")

        start_rolling(http, batch_size=2, num_repeat=2, max_leases=4)
        play_episode(http, "a", 1.0)
        play_episode(http, "a", 0.0)
        play_episode(http, "b", 1.0)
        # Each condition is waited for whole: the screen may show an earlier refresh (2/4 episodes) first.
        await wait_for(pilot, app, lambda t: "ROLLING " in t and "1/2 groups" in t and "3/4 episodes" in t,
                       "ROLLING, 1/2 groups, 3/4 episodes")

        play_episode(http, "b", 0.0)  # the batch is complete: train (held) and sync
        training = re.compile(r"training ░+ 0/1 micro-batches · step 1 on 4 samples · \d+s")
        await wait_for(pilot, app, lambda t: "WEIGHT_SYNCING" in t and training.search(t), "WEIGHT_SYNCING, training")
        release.set()
        await wait_for(pilot, app, lambda t: "policy v1" in t and "ROLLING " in t and "0/2 groups" in t
                       and "0.500 ± 0.500" in t, "v1, ROLLING, pool emptied, the step's reward")

        await pilot.press("1")  # one server only
        await wait_for(pilot, app, lambda t: "tiny-server" in t and "ghost" not in t, "only tiny-server")
        await pilot.press("a")
        await wait_for(pilot, app, lambda t: "tiny-server" in t and "ghost" in t, "both servers again")


def test_overwatch_sees_a_restart_and_an_outage(local_server, tmp_path):
    data_dir = tmp_path / "server"
    view = None
    with local_server(data_dir=data_dir) as srv:
        view = ServerView(Source("s", srv.url, ADMIN))
        view.poll()
        first = view.snapshot.instance_id
        url = srv.url
    view.poll(timeout=0.5)  # the server is gone
    assert view.problem and view.unreachable_since is not None
    assert "UNREACHABLE" in _text(view.render())
    with local_server(data_dir=data_dir, port=int(url.rsplit(":", 1)[1])):  # back at the same address
        view.poll()
    assert view.problem is None and view.restarts == 1 and view.snapshot.instance_id != first
    assert "restarted" in _text(view.render())


def _text(renderable) -> str:
    console = Console(width=160, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


def test_sources_from_urls_and_topologies(tmp_path, monkeypatch):
    monkeypatch.setenv("MARL_ADMIN_TOKEN", "tok")
    assert resolve_sources(["http://a:1/", "http://b:2"]) == [Source("a:1", "http://a:1", "tok"),
                                                              Source("b:2", "http://b:2", "tok")]
    with pytest.raises(ValueError, match="neither a URL"):
        resolve_sources(["a:1"])
    topo = tmp_path / "t.yaml"
    run_dir = tmp_path / "run"
    topo.write_text(f"""
name: t
servers:
  mine: {{model: tiny, trainable: false}}
  theirs: {{swarm_url: "http://gpu:10086", trainable: true, train: {{job: j}}}}
roles:
  a: {{server: mine}}
  b: {{server: theirs}}
env: {{class: envs.signalling:SignallingGame}}
run: {{run_dir: {run_dir}, max_steps: 1}}
""")
    with pytest.raises(ValueError, match="start the run first"):
        resolve_sources([str(topo)])
    run_dir.mkdir()
    (run_dir / "servers.json").write_text(json.dumps({"mine": {"url": "http://127.0.0.1:5", "admin_token": "x"}}))
    assert resolve_sources([str(topo)]) == [Source("mine", "http://127.0.0.1:5", "x"),
                                            Source("theirs", "http://gpu:10086", "tok")]
    # a server of LoRA policies: one row per policy, each read with ?policy=
    lora = topo.read_text().replace('train: {job: j}}', 'train: {job: j}, policies: {s: {}, l: {}}}').replace(
        "b: {server: theirs}", "b: {server: theirs, policy: s}\n  c: {server: theirs, policy: l}")
    topo.write_text(lora)
    assert resolve_sources([str(topo)])[1:] == [Source("theirs.s", "http://gpu:10086", "tok", policy="s"),
                                                Source("theirs.l", "http://gpu:10086", "tok", policy="l")]
    assert sparkline([0, 1, 0.5]) == "▁█▅" and sparkline([2, 2]) == "▅▅"


# --- records and plots ---------------------------------------------------------------------------------------------


def test_plot_writes_pngs_from_a_run_directory(local_server, tmp_path):
    from PIL import Image

    run_dir = tmp_path / "run"
    with local_server(data_dir=run_dir / "servers" / "tiny") as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=1, num_repeat=2)
        for step in (1, 2):
            play_episode(http, f"t{step}", 0.0)
            play_episode(http, f"t{step}", 1.0)
            wait_version(http, step)
    with open(run_dir / "games.jsonl", "w") as f:  # as `marl run` writes them
        for version, reward in ((0, 0.0), (1, 0.5), (2, 1.0)):
            f.write(json.dumps({"policy_versions": {"tiny": version}, "role_rewards": {"a": reward}}) + "\n")
    written = plot_run(run_dir)
    assert sorted(p.relative_to(run_dir).as_posix() for p in written) == [
        "reward_curves.png", "servers/tiny/training.png"]
    for path in written:
        with Image.open(path) as image:
            image.verify()
            assert image.format == "PNG"
    with Image.open(run_dir / "servers" / "tiny" / "training.png") as image:
        assert image.size[0] > 3 * image.size[1] / 2  # reward, loss, entropy, grad norm side by side
    rows = [json.loads(line) for line in (run_dir / "servers" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["reward_mean"] == 0.5 for r in rows)


# --- the episode viewer ----------------------------------------------------------------------------------------------


def test_episode_viewer_shows_the_mask_boundaries_of_a_merged_sample(local_server, tmp_path, tiny_model):
    data_dir = tmp_path / "server"
    with local_server(data_dir=data_dir) as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=4, num_repeat=2)
        lease = http.post("/episodes/begin", json={"client_id": "c"}).json()
        client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"])
        messages = [{"role": "system", "content": "Be brief."}]
        replies = []
        for turn in range(3):  # one agent, 3 turns: one merged sample with 3 trained spans
            messages.append({"role": "user", "content": f"question {turn}"})
            out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, seed=turn,
                                                 extra_body={"return_token_ids": True})
            replies.append(out.choices[0])
            messages.append({"role": "assistant", "content": out.choices[0].message.content})
        co_players = {"answerer": {"server": "tiny", "policy_version": 0},  # as the coordinator records them
                      "rival": {"server": "past", "policy_version": 3, "snapshot_of": "tiny"}}
        http.post(f"/episodes/{lease['episode_id']}/end", json={"client_id": "c", "task_id": "t", "reward": 0.25,
                                                                "metadata": {"co_players": co_players}})
        sample = srv.server.ledger.samples_of(lease["episode_id"])[0]

    trained = [(a, b) for a, b, m in spans(sample.loss_mask) if m]
    assert len(trained) == 3  # one span per model turn
    for (start, end), choice in zip(trained, replies, strict=True):
        assert sample.token_ids[start:end] == choice.token_ids  # exactly the tokens the model generated

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    console = Console(record=True, width=400, file=open("/dev/null", "w"), color_system=None)  # noqa: SIM115
    show_episode(data_dir, lease["episode_id"][:10], console=console, tokens=True)
    out = console.export_text()
    assert f"{lease['episode_id']}" in out and "reward" in out and "3 spans" in out
    assert "played with: answerer=tiny v0, rival=past v3 (snapshot of tiny)" in out
    body = out.split("3 spans)\n", 1)[1]
    assert body.count(OPEN) == 3 and body.count(CLOSE) == 3
    shown = re.findall(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), body, flags=re.S)
    assert shown == [safe(tokenizer.decode(c.token_ids), newlines=True) for c in replies]  # controls escaped
    context = re.split(re.escape(OPEN) + r".*?" + re.escape(CLOSE), body, flags=re.S)
    assert "question 0" in context[0] and "question 1" in context[1] and "question 2" in context[2]
    # the token table: one row per token, the mask column as stored
    table_rows = [line.split() for line in out.splitlines() if re.match(r"^\s*\d+\s+[01]\s", line)]
    assert [int(r[1]) for r in table_rows] == sample.loss_mask

    listing = Console(record=True, width=300, file=open("/dev/null", "w"))  # noqa: SIM115
    list_episodes(data_dir, console=listing)
    listed = listing.export_text()
    assert lease["episode_id"] in listed and "reward 0.25" in listed and "3 calls" in listed and "in pool" in listed


def test_overwatch_once_prints_a_snapshot_and_bad_targets_exit_2(local_server):
    import os
    import subprocess
    import sys

    with local_server() as srv:
        env = {**os.environ, "MARL_ADMIN_TOKEN": ADMIN, "COLUMNS": "160"}
        out = subprocess.run([sys.executable, "-m", "marl.cli", "overwatch", srv.url, "--once"], env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "OFFLINE" in out.stdout and "policy v0" in out.stdout and srv.url in out.stdout
    bad = subprocess.run([sys.executable, "-m", "marl.cli", "overwatch", "localhost:1"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "neither a URL" in bad.stderr


def test_training_record_reads_back_its_tail_and_writes_tensorboard_when_installed(tmp_path):
    from servers.metrics.training_record import TrainingRecord

    record = TrainingRecord(tmp_path)
    record.append(1, {"reward_mean": 0.5, "loss": 0.1})
    record.append(2, {"reward_mean": 0.75, "loss": 0.05})
    record.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "ti')  # torn by a crash
    assert [(s.step, s.metrics["reward_mean"]) for s in TrainingRecord(tmp_path).recent] == [(1, 0.5), (2, 0.75)]
    pytest.importorskip("tensorboard")  # optional: event files only when it is installed
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("reward_mean")] == [(1, 0.5), (2, 0.75)]


def test_game_summaries_count_valid_replies_and_wins_per_role():
    from marl.watching.plot import percent, summarize_roles

    games = [
        {"role_rewards": {"wolf": 1, "seer": 0}, "replies": {"wolf": 4, "seer": 2}, "invalid_actions": {"wolf": 1},
         "winner": "wolves", "teams": {"wolf": "wolves", "seer": "village"}},
        {"role_rewards": {"wolf": 0, "seer": 1}, "replies": {"wolf": 4, "seer": 2}, "invalid_actions": {"seer": 2},
         "winner": "village", "teams": {"wolf": "wolves", "seer": "village"}},
        {"role_rewards": {"wolf": 0, "seer": 0}, "replies": {"wolf": 2}, "winner": "draw",
         "teams": {"wolf": "wolves", "seer": "village"}},
        {"role_rewards": {"wolf": 1, "seer": 0}},  # written before winners were recorded: not counted for wins
    ]
    stats = summarize_roles(games)
    assert stats["wolf"] == {"games": 4, "mean_reward": 0.5, "valid_reply_rate": 1 - 1 / 10, "win_rate": 1 / 3}
    assert stats["seer"]["valid_reply_rate"] == 0.5 and stats["seer"]["win_rate"] == 1 / 3
    no_winners = summarize_roles([{"role_rewards": {"speaker": 1.0}}])["speaker"]
    assert percent(no_winners["win_rate"]) == percent(no_winners["valid_reply_rate"]) == "-"
    assert percent(0.125) == "12%"
