"""A forced tool call names only a declared function (issue 42): under `tool_choice: "required"` with several tools the
torch engine holds the name to the declared ones (`SamplingParams.lead`), and the tokens and logprobs recorded are
still the engine's raw ones. The vLLM engine's half: tests/servers/test_vllm_engine.py."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from servers.backends import SamplingParams
from servers.calls.tool_choice import ToolCallFormat, ToolChoice
from servers.engines import vllm_http
from servers.engines.lead_tokens import allowed_next, lead_from_strings, lead_to_strings
from servers.engines.request import Request
from servers.engines.sampling import raw_logprobs, sample_tokens, seeded_generator
from servers.engines.vllm_http import LEAD_ARG, completion_body
from servers.engines.vllm_process import LEAD_PROCESSOR, VLLMLaunch
from servers.episodes.ledger import Ledger
from servers.trainers.grpo import token_logprobs

NAMES = ("get_weather", "get_time", "lookup_city")
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in NAMES]
ASKED = [{"role": "user", "content": "What is the weather in Paris?"}]
SEEDS = range(6)


def test_allowed_next_follows_the_sequences_then_frees_the_generation():
    lead = ((5, 6, 7), (5, 8), (9,))
    assert allowed_next(lead, []) == [5, 9]
    assert allowed_next(lead, [5]) == [6, 8]
    assert allowed_next(lead, [5, 6]) == [7]
    assert allowed_next(lead, [5, 8]) is None and allowed_next(lead, [9]) is None  # spelled one: free
    assert allowed_next(lead, [5, 6, 7, 1, 2]) is None and allowed_next((), []) is None
    assert lead_from_strings(lead_to_strings(lead)) == lead
    for bad in (["1 x"], ["1", ""], ["-1"], "1 2", [1]):
        with pytest.raises(ValueError):
            lead_from_strings(bad)


def test_vllm_gets_the_lead_in_vllm_xargs_under_the_key_its_logits_processor_reads():
    led = completion_body([1, 2], SamplingParams(max_tokens=4, lead=((7, 8), (9,))), max_tokens=4, stop_token_ids=[0])
    assert led["vllm_xargs"] == {LEAD_ARG: ["7 8", "9"]} and led["logprobs"] == 0
    assert "vllm_xargs" not in completion_body([1], SamplingParams(max_tokens=4), max_tokens=4, stop_token_ids=[0])
    engines = Path(vllm_http.__file__).parent  # the processors run in vLLM's venv only
    assert f"class {LEAD_PROCESSOR.split(':')[1]}(" in (engines / "vllm_lead.py").read_text()
    for interface in ("vllm_lead_v1.py", "vllm_lead_v2.py"):  # V1 (the CPU build) and Model Runner V2 (CUDA)
        assert f'LEAD_ARG = "{LEAD_ARG}"' in (engines / interface).read_text()
    argv = VLLMLaunch(Path("m"), 2048, device="cpu", python=Path(sys.executable)).command(port=8123)
    assert argv[argv.index("--logits-processors") + 1] == LEAD_PROCESSOR == "vllm_lead:LeadConstraint"


def request(params: SamplingParams, generated: list[int]) -> Request:
    return Request(prompt_ids=[0], params=params, generator=seeded_generator(params.seed), loop=None, queue=None,
                   max_new_tokens=8, eos_token_ids=frozenset(), token_ids=list(generated))


def test_the_sampler_masks_a_copy_and_the_logprobs_stay_raw():
    logits = torch.tensor([[0.0, 9.0, 1.0, 2.0], [0.0, 9.0, 1.0, 2.0], [0.0, 9.0, 1.0, 2.0]])
    raw = logits.clone()
    rows = [request(SamplingParams(max_tokens=8, temperature=0, lead=((2, 3), (3,))), []),  # greedy: 1 is barred
            request(SamplingParams(max_tokens=8, temperature=1.0, seed=3, lead=((2, 3),)), [2]),  # next must be 3
            request(SamplingParams(max_tokens=8, temperature=0, lead=((2,),)), [2])]  # spelled: free again
    tokens = sample_tokens(logits, rows)
    assert tokens.tolist() == [3, 3, 1]
    assert torch.equal(logits, raw)  # the caller's logits are untouched: the logprobs come from them
    assert raw_logprobs(logits, tokens)[0] == pytest.approx(torch.log_softmax(raw[0], -1)[3].item())


def test_the_forced_name_leads_are_each_declared_name_and_the_text_before_the_arguments():
    form = ToolCallFormat(opening='<tool_call>\n{"name": "', middle='", "arguments": ', closing="}\n</tool_call>")
    assert form.name_leads(ToolChoice("required", names=("a", "b"))) == ['a", "arguments":', 'b", "arguments":']
    assert form.name_leads(ToolChoice("function", "a")) == [] and form.name_leads(ToolChoice("auto")) == []


def forced_calls(http: httpx.Client, **extra) -> tuple[dict, list[dict]]:
    """A lease and its forced calls over SEEDS (chat completions, ids and logprobs returned)."""
    lease = http.post("/episodes/begin", json={"client_id": "c"}).json()
    client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"], max_retries=0)
    bodies = [client.chat.completions.create(
        model="tiny", messages=ASKED, tools=TOOLS, tool_choice="required", max_tokens=24, temperature=1.0,
        seed=seed, logprobs=True, extra_body={"return_token_ids": True}, **extra).model_dump() for seed in SEEDS]
    return lease, bodies


def names(bodies: list[dict]) -> list[str]:
    return [call["function"]["name"] for body in bodies for call in body["choices"][0]["message"]["tool_calls"]]


def test_without_the_lead_the_tiny_model_names_undeclared_functions(rolling, monkeypatch):
    _, http = rolling
    monkeypatch.setattr(ToolCallFormat, "name_leads", lambda self, choice: [])
    lease, bodies = forced_calls(http)
    http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "c"})
    assert not set(names(bodies)) <= set(NAMES), names(bodies)  # the test below has something to prevent


def test_every_forced_name_is_declared_and_recorded_with_the_engines_raw_logprobs(rolling, tiny_model):
    srv, http = rolling
    lease, bodies = forced_calls(http)
    assert set(names(bodies)) <= set(NAMES) and len(names(bodies)) == len(SEEDS)
    assert all(body["choices"][0]["finish_reason"] == "tool_calls" for body in bodies)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for body in bodies:  # raw: log softmax of the model's logits, not renormalised over the names
        prompt, choice = body["prompt_token_ids"], body["choices"][0]
        ids = torch.tensor([prompt + choice["token_ids"]])
        with torch.no_grad():
            expected = token_logprobs(model, ids, torch.ones_like(ids))[0, len(prompt):].tolist()
        served = [t["logprob"] for t in choice["logprobs"]["content"]]
        assert served == pytest.approx(expected, abs=1e-3)
    assert http.post(f"/episodes/{lease['episode_id']}/end", json={
        "client_id": "c", "task_id": "t", "reward": 1.0}).status_code == 200
    ledger = Ledger(srv.data_dir / "ledger.sqlite")
    try:
        recorded = sorted(lp for s in ledger.samples_of(lease["episode_id"])
                          for lp, mask in zip(s.logprobs, s.loss_mask) if mask)
    finally:
        ledger.close()
    served = sorted(t["logprob"] for body in bodies for t in body["choices"][0]["logprobs"]["content"])
    assert recorded == pytest.approx(served, abs=1e-6)


def test_responses_and_messages_forced_calls_name_declared_functions(rolling):
    _, http = rolling
    lease = http.post("/episodes/begin", json={"client_id": "c"}).json()
    headers = {"Authorization": f"Bearer {lease['api_key']}", "x-api-key": lease["api_key"]}
    responses = [{"type": "function", "name": name, "parameters": {"type": "object"}} for name in NAMES]
    anthropic = [{"name": name, "input_schema": {"type": "object"}} for name in NAMES]
    for seed in SEEDS[:3]:
        r = httpx.post(lease["base_url"] + "/responses", headers=headers, timeout=60, json={
            "model": "tiny", "input": "weather?", "tools": responses, "tool_choice": "required",
            "max_output_tokens": 24, "temperature": 1.0})
        assert [item["name"] for item in r.json()["output"] if item["type"] == "function_call"][0] in NAMES
        m = httpx.post(lease["base_url"] + "/messages", headers=headers, timeout=60, json={
            "model": "tiny", "max_tokens": 24, "messages": [{"role": "user", "content": f"weather {seed}?"}],
            "tools": anthropic, "tool_choice": {"type": "any"}})
        assert [b["name"] for b in m.json()["content"] if b["type"] == "tool_use"][0] in NAMES
    http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "c"})


def test_a_lead_with_ids_outside_the_vocabulary_is_refused(rolling):
    srv, _ = rolling
    engine = srv.server.lifecycle.engine

    async def generate() -> None:
        async for _ in engine.generate([1, 2], SamplingParams(max_tokens=2, lead=((10**9,),))):
            pass

    with pytest.raises(ValueError, match="lead"):
        asyncio.run(generate())
