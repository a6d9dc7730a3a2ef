"""One bad adapter never reaches anyone else (issue 43): the multi-LoRA layer selects each row's adapter (a NaN or a
1e30 in one adapter leaves every other row as it was), an adapter with non-finite or non-float weights is refused at
load, every malformed adapter directory is a 400 naming the file, a file that blocks fails its own load only, and a
call whose logprobs are not finite is never recorded as a sample."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from marl.protocol import LoraSpec
from servers.engines.multi_lora import MultiLora, PreparedAdapter
from servers.policies import adapter_files
from tests.conftest import LocalServer, admin_http
from tests.servers.test_multi_lora_engine import SPECS, model_dir, peft_models  # noqa: F401 - fixtures
from tests.servers.test_policy_server import POLICIES, start_policies
from tests.servers.test_untrusted_input import slowest_health_while

pytestmark = [pytest.mark.serial, pytest.mark.timeout(300)]

SPEC = LoraSpec(rank=4, alpha=8)


# --- the layer: rows are selected, never masked --------------------------------------------------------------------


def _poisoned(lora: MultiLora, name: str, value: float) -> PreparedAdapter:
    """An adapter of every layer `lora` adapts, filled with `value`, installed as it is (past `prepare`'s checks)."""
    layers = {module: (slots.a[0].clone().fill_(value), slots.b[0].clone().fill_(value))
              for module, slots in lora._slots.items()}  # fmt: skip
    return PreparedAdapter(name, lora._rank, layers)


@pytest.mark.parametrize("value", [float("nan"), 1e30])
def test_a_poisoned_adapter_leaves_every_other_row_of_a_mixed_batch_unchanged(model_dir, peft_models,  # noqa: F811
                                                                               value) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.randint(3, 200, (4, 9), generator=torch.Generator().manual_seed(0))
    lora = MultiLora(model)
    for name in ("alice", "carol"):
        lora.load(name, get_peft_model_state_dict(peft_models[name]), SPECS[name])
    with torch.no_grad():
        with lora.rows(["alice", None, "carol", None]):
            before = model(ids).logits
        lora.install(_poisoned(lora, "mallory", value))
        with lora.rows(["alice", None, "carol", "mallory"]):
            after = model(ids).logits
    assert torch.isfinite(after[:3]).all()
    assert torch.equal(after[:3], before[:3])  # the same rows, the same adapters: bit for bit
    assert not torch.equal(after[3], before[3])  # the poisoned row itself is what changed


def test_non_finite_and_non_float_weights_are_refused_at_prepare(model_dir, peft_models) -> None:  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    lora = MultiLora(model)
    good = get_peft_model_state_dict(peft_models["alice"])
    key = next(iter(good))
    for bad, match in [(good[key].clone().fill_(float("nan")), "non-finite"),
                       (good[key].clone().fill_(float("inf")), "non-finite"),
                       (good[key].to(torch.int64), "not floating point")]:
        with pytest.raises(ValueError, match=match) as refused:
            lora.prepare("eve", {**good, key: bad}, SPECS["alice"])
        assert key.rsplit(".", 2)[0] in str(refused.value)  # names the tensor
    half = MultiLora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float16))
    with pytest.raises(ValueError, match="non-finite"):  # finite in float32, inf in the model's float16
        half.prepare("eve", {**good, key: good[key].clone().fill_(1e30)}, SPECS["alice"])


# --- the load route: a server of two live policies ----------------------------------------------------------------


@pytest.fixture(scope="module")
def policies(tiny_model, tmp_path_factory):
    data = tmp_path_factory.mktemp("hostile-adapters")
    with LocalServer(tiny_model, data / "server", policies=POLICIES) as srv, admin_http(srv.url) as http:
        start_policies(http, batch_size=1000, save_freq=0)
        yield srv, http


def write_adapter(directory: Path, srv: LocalServer, fill: float | None = None, seed: int = 0) -> Path:
    """A PEFT adapter of every targeted layer of the server's model: small random weights, or all `fill`."""
    lora = srv.server.frozen._engine.current.lora
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, linear in lora._linears.items():
        if module.rsplit(".", 1)[-1] in SPEC.target_modules:
            for part, shape in (("A", (SPEC.rank, linear.in_features)), ("B", (linear.out_features, SPEC.rank))):
                weight = torch.randn(shape, generator=generator) * 0.3 if fill is None else torch.full(shape, fill)
                tensors[f"base_model.model.{module}.lora_{part}.weight"] = weight
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / adapter_files.ADAPTER_WEIGHTS)
    config = {"r": SPEC.rank, "lora_alpha": SPEC.alpha, "target_modules": list(SPEC.target_modules)}
    (directory / adapter_files.ADAPTER_CONFIG).write_text(json.dumps(config))
    return directory


def greedy_ids_and_logprobs(http: httpx.Client, policy: str) -> tuple[list[int], list[float]]:
    lease = http.post("/episodes/begin", json={"client_id": "c", "policy": policy}).json()
    try:
        r = httpx.post(lease["base_url"] + "/chat/completions", timeout=60, headers={
            "Authorization": f"Bearer {lease['api_key']}"}, json={
            "model": lease["model"], "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]
    finally:
        http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "c"})


def load(http: httpx.Client, name: str, adapter: str | Path) -> httpx.Response:
    return http.post("/control/frozen", json={"name": name, "adapter": str(adapter)})


def refused_naming(r: httpx.Response, *words: str) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", "adapter"), error
    for word in words:
        assert word in error["message"], error["message"]
    return error["message"]


def test_a_nan_adapter_is_refused_and_the_live_policies_answer_bit_identically(policies, tmp_path) -> None:
    srv, http = policies
    before = {policy: greedy_ids_and_logprobs(http, policy) for policy in POLICIES}
    refused_naming(load(http, "speaker@1", write_adapter(tmp_path / "nan", srv, fill=float("nan"))),
                   adapter_files.ADAPTER_WEIGHTS, "lora_", "non-finite")
    huge = load(http, "speaker@2", write_adapter(tmp_path / "huge", srv, fill=1e30))  # finite: served, to itself
    assert huge.status_code == 200, huge.text
    try:
        assert {policy: greedy_ids_and_logprobs(http, policy) for policy in POLICIES} == before
    finally:
        http.delete("/control/frozen/speaker@2")


def _malformed(root: Path, srv: LocalServer) -> dict[str, tuple[Path, str]]:
    """Adapter directories broken in one way each, and the file their refusal must name."""
    cases: dict[str, tuple[Path, str]] = {}
    config, weights = adapter_files.ADAPTER_CONFIG, adapter_files.ADAPTER_WEIGHTS
    configs = {"empty object": "{}", "a list": "[]", "no alpha": json.dumps({"r": 4, "target_modules": ["q_proj"]}),
               "targets a number": json.dumps({"r": 4, "lora_alpha": 8, "target_modules": 5}),
               "rank a string": json.dumps({"r": "4", "lora_alpha": 8, "target_modules": ["q_proj"]}),
               "deep": "[" * 100_000, "not json": "{r: 4"}
    for name, text in configs.items():
        directory = write_adapter(root / name.replace(" ", "-"), srv)
        (directory / config).write_text(text)
        cases[f"config: {name}"] = (directory, config)
    header = (10**9).to_bytes(8, "little")
    for name, data in {"garbage": os.urandom(64), "empty": b"", "oversized header": header + b"{}"}.items():
        directory = write_adapter(root / name.replace(" ", "-"), srv)
        (directory / weights).write_bytes(data)
        cases[f"weights: {name}"] = (directory, weights)
    ints = write_adapter(root / "ints", srv)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 4, dtype=torch.int64)},
              ints / weights)
    cases["weights: int64"] = (ints, "int64")
    cases["no directory"] = (root / "nowhere", config)
    cases["a name past the filesystem's limit"] = (root / ("x" * 300), "File name too long")
    (root / "dir-as-file").mkdir()
    (root / "dir-as-file" / config).mkdir()
    cases["config is a directory"] = (root / "dir-as-file", "not a regular file")
    return cases


def test_every_malformed_adapter_is_a_400_naming_the_file(policies, tmp_path) -> None:
    srv, http = policies
    for case, (directory, named) in _malformed(tmp_path, srv).items():
        message = refused_naming(load(http, "speaker@7", directory), named)
        assert len(message) < 1000, (case, message)
    assert "speaker@7" not in srv.server.frozen._engine.current.lora.names
    assert http.get("/control/frozen").json()["data"] == []


def test_a_fifo_fails_its_own_load_at_once_and_a_stuck_read_times_out_alone(policies, tmp_path, monkeypatch) -> None:
    srv, http = policies
    fifo = write_adapter(tmp_path / "fifo", srv)
    (fifo / adapter_files.ADAPTER_WEIGHTS).unlink()
    os.mkfifo(fifo / adapter_files.ADAPTER_WEIGHTS)  # no writer ever comes: a plain open would wait forever
    answer, slowest = slowest_health_while(srv, lambda: load(http, "speaker@3", fifo))
    refused_naming(answer, adapter_files.ADAPTER_WEIGHTS, "not a regular file")
    assert slowest < 0.5

    release = threading.Event()  # a read that blocks (a stuck network mount): held until the test lets it go
    real_read = adapter_files._read
    monkeypatch.setattr(adapter_files, "_read", lambda path, limit=None: release.wait(30) and real_read(path, limit))
    monkeypatch.setattr(adapter_files, "READ_TIMEOUT_S", 1.0)
    try:
        started = time.monotonic()
        answer, slowest = slowest_health_while(srv, lambda: load(http, "speaker@4", write_adapter(tmp_path / "s", srv)))
        refused_naming(answer, "took more than 1s")
        assert time.monotonic() - started < 10 and slowest < 0.5
        assert greedy_ids_and_logprobs(http, "speaker")  # the live policies were served all along
    finally:
        release.set()


def test_a_call_with_non_finite_logprobs_is_never_recorded(policies) -> None:
    """A live policy whose own adapter went NaN (past every check, as a diverged step might leave it): its calls'
    logprobs are NaN; its episode ends without them, and the other policy is untouched."""
    srv, http = policies
    listener_before = greedy_ids_and_logprobs(http, "listener")
    engine = srv.server.frozen._engine.current
    good = {m: (s.a[engine.lora.index_of("speaker") - 1].clone(), s.b[engine.lora.index_of("speaker") - 1].clone())
            for m, s in engine.lora._slots.items()}  # fmt: skip
    engine._queue_adapter("speaker", _poisoned(engine.lora, "speaker", float("nan")))
    try:
        lease = http.post("/episodes/begin", json={"client_id": "c", "policy": "speaker"}).json()
        r = httpx.post(lease["base_url"] + "/chat/completions", timeout=60, headers={
            "Authorization": f"Bearer {lease['api_key']}"}, json={
            "model": lease["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert (r.status_code, r.json()["error"]["code"]) == (500, "non_finite_output"), r.text
        r = http.post(f"/episodes/{lease['episode_id']}/end", json={"client_id": "c", "task_id": "t", "reward": 1.0})
        assert r.status_code == 200, r.text
        assert r.json()["samples"] == 0
        assert greedy_ids_and_logprobs(http, "listener") == listener_before
    finally:
        engine._queue_adapter("speaker", PreparedAdapter("speaker", engine.lora._rank, good))


OVERFLOW_CALLS = {  # route, body, streamed: every data-plane API a frozen policy answers
    "completions with logprobs": ("/completions", {"prompt": "hello", "logprobs": 0}, False),
    "completions streamed": ("/completions", {"prompt": "hello", "stream": True}, True),
    "chat with logprobs": ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True},
                           False),
    "chat": ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, False),
    "chat streamed": ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}, True),
    "responses": ("/responses", {"input": "hi"}, False),
    "messages": ("/messages", {"messages": [{"role": "user", "content": "hi"}]}, False),
}


def _not_json(constant: str) -> None:
    raise AssertionError(f"a bare {constant} was sent: not JSON")


def _error_of(r: httpx.Response, streamed: bool) -> dict:
    """The call's error object: the body's, or a streamed call's SSE error event (after which nothing follows)."""
    if not streamed:
        assert r.status_code == 500, r.text[:300]
        return json.loads(r.text, parse_constant=_not_json)["error"]
    events = [json.loads(line[6:], parse_constant=_not_json) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert events and "error" in events[-1], r.text[:300]
    return events[-1]["error"]


@pytest.mark.parametrize("fill", [1e10, 1e30])
def test_an_overflowing_frozen_adapter_answers_every_call_with_a_json_error(policies, tmp_path, fill) -> None:
    """Weights finite in the model's dtype (so loaded) whose products overflow: every API answers its own error
    object (valid JSON: no bare NaN), and the live policies are untouched."""
    srv, http = policies
    listener_before = greedy_ids_and_logprobs(http, "listener")
    r = load(http, "speaker@9", write_adapter(tmp_path / "huge", srv, fill=fill))
    assert r.status_code == 200, r.text
    key = r.json()["api_key"]
    try:
        for case, (route, body, streamed) in OVERFLOW_CALLS.items():
            r = httpx.post(f"{srv.url}/v1{route}", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                           json={"model": "speaker@9", "max_tokens": 4, "temperature": 0, **body})
            error = _error_of(r, streamed)
            assert error["code"] == "non_finite_output", (case, error)
            assert "not finite" in error["message"] and "speaker@9" in error["message"], (case, error)
        assert greedy_ids_and_logprobs(http, "listener") == listener_before
    finally:
        http.delete("/control/frozen/speaker@9")
