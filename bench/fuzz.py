"""Fuzz a real `marl serve` (tiny model, CPU) from its own OpenAPI schema: every operation, valid credentials, no 5xx.

    python bench/fuzz.py                  # 40 positive + 40 negative examples per operation (make fuzz)
    python bench/fuzz.py --examples 10    # shorter
    python bench/fuzz.py --smoke          # seconds: 2 examples per operation and mode (does it run?)
    python bench/fuzz.py --paths /v1/     # only the data plane's operations (and the hostile stage)

Starts one trainable server on a tiny random model, syncs a small config and starts its engine, then for every
operation of `/openapi.json` draws requests with schemathesis (valid ones, and deliberately invalid ones) and sends
them with the admin token; the data plane's APIs (chat completions, Responses, Messages, completions) get the key
of a live lease, and half of their requests name the served model (the rest are refused at the model name), and
half of the episode requests target a live episode instead of a random id. Before each request the engine is brought
back to ROLLING if a fuzzed request stopped or reconfigured it. Counts requests, responses by status class, 5xx
(the acceptance: none), and the failures of schemathesis' conformance checks (status codes and content types the
schema documents, response bodies matching their schema).

Then (`hostile`) a second server, of two LoRA policies, gets what no schema describes: bodies nested up to 200,000
deep or holding millions of scalars on every POST route, and frozen-policy loads of adapters broken in every way
hypothesis draws (configs, weights bytes, non-finite or int tensors, FIFOs, over-long names); the slowest /health
answer meanwhile is reported. Exit code 1 if any 5xx was seen.
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


def fuzz(target: Target, examples: int, seed: int = 0, paths: str = "/") -> dict:
    """Every operation (whose path starts with `paths`), `examples` valid and `examples` invalid requests each; the
    counts."""
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
    operations = [op for op in (result.ok() for result in schema.get_all_operations()) if op.path.startswith(paths)]
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

    from marl.protocol import DATA_PLANE_CALL_ROUTES

    headers = {"Authorization": f"Bearer {target.admin_token}"}
    lease = None
    data_plane = case.path in DATA_PLANE_CALL_ROUTES  # fuzzed under a live lease's key
    if "episode_id" in (case.path_parameters or {}) or data_plane:
        lease = target.lease()
        if data_plane:  # the lease's key, as OpenAI's SDKs and Anthropic's (x-api-key) send it
            headers = {"Authorization": f"Bearer {lease['api_key']}", "x-api-key": lease["api_key"]}
            if live and isinstance(case.body, dict):
                case.body["model"] = lease["model"]  # past the model check, into the translation and the engine
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


POLICIES = ("a", "b")


def hostile(url: str, examples: int, scratch: Path, seed: int = 0) -> dict:
    """Deep and scalar-heavy bodies on every POST route, and broken adapters, on a server of `POLICIES`."""
    import hypothesis
    from hypothesis import strategies as st

    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120)
    totals: collections.Counter = collections.Counter()
    server_errors: list[str] = []

    def record(what: str, r: httpx.Response) -> None:
        totals[f"{r.status_code // 100}xx"] += 1
        if r.status_code >= 500:
            server_errors.append(f"{what} -> {r.status_code}: {r.text[:300]}")

    settings = hypothesis.settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                                   suppress_health_check=list(hypothesis.HealthCheck),
                                   phases=[hypothesis.Phase.generate])

    @settings
    @hypothesis.seed(seed)
    @hypothesis.given(route=st.sampled_from(_BODY_ROUTES), raw=_hostile_values())
    def bodies(route: str, raw: str) -> None:
        lease = http.post("/episodes/begin", json={"client_id": "fuzz", "policy": "a"}).json()
        path = route.format(episode_id=lease["episode_id"])
        fields = {"model": lease["model"], "client_id": "fuzz", "task_id": "t", "reward": 0.0, "max_tokens": 2,
                  "messages": [{"role": "user", "content": "hi"}]}
        body = json.dumps(fields)[:-1] + f', "{_FIELD[route]}": {raw}}}'
        key = lease["api_key"] if path.startswith("/v1/") else ADMIN
        r = httpx.post(url + path, content=body.encode(), timeout=120, headers={
            "Authorization": f"Bearer {key}", "x-api-key": key, "Content-Type": "application/json"})
        record(f"POST {route} ({len(body)} bytes)", r)
        http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "fuzz"})

    @settings
    @hypothesis.seed(seed)
    @hypothesis.given(broken=_broken_adapters())
    def adapters(broken) -> None:
        directory = scratch / f"adapter-{sum(totals.values())}"
        path = broken(directory)
        r = http.post("/control/frozen", json={"name": "a@1", "adapter": str(path)})
        record("POST /control/frozen", r)
        if r.status_code == 200:
            http.delete("/control/frozen/a@1")

    with HealthWatch(url) as health:
        bodies()
        adapters()
    return {"requests": sum(totals.values()), "by_status": dict(totals), "server_errors": len(server_errors),
            "server_error_samples": server_errors[:10], "slowest_health_s": round(health.slowest, 3)}


class HealthWatch:
    """Polls /health from a process of its own while the block runs; `slowest` is its slowest answer (seconds). Not a
    thread of this process: building a 16 MiB hostile body holds this process's GIL, which a thread's timing would
    count as the server's."""

    def __init__(self, url: str) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.slowest = 0.0
        self._done, self._answer = context.Event(), context.Queue()
        self._process = context.Process(target=_watch_health, args=(url, self._done, self._answer), daemon=True)

    def __enter__(self) -> HealthWatch:
        self._process.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self.slowest = self._answer.get(timeout=60)
        self._process.join(10)


def _watch_health(url: str, done, answer) -> None:
    slowest = 0.0
    with httpx.Client(timeout=30) as http:
        while not done.is_set():
            started = time.monotonic()
            http.get(url + "/health")
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.02)
    answer.put(slowest)


#: Every POST route with a JSON body, and the field a hostile value goes into.
_FIELD = {"/v1/chat/completions": "tool_choice", "/v1/responses": "input", "/v1/messages": "metadata",
          "/v1/completions": "prompt", "/episodes/{episode_id}/end": "metadata", "/control/config": "extra",
          "/episodes/{episode_id}/prepare": "metadata", "/episodes/begin": "extra", "/control/frozen": "adapter"}
_BODY_ROUTES = tuple(_FIELD)


def _hostile_values():
    """Raw JSON values: nested 65 to 200,000 deep (closed or not), or 30,000 to 4 million scalars."""
    from hypothesis import strategies as st

    deep = st.builds(lambda n, closed: "[" * n + ("]" * n if closed else ""), st.integers(65, 200_000), st.booleans())
    many = st.builds(lambda n, item: "[" + ",".join([item] * n) + "]", st.integers(30_000, 4_000_000),
                     st.sampled_from(["1", '"a"', "null", "{}", "1e308", "-0.5"]))
    keys = st.builds(lambda n: json.dumps({str(i): 1 for i in range(n)}), st.integers(30_000, 1_000_000))
    return st.one_of(deep, many, keys)


def _broken_adapters():
    """Functions that write an adapter directory broken one way and return the path to load."""
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8))
    config = st.one_of(
        st.dictionaries(st.sampled_from(["r", "lora_alpha", "target_modules", "lora_dropout"]),
                        st.one_of(scalars, st.lists(st.one_of(scalars, st.just("q_proj")), max_size=3))),
        st.sampled_from(["[]", "{", "", "[" * 100_000, '"x"']))
    weights = st.one_of(st.binary(max_size=64), st.builds(lambda n, rest: n.to_bytes(8, "little") + rest,
                                                          st.integers(0, 2**64 - 1), st.binary(max_size=32)))
    fill = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, 0.0])
    return st.one_of(st.builds(_with_config, config), st.builds(_with_weights, weights),
                     st.builds(_with_fill, fill), st.sampled_from([_fifo, _int_tensors, _long_name, _missing]))


def _with_config(config):
    def write(directory: Path) -> Path:
        _with_fill(0.0)(directory)
        text = config if isinstance(config, str) else json.dumps(config)
        (directory / "adapter_config.json").write_text(text)
        return directory
    return write


def _with_weights(data: bytes):
    def write(directory: Path) -> Path:
        _with_fill(0.0)(directory)
        (directory / "adapter_model.safetensors").write_bytes(data)
        return directory
    return write


def _with_fill(value: float):
    """A rank-2 adapter of the tiny model's first q_proj, filled with `value`."""
    def write(directory: Path) -> Path:
        import torch
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        module = "base_model.model.model.layers.0.self_attn.q_proj"
        save_file({f"{module}.lora_A.weight": torch.full((2, 64), value),
                   f"{module}.lora_B.weight": torch.full((64, 2), value)}, directory / "adapter_model.safetensors")
        (directory / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4,
                                                                   "target_modules": ["q_proj"]}))
        return directory
    return write


def _fifo(directory: Path) -> Path:
    import os

    _with_fill(0.0)(directory)
    (directory / "adapter_model.safetensors").unlink()
    os.mkfifo(directory / "adapter_model.safetensors")
    return directory


def _int_tensors(directory: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    _with_fill(0.0)(directory)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 64, dtype=torch.int64)},
              directory / "adapter_model.safetensors")
    return directory


def _long_name(directory: Path) -> Path:
    return directory / ("x" * 300)


def _missing(directory: Path) -> Path:
    return directory / "nowhere"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=40, help="examples per operation and generation mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a few seconds: does the bench run?")
    parser.add_argument("--hostile-only", action="store_true", help="only the hostile stage (adapters, bodies)")
    parser.add_argument("--paths", default="/", help="fuzz only the operations whose path starts with this")
    args = parser.parse_args()
    if args.smoke:
        args.examples = 2
    from marl.runner.launch import ServerProcess
    from tests.tiny_model import build_tiny_model

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
            report = {} if args.hostile_only else fuzz(target, args.examples, args.seed, args.paths)
            report["seconds"] = round(time.monotonic() - started, 1)
            report["server_rss_mb_at_end"] = _rss_mb(proc)
        finally:
            proc.kill()
        report["hostile"] = _run_hostile(model, root, args)
        print(json.dumps(report, indent=2))
    return 1 if report.get("server_errors") or report["hostile"]["server_errors"] else 0


def _run_hostile(model: Path, root: Path, args) -> dict:
    from marl.protocol import LoraSpec
    from marl.runner.launch import ServerProcess

    proc = ServerProcess(model=str(model), admin_token=ADMIN, data_dir=root / "policies", device="cpu",
                         served_name="tiny", log_path=root / "policies.log",
                         policies={name: LoraSpec(rank=2, alpha=4) for name in POLICIES}).start()
    try:
        proc.wait_healthy(timeout=120)
        http = httpx.Client(base_url=proc.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120)
        for name in POLICIES:
            http.post("/control/config", params={"policy": name}, json={**CONFIG, "batch_size": 1000})
        http.post("/control/start")
        while any(http.get("/control/status", params={"policy": n}).json()["state"] != "ROLLING" for n in POLICIES):
            time.sleep(0.2)
        started = time.monotonic()
        report = hostile(proc.url, args.examples, root / "adapters", args.seed)
        report["seconds"] = round(time.monotonic() - started, 1)
        return report
    finally:
        proc.kill()


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
