"""Every script in bench/ runs in smoke mode (`--smoke`: the tiny model, tiny counts) without an error.

The scripts are found by globbing bench/*.py, so a new bench without `--smoke` fails here. Each runs as a
subprocess from the repository root, as a person would run it, and must exit 0 with no traceback, no failed
shutdown and no ERROR line in its output (stdout and stderr together: its servers log to them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(path.name for path in (ROOT / "bench").glob("*.py"))
# The smokes CI leaves to `make bench-smoke` (marked slow): each costs 12-60 CPU seconds on 2 cores, together about
# 420 of the 450 every smoke took (CI's timeline, issue 56), and what each drives is tested end to end elsewhere:
# fsdp_step.py (FSDP ranks: tests/servers/test_fsdp_*.py), exploitability_sweep.py and seed_sweep.py (loops around
# `marl run` and `marl eval`: tests/marl/test_run.py, test_eval.py, test_exploitability.py), scale.py (the simulated
# engine under load: tests/servers/test_simulated_engine.py), cpu_threads.py (marl's thread split:
# tests/marl/test_run.py), overlap.py (tests/servers/test_overlap.py, test_vllm_overlap.py), lora_memory.py and
# lora_werewolves.py (tests/servers/test_*lora*.py, tests/marl/test_run_policies.py), fuzz.py (a short schema fuzz
# run: tests/servers/test_untrusted_input.py), run_report.py (tests/marl/test_games_view.py), proxy_latency.py
# (tests/marl/test_proxy*.py), commit_timing.py (tests/marl/test_two_phase.py), load_episodes.py (many leases on
# one server: tests/servers/test_server_http.py), train_memory.py (tests/servers/test_plan_measured.py). CI still
# imports each of them (test_the_slow_benches_import).
SLOW = {"fsdp_step.py", "exploitability_sweep.py", "seed_sweep.py", "scale.py", "cpu_threads.py", "overlap.py",
        "lora_memory.py", "lora_werewolves.py", "fuzz.py", "run_report.py", "proxy_latency.py", "commit_timing.py",
        "load_episodes.py", "train_memory.py"}
# Most of a smoke run is imports and servers starting, so two at a time (the 2 cores CI has) halves the wall time.
WORKERS = 2
TIMEOUT_S = 240
BAD = ("Traceback", "Application shutdown failed", "ERROR")


def run_smoke(script: str) -> tuple[int, str, float]:
    """(exit code, output, seconds) of `python bench/<script> --smoke`; on timeout its whole process group is
    killed (the servers it started too) and the exit code is None."""
    start = time.monotonic()
    with subprocess.Popen([sys.executable, f"bench/{script}", "--smoke"], cwd=ROOT, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                          start_new_session=True) as process:
        try:
            output, _ = process.communicate(timeout=TIMEOUT_S)
            code = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            code = None
    return code, output, time.monotonic() - start


@pytest.fixture(scope="module")
def smoke_runs(request: pytest.FixtureRequest):
    """The smoke runs of the scripts this session selected, all started at once, WORKERS at a time; each test
    waits for its own."""
    selected = [item.callspec.params["script"] for item in request.session.items
                if item.path == Path(__file__) and item.originalname == "test_bench_smoke"]
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        runs: dict[str, Future] = {script: pool.submit(run_smoke, script) for script in selected}
        yield runs
        for run in runs.values():
            run.cancel()


def test_the_glob_finds_the_benches():
    assert {"code_shape.py", "proxy_overhead.py", "fsdp_step.py"} <= set(SCRIPTS) and SLOW <= set(SCRIPTS)


def test_the_slow_benches_import():
    """A bench whose smoke only `make bench-smoke` runs is still imported here (in one fresh interpreter, as a script
    runs it: its main() not called), so a name it imports that moved or went fails CI, not the next person."""
    load = ("import importlib.util, sys\n"
            "for path in sys.argv[1:]:\n"
            "    spec = importlib.util.spec_from_file_location('bench_' + path[6:-3], path)\n"
            "    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)\n"
            "    spec.loader.exec_module(module)\n"
            "    assert callable(module.main), path\n")
    done = subprocess.run([sys.executable, "-c", load, *(f"bench/{s}" for s in sorted(SLOW))], cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s for s in SCRIPTS])
def test_bench_smoke(script: str, smoke_runs: dict[str, Future]) -> None:
    code, output, seconds = smoke_runs[script].result()
    tail = output[-4000:]
    assert code is not None, f"bench/{script} --smoke ran over {TIMEOUT_S} s:\n{tail}"
    assert code == 0, f"bench/{script} --smoke exited {code} after {seconds:.0f} s:\n{tail}"
    for bad in BAD:
        assert bad not in output, f"bench/{script} --smoke printed {bad!r}:\n{tail}"
