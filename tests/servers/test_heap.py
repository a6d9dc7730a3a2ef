"""The garbage collector of a server process (`servers.heap`): `marl serve` freezes what its boot left alive, so a
full collection no longer walks torch's and transformers' objects with the event loop held, and it collects as a
server should (`SERVING_THRESHOLDS`); a server built inside another process (a test, a notebook) leaves that
process's collector alone."""

from __future__ import annotations

import gc
import re

from conftest import ADMIN, admin_http, start_rolling, wait_state

from marl.runner.launch import ServerProcess
from servers.heap import SERVING_THRESHOLDS


def test_marl_serve_freezes_the_objects_its_boot_left_alive(tiny_model, tmp_path):
    proc = ServerProcess(model=str(tiny_model), admin_token=ADMIN, data_dir=tmp_path / "data", static=True,
                         device="cpu", served_name="tiny", log_path=tmp_path / "server.log")
    proc.args[proc.args.index("--log-level") + 1] = "info"  # the freeze is logged at info
    proc.start()
    try:
        proc.wait_healthy(timeout=60)
        with admin_http(proc.url) as http:
            wait_state(http, "STATIC")  # the freeze is logged before the state moves
    finally:
        proc.kill()
    log = proc.log_path.read_text()
    frozen = re.search(r"froze (\d+) boot-time objects", log)
    assert frozen, log[-2000:]
    assert int(frozen.group(1)) > 50_000  # torch, transformers, the tokenizer: a full collection skips them now
    assert f"collector thresholds {SERVING_THRESHOLDS}" in log  # full collections rare: calls in flight are not walked


def test_a_server_in_another_process_leaves_its_collector_alone(local_server):
    before, thresholds = gc.get_freeze_count(), gc.get_threshold()
    with local_server() as srv, admin_http(srv.url) as http:
        start_rolling(http, batch_size=2, num_repeat=2, save_freq=0)
        assert http.post("/episodes/begin", json={"client_id": "c"}).status_code == 200
    assert gc.get_freeze_count() == before
    assert gc.get_threshold() == thresholds
