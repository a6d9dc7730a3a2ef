"""The proxy's reward functions: the contract, loading one by name, and the two built-ins (`rule`, `judge`).

A reward function scores the N candidate answers to one app request against each other (relative rewards, as in
AgentJet's swarm API: `on_compute_relative_reward`)::

    def reward(request: ChatCompletionRequest, candidates: list[Candidate]) -> list[float]: ...

It sees the app's whole request (every message, the tools, the sampling parameters) and every candidate, and returns
one finite number per candidate, in order. It may be a plain function (run on a worker thread, so it may block) or
an `async def` (awaited on the proxy's event loop, so it must not block). `marl proxy --reward` names one as
`module:function`, or a built-in by name with `--reward-option KEY=VALUE` for its settings.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
import os
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from marl.protocol import AssistantMessage, ChatCompletionRequest, ChatCompletionResponse

__all__ = ["BUILTIN_REWARDS", "Candidate", "RewardFunction", "judge_reward", "load_reward", "parse_scores",
           "rule_reward", "score"]


@dataclass(frozen=True)
class Candidate:
    """One answer of the trained model to the app's request: what a reward function scores."""

    text: str  # the reply's text ("" for a reply that only calls tools)
    message: AssistantMessage  # the whole reply, tool calls included
    finish_reason: str  # "stop", "length" (cut at max_tokens) or "tool_calls"
    response: ChatCompletionResponse  # as the swarm server sent it (usage; logprobs when the app asked for them)

    @classmethod
    def from_response(cls, response: ChatCompletionResponse) -> Candidate:
        choice = response.choices[0]
        return cls(text=choice.message.content or "", message=choice.message, finish_reason=choice.finish_reason,
                   response=response)


RewardFunction = Callable[[ChatCompletionRequest, list[Candidate]], Sequence[float] | Awaitable[Sequence[float]]]


async def score(reward: RewardFunction, request: ChatCompletionRequest, candidates: list[Candidate]) -> list[float]:
    """Run `reward` (a blocking one on a worker thread) and check it returned one finite number per candidate."""
    # an object whose __call__ is async is awaited too (callable() cannot tell)
    if inspect.iscoroutinefunction(reward) or inspect.iscoroutinefunction(getattr(reward, "__call__", None)):  # noqa: B004
        result = await reward(request, candidates)
    else:
        result = await asyncio.to_thread(reward, request, candidates)
        if inspect.isawaitable(result):
            result = await result
    values = list(result)
    if len(values) != len(candidates):
        raise ValueError(f"the reward function returned {len(values)} rewards for {len(candidates)} candidates")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"the reward function returned {value!r}: every reward must be a finite number")
    return [float(v) for v in values]


# --- loading -------------------------------------------------------------------------------------------------------


def load_reward(spec: str, options: Mapping[str, str] | None = None) -> RewardFunction:
    """A built-in by name (`rule`, `judge`; `options` are its settings), or `module:function` (no options)."""
    options = dict(options or {})
    if spec in BUILTIN_REWARDS:
        try:
            return BUILTIN_REWARDS[spec](**options)
        except TypeError as exc:  # an unknown option
            raise ValueError(f"reward {spec!r}: {exc}") from None
    if options:
        raise ValueError(f"--reward-option sets a built-in reward ({', '.join(BUILTIN_REWARDS)}); {spec!r} takes none")
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"reward {spec!r}: expected module:function (e.g. my_rewards:score) or a built-in "
                         f"({', '.join(BUILTIN_REWARDS)})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {spec!r}: cannot import {module_name!r} ({exc}); is it on PYTHONPATH?") from exc
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"reward {spec!r}: {module_name} has no callable {attribute!r}")
    return function


# --- built-in: rule ------------------------------------------------------------------------------------------------

_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")


def _count(name: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"rule reward: {name} must be a whole number >= 1, got {value!r}")
    return number


def rule_reward(*, pattern: str | None = None, max_words: str | None = None, min_words: str | None = None,
                contains: str | None = None) -> RewardFunction:
    """Built-in `rule`: the mean of the terms configured, each in [0, 1].

    pattern=REGEX: 1 if the reply matches (re.search), else 0. max_words=K: 1 for 1..K words, K/words above, 0 for
    an empty reply. min_words=K: 1 for K words or more, words/K below. contains=TEXT: 1 if the reply contains TEXT
    (case-insensitive), else 0.
    """
    terms: list[Callable[[str], float]] = []
    if pattern is not None:
        regex = re.compile(pattern, re.DOTALL)
        terms.append(lambda text: float(regex.search(text) is not None))
    if max_words is not None:
        most = _count("max_words", max_words)
        terms.append(lambda text: min(1.0, most / n) if (n := len(_WORD.findall(text))) else 0.0)
    if min_words is not None:
        least = _count("min_words", min_words)
        terms.append(lambda text: min(1.0, len(_WORD.findall(text)) / least))
    if contains is not None:
        needle = contains.lower()
        terms.append(lambda text: float(needle in text.lower()))
    if not terms:
        raise ValueError("rule reward: give at least one of pattern=, max_words=, min_words=, contains=")

    def rule(request: ChatCompletionRequest, candidates: list[Candidate]) -> list[float]:
        return [sum(term(c.text) for term in terms) / len(terms) for c in candidates]

    return rule


# --- built-in: judge -----------------------------------------------------------------------------------------------

JUDGE_CRITERIA = "helpful, correct, and to the point"
_JUDGE_SYSTEM = ("You are a strict, fair judge of assistant replies. You get a conversation and several candidate "
                 "replies to its last message. Score every candidate from 0 (worst) to 10 (best) by how {criteria} it "
                 "is, comparing them with each other. Answer with a JSON list of {n} numbers, the scores of candidates "
                 "1 to {n} in order, and nothing else.")
_CONVERSATION_CHARS = 6000  # the judge sees the end of a long conversation only
_CANDIDATE_CHARS = 3000


def judge_prompt(request: ChatCompletionRequest, candidates: list[Candidate], criteria: str) -> list[dict[str, str]]:
    """The judge's messages: the conversation (its end, when long) and the numbered candidates."""
    turns = [f"{m.role}: {_text(m.content)}" for m in request.messages]
    conversation = "\n".join(turns)[-_CONVERSATION_CHARS:]
    listed = "\n\n".join(f"[{i}] {_candidate_text(c)[:_CANDIDATE_CHARS]}" for i, c in enumerate(candidates, 1))
    user = f"Conversation:\n{conversation}\n\nCandidate replies:\n{listed}\n\nScores (JSON list of {len(candidates)}):"
    return [{"role": "system", "content": _JUDGE_SYSTEM.format(criteria=criteria, n=len(candidates))},
            {"role": "user", "content": user}]


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def _candidate_text(candidate: Candidate) -> str:
    calls = candidate.message.tool_calls or []
    tools = "".join(f"\n(calls {c.function.name} with {c.function.arguments})" for c in calls)
    return (candidate.text + tools) or "(empty reply)"


def judge_reward(*, url: str, model: str, api_key_env: str | None = None, criteria: str = JUDGE_CRITERIA,
                 timeout_s: str = "120", attempts: str = "2") -> RewardFunction:
    """Built-in `judge`: a judge model at any OpenAI-compatible `url` scores the candidates together, 0 to 10.

    Rewards are the scores / 10. `api_key_env` names the environment variable that holds the judge's API key (never
    put a key on the command line); `criteria` completes "score by how ... it is". A reply that cannot be read as
    N scores is asked again, `attempts` times in all; then the reward function fails (see docs/proxy.md).
    """
    headers = {}
    if api_key_env:
        if not os.environ.get(api_key_env):
            raise ValueError(f"judge reward: ${api_key_env} (api_key_env) is not set")
        headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
    endpoint = url.rstrip("/") + "/chat/completions"
    tries, timeout = _count("attempts", attempts), float(timeout_s)

    async def judge(request: ChatCompletionRequest, candidates: list[Candidate]) -> list[float]:
        body = {"model": model, "messages": judge_prompt(request, candidates, criteria), "temperature": 0.0}
        async with httpx.AsyncClient(timeout=timeout, headers=headers) as http:
            for attempt in range(1, tries + 1):
                response = await http.post(endpoint, json=body)
                response.raise_for_status()
                reply = response.json()["choices"][0]["message"].get("content") or ""
                try:
                    return [s / 10.0 for s in parse_scores(reply, len(candidates))]
                except ValueError as exc:
                    if attempt == tries:
                        raise ValueError(f"judge reward: {exc}; the judge said: {reply[:300]!r}") from None
        raise AssertionError("unreachable")

    return judge


_THINKING = re.compile(r"<think>.*?</think>", re.DOTALL)
_JSON_LIST = re.compile(r"\[[^\[\]]*\]")
# "[2] 7", "[2]: 7", "2: 7", "Candidate 2 - 7", "2) 7"
_NUMBERED = re.compile(r"(?:\[(\d+)\]\s*[:=\-]?|(\d+)\s*[:=)\-])\s*(-?\d+(?:\.\d+)?)")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_scores(reply: str, n: int) -> list[float]:
    """N scores in 0..10 from a judge's reply: a JSON list, else "1: 7"-style lines, else exactly N bare numbers."""
    text = _THINKING.sub("", reply)
    for found in reversed(_JSON_LIST.findall(text)):
        try:
            values = json.loads(found)
        except ValueError:
            continue
        if len(values) == n and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return [_clamp(v) for v in values]
    numbered = {int(bracketed or plain): float(s) for bracketed, plain, s in _NUMBERED.findall(text)}
    if all(i in numbered for i in range(1, n + 1)):
        return [_clamp(numbered[i]) for i in range(1, n + 1)]
    numbers = _NUMBER.findall(text)
    if len(numbers) == n:
        return [_clamp(float(v)) for v in numbers]
    raise ValueError(f"expected {n} scores (a JSON list of {n} numbers)")


def _clamp(value: float) -> float:
    return min(10.0, max(0.0, float(value)))


BUILTIN_REWARDS: dict[str, Callable[..., RewardFunction]] = {"rule": rule_reward, "judge": judge_reward}
