"""What clients sent never reaches the operator's terminal raw (`marl episode`, `marl overwatch`, `marl games`), and
`marl overwatch TOPOLOGY key=value` honours the overrides `marl run` was given."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import openai
import pytest
from rich.console import Console

from marl.cli import parse
from marl.protocol import ErrorEvent
from marl.watching.overwatch import OverwatchError, ServerView, Source, resolve_sources
from marl.watching.terminal import safe
from servers.episodes.view import safe as server_safe
from tests.conftest import ADMIN, admin_http, start_rolling, wait_version

PWNED = "\x1b]0;pwned\x07\x1b[2J"  # sets the window title, then clears the screen
SHOWN = "\\x1b]0;pwned\\x07\\x1b[2J"


def test_safe_escapes_every_control_character_and_keeps_text():
    assert safe(f"tag{PWNED}") == f"tag{SHOWN}"
    assert safe("a\rb\x9bc\u202ed\x7f") == "a\\x0db\\x9bc\\u202ed\\x7f"  # CR, a C1 CSI, a bidi override, DEL
    assert safe("line 1\nline 2\tend") == "line 1\\x0aline 2\tend"  # one-line fields: a newline cannot forge a line
    assert safe("line 1\nline 2", newlines=True) == "line 1\nline 2"
    assert safe("Grüße, 名前 [bold]") == "Grüße, 名前 [bold]"
    sample = "".join(map(chr, range(0x2100))) + PWNED
    assert server_safe(sample) == safe(sample) and server_safe(sample, newlines=True) == safe(sample, newlines=True)


def marl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marl", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "300", "MARL_ADMIN_TOKEN": ADMIN})


def assert_escaped(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout, result.stdout
    assert SHOWN in result.stdout, result.stdout


def tagged_episode(http, reward: float, client_id: str = "c") -> str:
    """One episode whose agent tag, task id and metadata carry escape sequences; returns its id."""
    lease = http.post("/episodes/begin", json={"client_id": client_id}).json()
    client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"])
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"hi {PWNED}"}],
                                   max_tokens=3, user=f"agent{PWNED}")
    r = http.post(f"/episodes/{lease['episode_id']}/end",
                  json={"client_id": client_id, "task_id": f"task{PWNED}", "reward": reward,
                        "metadata": {"co_players": {f"role{PWNED}": {"server": f"s{PWNED}"}}}})
    assert r.status_code == 200, r.text
    return lease["episode_id"]


def test_episode_list_show_and_overwatch_escape_what_lease_holders_sent(local_server, tmp_path):
    data_dir = tmp_path / "server"
    with local_server(data_dir=data_dir) as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=1, num_repeat=2)
        for reward in (0.0, 1.0):  # one group: a training step, so the agent tag shows in the reward table
            episode = tagged_episode(http, reward)
        wait_version(http, 1)
        http.post("/episodes/begin", json={"client_id": f"holder{PWNED}"})  # a lease left running
        watched = marl("overwatch", srv.url, "--once")
        view = ServerView(Source("s", srv.url, ADMIN))
        view.poll()
        view.close()
    assert_escaped(watched)
    assert f"agent{SHOWN}" in watched.stdout and f"holder{SHOWN}"[:16] in watched.stdout

    view.snapshot = view.snapshot.model_copy(update={"errors": [ErrorEvent(time=0.0, message=f"bad {PWNED}")]})
    console = Console(file=io.StringIO(), width=300)
    console.print(view.render())
    assert "\x1b" not in console.file.getvalue() and f"bad {SHOWN}" in console.file.getvalue()

    listed = marl("episode", "list", str(data_dir))
    assert_escaped(listed)
    assert f"task task{SHOWN}  reward 1" in listed.stdout
    shown = marl("episode", "show", str(data_dir), episode)
    assert_escaped(shown)
    assert f"agent agent{SHOWN}" in shown.stdout and f"role{SHOWN}=s{SHOWN}" in shown.stdout
    assert f"hi {SHOWN}" in shown.stdout  # the call's own text, decoded from the sample's tokens


# --- marl overwatch TOPOLOGY key=value ------------------------------------------------------------------------------


def test_overwatch_takes_the_overrides_marl_run_was_given(tmp_path):
    topology = tmp_path / "t.yaml"
    topology.write_text(f"""
name: t
servers:
  mine: {{model: tiny, trainable: false}}
roles:
  a: {{server: mine}}
  b: {{scripted: true}}
env: {{class: envs.signalling:SignallingGame}}
run: {{run_dir: {tmp_path / "default"}, games: 1}}
""")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "servers.json").write_text(json.dumps({"mine": {"url": "http://127.0.0.1:5", "admin_token": "x"}}))
    with pytest.raises(OverwatchError, match="default/servers.json"):
        resolve_sources([str(topology)])
    override = f"run.run_dir={elsewhere}"
    assert resolve_sources([str(topology), override]) == [Source("mine", "http://127.0.0.1:5", "x")]
    with pytest.raises(OverwatchError, match="give key=value overrides only"):
        resolve_sources([str(topology), "http://other:1"])
    args = parse(["overwatch", str(topology), "--once", override])  # key=value may follow options, as for run
    assert args.targets == [str(topology), override] and args.once
