"""vLLM serving LoRA adapters (the CPU build, fp32): a mixed batch of three adapters and the base gives each request
what it gets alone and what a PEFT fp32 forward gives; replacing one adapter at runtime changes only it (and never
reuses its old cached prefixes); a restarted vLLM serves the adapters again; an unloaded one is refused."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from tiny_model import build_tiny_model

from marl.protocol import LoraSpec
from servers.backends import SamplingParams
from servers.engines.vllm_engine import VLLMEngine
from servers.engines.vllm_lora import LoraSlots, lora_slots
from servers.engines.vllm_process import VLLM_PYTHON_ENV, VLLMLaunch, vllm_python
from tests.servers.test_multi_lora_engine import SEEDS, SPECS, peft_adapter, peft_logprobs
from tests.servers.test_torch_engine import TEXTS, run_all

needs_vllm = pytest.mark.skipif(
    not vllm_python().exists(), reason=f"no vLLM environment at {vllm_python()} (`make vllm`, or ${VLLM_PYTHON_ENV})")
TOLERANCE = 1e-4  # fp32 on both sides: vLLM's LoRA kernels against PEFT's forward


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # head_dim 32: vLLM's CPU attention supports 32 and up
    return build_tiny_model(tmp_path_factory.mktemp("tiny-vllm-lora"), hidden_size=64, num_heads=2)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, tuple[PeftModel, Path]]:
    """Three PEFT adapters of different ranks, scalings and targets, each saved in PEFT's format."""
    root = tmp_path_factory.mktemp("adapters")
    found = {}
    for name, spec in SPECS.items():
        model = peft_adapter(model_dir, spec, SEEDS[name])
        model.save_pretrained(root / name)
        found[name] = (model, root / name)
    return found


@pytest.fixture(scope="module")
def engine(model_dir, adapters, tmp_path_factory):
    engine = VLLMEngine(model_dir, device="cpu", work_dir=tmp_path_factory.mktemp("vllm-lora"),
                        lora=lora_slots(SPECS.values()))
    engine.eos_token_ids = frozenset()  # lengths are exact
    try:
        for name, (_, directory) in adapters.items():
            engine.load_adapter_from(name, directory)
        yield engine
    finally:
        engine.close()


def requests(engine: VLLMEngine, adapters: list[str | None]) -> list[tuple[list[int], SamplingParams]]:
    prompt = engine.tokenizer.encode(TEXTS[1])
    return [(prompt, SamplingParams(max_tokens=8, temperature=0.0, adapter=adapter)) for adapter in adapters]


def close(served: list[float], expected: torch.Tensor | list[float], atol: float = TOLERANCE) -> None:
    torch.testing.assert_close(torch.tensor(served), torch.as_tensor(expected), atol=atol, rtol=0)


def test_slots_and_launch_flags():
    assert lora_slots([]) is None
    assert lora_slots([LoraSpec(rank=12), LoraSpec(rank=4)]) == LoraSlots(max_loras=2, max_rank=16)
    for device, slots in (("cuda", "3"), ("cpu", "4")):  # the CPU build: one more for the base's stand-in
        launch = VLLMLaunch(Path("m"), 256, device=device, lora=LoraSlots(max_loras=3, max_rank=8))
        command = launch.command(8000)
        assert command[command.index("--max-loras") + 1] == slots and launch.base_stand_in == (device == "cpu")
        assert command[command.index("--max-lora-rank") + 1] == "8" and "--enable-lora" in command
        assert launch.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "--enable-lora" not in VLLMLaunch(Path("m"), 256).command(8000)


@needs_vllm
@pytest.mark.timeout(900)  # vLLM starts in 25-50 s on 2 busy cores, twice here (the restart)
def test_adapters_on_vllm(engine: VLLMEngine, adapters, model_dir, tmp_path):
    check_a_mixed_batch_is_each_request_alone_and_peft(engine, adapters)
    check_replacing_one_adapter_changes_only_it(engine, adapters, model_dir, tmp_path)
    check_a_restarted_vllm_serves_the_adapters_again(engine, adapters)
    check_an_unloaded_adapter_is_refused(engine)


def check_a_mixed_batch_is_each_request_alone_and_peft(engine, adapters) -> None:
    names = [*SPECS, None]
    together = run_all(engine, requests(engine, names))
    for name, (ids, logprobs, _) in zip(names, together, strict=True):
        alone_ids, alone_logprobs, _ = run_all(engine, requests(engine, [name]))[0]
        assert ids == alone_ids and len(ids) == 8
        close(logprobs, alone_logprobs)
        prompt = engine.tokenizer.encode(TEXTS[1])
        if name is not None:
            close(logprobs, peft_logprobs(adapters[name][0], prompt, ids))
        else:  # the bare base, batched next to adapters (the CPU build's base rows: servers.engines.vllm_lora)
            with adapters["alice"][0].disable_adapter():
                close(logprobs, peft_logprobs(adapters["alice"][0], prompt, ids))
    assert len({tuple(ids) for ids, _, _ in together}) == len(names)  # each adapter matters


def check_replacing_one_adapter_changes_only_it(engine, adapters, model_dir, tmp_path) -> None:
    before = dict(zip(SPECS, run_all(engine, requests(engine, list(SPECS))), strict=True))
    retrained = peft_adapter(model_dir, SPECS["alice"], seed=99)
    retrained.save_pretrained(tmp_path / "alice-2")
    loads = engine.stats.adapter_loads
    engine.load_adapter_from("alice", tmp_path / "alice-2")
    assert engine.stats.adapter_loads == loads + 1
    after = dict(zip(SPECS, run_all(engine, requests(engine, list(SPECS))), strict=True))
    # the same prompt, cached under alice's old weights, is computed again with the new ones
    ids, logprobs, _ = after["alice"]
    close(logprobs, peft_logprobs(retrained, engine.tokenizer.encode(TEXTS[1]), ids))
    assert ids != before["alice"][0]
    for name in ("bob", "carol"):
        assert after[name][0] == before[name][0]
        close(after[name][1], before[name][1], atol=1e-6)
    adapters["alice"] = (retrained, tmp_path / "alice-2")


def check_a_restarted_vllm_serves_the_adapters_again(engine, adapters) -> None:
    before = run_all(engine, requests(engine, list(SPECS)))
    first = engine.pid
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 600
    while engine.stats.restarts == 0 or engine.pid == first:
        assert time.monotonic() < deadline, "vLLM was not restarted"
        time.sleep(0.5)
    after = run_all(engine, requests(engine, list(SPECS)))  # waits until the restarted vLLM serves
    for (ids, logprobs, _), (again, again_logprobs, _) in zip(before, after, strict=True):
        assert ids == again
        close(again_logprobs, logprobs)


def check_an_unloaded_adapter_is_refused(engine) -> None:
    engine.unload_adapter("carol")
    with pytest.raises(ValueError, match="carol"):
        run_all(engine, requests(engine, ["carol"]))
    run_all(engine, requests(engine, ["bob", None]))  # the others still serve


@needs_vllm
@pytest.mark.timeout(900)
def test_a_server_of_policies_on_vllm_publishes_a_step_as_an_adapter_load(model_dir, tmp_path):
    """The whole path: a policy's step → its adapter exported → loaded into the running vLLM (no restart), while the
    other policy's lease goes on, on its untouched adapter."""
    from tests.conftest import admin_http
    from tests.servers.test_policy_server import CONFIG, greedy, play, wait_policy
    from tests.servers.test_vllm_engine import START_TIMEOUT_S, VLLMServer

    flags = ["--policy", 'speaker={"rank": 4, "alpha": 8}', "--policy", 'listener={"rank": 8, "alpha": 8}']
    with VLLMServer(model_dir, tmp_path / "server", vllm_flags=flags) as srv, admin_http(srv.url) as http:
        for policy in ("speaker", "listener"):
            r = http.post("/control/config", params={"policy": policy}, json=CONFIG.model_dump(mode="json"))
            assert r.status_code == 200, r.text
        assert http.post("/control/start").status_code == 200
        deadline = time.monotonic() + START_TIMEOUT_S
        while http.get("/control/status").json()["state"] != "ROLLING":
            assert time.monotonic() < deadline, "vLLM did not start"
            time.sleep(0.5)
        stats = srv.server.policies["speaker"].lifecycle.engine.stats  # the shared VLLMEngine's
        loads = stats.adapter_loads  # each policy's first adapter
        listening = http.post("/episodes/begin", json={"client_id": "c", "policy": "listener"}).json()
        before = greedy(listening)
        speaking = http.post("/episodes/begin", json={"client_id": "c", "policy": "speaker"}).json()
        speaker_before = greedy(speaking)
        http.post(f"/episodes/{speaking['episode_id']}/abort", json={"client_id": "c"})
        for reward in (0.0, 1.0):
            play(http, "speaker", "t", reward)
        wait_policy(http, "speaker", "ROLLING", version=1)
        assert stats.adapter_loads == loads + 1 and stats.restarts == 0 and stats.weight_loads == 0
        assert greedy(listening) == pytest.approx(before, abs=1e-6)  # the listener's lease went on, untouched
        speaking = http.post("/episodes/begin", json={"client_id": "c", "policy": "speaker"}).json()
        assert greedy(speaking) != pytest.approx(speaker_before, abs=1e-3)  # the speaker's new adapter serves
        http.post(f"/episodes/{speaking['episode_id']}/abort", json={"client_id": "c"})
        http.post(f"/episodes/{listening['episode_id']}/abort", json={"client_id": "c"})
        check_frozen_policies_on_vllm(srv, http)
        assert http.post("/control/stop").status_code == 200


def check_frozen_policies_on_vllm(srv, http) -> None:
    """A league's past selves on vLLM: speaker@1 (its step-1 checkpoint) serves what the live speaker serves at v1,
    speaker@0 the base; unloading one frees it (a later call is refused)."""
    from tests.servers.test_frozen_policies import adapter_of, frozen_call, reply_of, speaker_lease_logprobs

    r = http.post("/control/frozen", json={"name": "speaker@1", "adapter": str(adapter_of(srv.data_dir, 1))})
    assert r.status_code == 200, r.text
    key = r.json()["api_key"]
    assert http.post("/control/frozen", json={"name": "speaker@0"}).status_code == 200
    _, _, frozen = reply_of(frozen_call(srv.url, key, "speaker@1"))
    assert speaker_lease_logprobs(http) == pytest.approx(frozen, abs=1e-5)
    _, _, base = reply_of(frozen_call(srv.url, key, "speaker@0"))
    assert base != pytest.approx(frozen, abs=1e-3)
    assert http.delete("/control/frozen/speaker@1").status_code == 200
    assert frozen_call(srv.url, key, "speaker@1").status_code == 404
