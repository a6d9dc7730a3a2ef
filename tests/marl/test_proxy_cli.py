"""`marl proxy` as a process: it serves a real tiny-model swarm server, and a clean shutdown exits 0 (SIGTERM) or 130
(Ctrl-C), never by the signal (-15)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from conftest import ADMIN, LocalServer, admin_http, start_rolling

from marl.runner.launch import free_port

APP_KEY = "proxy-cli-test-key"


@pytest.fixture(scope="module")
def swarm(tiny_model, tmp_path_factory):
    with LocalServer(tiny_model, tmp_path_factory.mktemp("swarm")) as server, admin_http(server.url) as http:
        start_rolling(http, batch_size=1000, num_repeat=2, save_freq=0)
        yield server


def start_proxy(swarm_url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "marl.cli", "proxy", "--server", swarm_url, "--reward", "rule", "--reward-option",
         "max_words=3", "--port", str(port), "--conversation-idle-s", "0", "--log-level", "warning"],
        env={**os.environ, "MARL_ADMIN_TOKEN": ADMIN, "MARL_PROXY_API_KEY": APP_KEY},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_as_in_a_terminal)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"marl proxy did not serve (exit {proc.returncode}):\n{out}\n{err}")
        time.sleep(0.1)


def _ctrl_c_as_in_a_terminal() -> None:
    """SIGINT as a terminal delivers it: a test runner started in the background (`cmd &` in a script) ignores
    SIGINT, its children inherit that, and Python then never turns Ctrl-C into KeyboardInterrupt (exit 0, not 130)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_marl_proxy_exits_cleanly_on_sigterm_and_ctrl_c(swarm, signum, code):
    proc, url = start_proxy(swarm.url)
    try:
        app = openai.OpenAI(base_url=url + "/v1", api_key=APP_KEY, max_retries=0)
        reply = app.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.choices[0].message.content is not None  # it served a real request first
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, f"exit {proc.returncode}\n{out}\n{err}"
    assert "Traceback" not in err, err
