"""Fuzz a real `marl serve` (tiny model, CPU) from its own OpenAPI schema: every operation, valid credentials, no 5xx.

    python bench/fuzz.py                  # 40 positive + 40 negative examples per operation (make fuzz)
    python bench/fuzz.py --examples 10    # shorter
    python bench/fuzz.py --smoke          # seconds: 2 examples per operation and mode (does it run?)

Starts one trainable server on a tiny random model, syncs a small config and starts its engine, then for every
operation of `/openapi.json` draws requests with schemathesis (valid ones, and deliberately invalid ones) and sends
them with the admin token; the chat completion gets the key of a live lease, and half of the episode requests
target a live episode instead of a random id. Before each request the engine is brought back to ROLLING if a fuzzed
request stopped or reconfigured it. Counts requests, responses by status class, 5xx (the acceptance: none), and
the failures of schemathesis' conformance checks (status codes and content types the schema documents, response
bodies matching their schema). Exit code 1 if any 5xx was seen.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ADMIN = "fuzz-admin-token"
CONFIG = {"batch_size": 2, "num_repeat": 2, "max_leases": 256, "lease_patience_s": 30, "save_freq": 0}


class Target:
    """The server under test, and the live episode the next request may use."""

    def __init__(self, url: str, admin_token: str = ADMIN):
        self.url = url
        self.admin_token = admin_token
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=120)

    def rolling(self) -> None:
        """Bring the engine back to ROLLING (a fuzzed request may have stopped it or changed its config)."""
        for _ in range(600):
            state = self.http.get("/control/status").json()["state"]
            if state == "ROLLING":
                return
            if state == "OFFLINE":
                self.http.post("/control/config", json=CONFIG)
                self.http.post("/control/start")
            time.sleep(0.1)
        raise RuntimeError("the engine did not come back to ROLLING")

    def lease(self) -> dict:
        """A fresh live lease; if none is granted (a fuzzed config left no slot), the engine is reset first."""
        for _ in range(3):
            self.rolling()
            r = self.http.post("/episodes/begin", json={"client_id": "fuzz"})
            if r.status_code == 200:
                return r.json()
            self.http.post("/control/stop")
        raise RuntimeError(f"no lease: {r.text}")

    def release(self, lease: dict) -> None:
        """Abort the lease if the fuzzed request left it running (so leases never pile up)."""
        self.http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "fuzz"})


def fuzz(target: Target, examples: int, seed: int = 0) -> dict:
    """Every operation, `examples` valid and `examples` invalid requests each; the counts."""
    import hypothesis
    import hypothesis.errors
    import schemathesis
    from hypothesis import strategies as st
    from schemathesis import GenerationMode
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    schema = schemathesis.openapi.from_url(target.url + "/openapi.json")
    totals: collections.Counter = collections.Counter()
    failures: collections.Counter = collections.Counter()
    server_errors: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = st.tuples(operation.as_strategy(generation_mode=mode), st.booleans())

            @hypothesis.settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                                 suppress_health_check=list(hypothesis.HealthCheck),
                                 phases=[hypothesis.Phase.generate])
            @hypothesis.seed(seed)
            @hypothesis.given(strategy)
            def one(drawn) -> None:
                case, live = drawn
                send(target, case, live, checks, totals, failures, server_errors)

            try:
                one()
            except hypothesis.errors.Unsatisfiable:  # nothing to make invalid (no parameters, no body)
                pass
        print(f"{operation.method.upper():6} {operation.path:40} done ({sum(totals.values())} requests so far)",
              file=sys.stderr, flush=True)
    return {"operations": len(operations), "requests": sum(totals.values()), "by_status": dict(totals),
            "server_errors": len(server_errors), "server_error_samples": server_errors[:10],
            "check_failures": dict(failures)}


def send(target: Target, case, live: bool, checks, totals, failures, server_errors) -> None:
    from schemathesis.checks import FailureGroup

    headers = {"Authorization": f"Bearer {target.admin_token}"}
    lease = None
    if "episode_id" in (case.path_parameters or {}) or case.path.startswith("/v1/chat"):
        lease = target.lease()
        if case.path.startswith("/v1/chat"):
            headers["Authorization"] = f"Bearer {lease['api_key']}"
        elif live:
            case.path_parameters["episode_id"] = lease["episode_id"]
    if case.path.startswith("/control/") and case.method.upper() == "POST":
        target.rolling()
    response = case.call(base_url=target.url, headers=headers, timeout=120)
    if lease is not None:
        target.release(lease)
    totals[f"{response.status_code // 100}xx"] += 1
    if response.status_code >= 500:
        server_errors.append(f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}")
    for check in checks:
        try:
            case.validate_response(response, checks=[check], headers=headers)
        except FailureGroup as group:  # a failed check is counted (with its first reason), not raised
            failures[f"{check.__name__}: {type(group.exceptions[0]).__name__}"] += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=40, help="examples per operation and generation mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a few seconds: does the bench run?")
    args = parser.parse_args()
    if args.smoke:
        args.examples = 2
    from marl.launch import ServerProcess
    from servers.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="marl-fuzz-") as scratch:
        root = Path(scratch)
        model = build_tiny_model(root / "tiny")
        proc = ServerProcess(model=str(model), admin_token=ADMIN, data_dir=root / "server", device="cpu",
                             served_name="tiny", log_path=root / "server.log").start()
        try:
            proc.wait_healthy(timeout=120)
            target = Target(proc.url)
            target.rolling()
            started = time.monotonic()
            report = fuzz(target, args.examples, args.seed)
            report["seconds"] = round(time.monotonic() - started, 1)
            rss = _rss_mb(proc)
        finally:
            proc.kill()
        report["server_rss_mb_at_end"] = rss
        print(json.dumps(report, indent=2))
    return 1 if report["server_errors"] else 0


def _rss_mb(proc) -> float | None:
    try:
        for line in Path(f"/proc/{proc.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


if __name__ == "__main__":
    sys.exit(main())
