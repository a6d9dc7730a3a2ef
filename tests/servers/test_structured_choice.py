"""`structured_outputs: {choice: [...]}` (vLLM's extension, its choice form): every reply is exactly one of the
strings, the tokens and logprobs recorded are the engine's raw ones, and what the server cannot hold is refused."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from servers.trainers.grpo import token_logprobs

MOVES = ["Pass", "Bet", "Call it"]
ASKED = [{"role": "user", "content": "Your card: King. Pass or Bet?"}]


def choice_calls(http: httpx.Client, seeds: range, **extra) -> tuple[dict, list[dict]]:
    lease = http.post("/episodes/begin", json={"client_id": "c"}).json()
    client = openai.OpenAI(base_url=lease["base_url"], api_key=lease["api_key"], max_retries=0)
    bodies = [client.chat.completions.create(
        model="tiny", messages=ASKED, max_tokens=8, temperature=1.0, seed=seed, logprobs=True,
        extra_body={"return_token_ids": True, "structured_outputs": {"choice": MOVES}}, **extra).model_dump()
        for seed in seeds]
    return lease, bodies


def test_every_reply_is_one_of_the_choices_with_the_engines_raw_logprobs(rolling, tiny_model):
    _, http = rolling
    lease, bodies = choice_calls(http, range(12))
    replies = [body["choices"][0]["message"]["content"] for body in bodies]
    assert set(replies) <= set(MOVES) and len(set(replies)) > 1, replies  # the tiny model's own mix
    assert all(body["choices"][0]["finish_reason"] == "stop" for body in bodies)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for body in bodies[:4]:  # raw: log softmax of the model's logits, not renormalised over the choices
        prompt, choice = body["prompt_token_ids"], body["choices"][0]
        ids = torch.tensor([prompt + choice["token_ids"]])
        with torch.no_grad():
            expected = token_logprobs(model, ids, torch.ones_like(ids))[0, len(prompt):].tolist()
        assert [t["logprob"] for t in choice["logprobs"]["content"]] == pytest.approx(expected, abs=1e-3)
    http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "c"})


def test_what_the_server_cannot_hold_is_refused_with_the_parameter(rolling):
    _, http = rolling
    lease = http.post("/episodes/begin", json={"client_id": "c"}).json()
    headers = {"Authorization": f"Bearer {lease['api_key']}"}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra, words in (({"structured_outputs": {"choice": []}}, "at least 1"),
                         ({"structured_outputs": {"json": {"type": "object"}}}, "only choice"),
                         ({"structured_outputs": {"choice": ["a", 3]}}, "string"),
                         ({"structured_outputs": {"choice": ["a"]}, "tools": tools, "tool_choice": "required"},
                          "cannot both")):
        answer = httpx.post(lease["base_url"] + "/chat/completions", headers=headers, timeout=60,
                            json={"model": "tiny", "messages": ASKED, "max_tokens": 4, **extra})
        assert answer.status_code == 400, (extra, answer.text)
        error = answer.json()["error"]
        assert words in error["message"] and error["code"] in ("invalid_request", "unsupported_value"), error
    http.post(f"/episodes/{lease['episode_id']}/abort", json={"client_id": "c"})
