"""A tiny model that always answers with one tool call, built like `tiny_model` builds its model.

`build_tool_model(dir)` writes the tiny Llama of `tiny_model` trained (a few hundred Adam steps on the CPU,
seconds) to answer every assistant turn with `TOOL_REPLY`: a Hermes tool call to `get_weather` for Paris, then the
end-of-turn token. The prompts it is trained on vary (system or not, tools listed or not, earlier turns and tool
results), so whatever conversation an SDK sends, the reply is that call with near certainty, at any temperature.
Tests of tool-calling clients use it: their turns then really are tool calls, made by a real model on a real engine.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

from filelock import FileLock
from tiny_model import build_tiny_model

TOOL_NAME = "get_weather"
TOOL_ARGUMENTS = {"city": "Paris"}
TOOL_REPLY = f'<tool_call>{{"name": "{TOOL_NAME}", "arguments": {json.dumps(TOOL_ARGUMENTS)}}}</tool_call>'
WEATHER_TOOL = {"type": "function", "function": {
    "name": TOOL_NAME, "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time in a city.",
                                             "parameters": {"type": "object", "properties": {}}}}
#: `":` and ` {"` as one token (`build_tokenizer`'s `extra_merges`): it crosses the end of a forced call's lead
#: (`get_weather", "arguments":`, whose own tokens end in `":`), as tokens of real BPE vocabularies do.
CROSSING_MERGE = ('":', 'Ġ{"')
#: What a forced reply starts with under `tool_choice: "required"` and several tools (the tiny template's opening).
FORCED_OPENING = '<tool_call>{"name": "'
_WORDS = "the quick brown fox weather Paris city what is it sunny rain you are a helpful assistant 2 + 3 ?".split()


def _conversation(rng: random.Random) -> tuple[list[dict], list[dict] | None]:
    def text() -> str:
        return " ".join(rng.choices(_WORDS, k=rng.randint(1, 12)))

    messages = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(0, 2)):
        messages += [{"role": "user", "content": text()},
                     {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
                         "name": TOOL_NAME, "arguments": json.dumps(TOOL_ARGUMENTS)}}]},
                     {"role": "tool", "content": text(), "tool_call_id": "c"}]
    messages.append({"role": rng.choice(["user", "tool"]) if len(messages) > 1 else "user", "content": text()})
    other = {"type": "function", "function": {"name": rng.choice(_WORDS), "description": text(),
                                              "parameters": {"type": "object", "properties": {}}}}
    tools = rng.choice([None, [WEATHER_TOOL], [WEATHER_TOOL, other], [other]])
    return messages, tools


def build_tool_model(directory: str | Path, *, steps: int = 200, seed: int = 0, forced: bool = False,
                     extra_merges: tuple[tuple[str, str], ...] = (), **shape: int) -> Path:
    """`forced`: trained only on replies forced as `tool_choice: "required"` with two tools forces them (the
    prompt ends with FORCED_OPENING, the model writes the rest); `extra_merges`: see `build_tokenizer`; `shape`:
    `build_tiny_model`'s sizes (vLLM's CPU attention needs a head of 32 or more: hidden_size=64, num_heads=2)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = build_tiny_model(directory, seed=seed, extra_merges=extra_merges, **shape)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    opening = FORCED_OPENING if forced else ""
    reply = tokenizer.encode(TOOL_REPLY.removeprefix(opening), add_special_tokens=False) + [tokenizer.eos_token_id]
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    model.train()
    for _ in range(steps):
        rows = []
        for _ in range(8):
            messages, tools = _conversation(rng)
            if forced:
                tools = [WEATHER_TOOL, TIME_TOOL]
            prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
            rows.append(tokenizer.encode(prompt + opening, add_special_tokens=False) + reply)
        width = max(map(len, rows))
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        labels = torch.full_like(ids, -100)
        for i, row in enumerate(rows):
            labels[i, len(row) - len(reply):len(row)] = ids[i, len(row) - len(reply):len(row)]
        mask = (torch.arange(width)[None, :] < torch.tensor([len(r) for r in rows])[:, None]).long()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(directory)
    return directory


def tool_model_dir(tmp_path_factory) -> Path:
    """The tool-calling model, built once per test run: the test modules of the servers and the proxy share it, and
    so do pytest-xdist's workers (through the run's temp dir above each worker's own, under a file lock)."""
    prebuilt = os.environ.get("MARL_TEST_TOOL_MODEL")  # a directory build_tool_model wrote: faster reruns
    if prebuilt:
        return Path(prebuilt)
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    directory, done = shared / "tool-model", shared / "tool-model.built"
    with FileLock(str(shared / "tool-model.lock")):
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)  # a build an interrupted worker left half done
            build_tool_model(directory)
            done.touch()
    return directory


def agents_weather_tool(asked: list[str]):
    """The OpenAI Agents SDK's side of the weather tool: the tool (it notes each city asked in `asked`) and a
    `tool_use_behavior` that ends the run after its second call."""
    from agents import function_tool
    from agents.agent import ToolsToFinalOutputResult

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"sunny in {city}"

    def after_two_calls(_context, results) -> ToolsToFinalOutputResult:
        return ToolsToFinalOutputResult(is_final_output=len(asked) == 2, final_output=results[-1].output)

    return get_weather, after_two_calls
