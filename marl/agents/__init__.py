"""Agents that play text games (envs.base.TextAECEnv): an LLM behind an OpenAI-compatible endpoint, or a script.

    speaker = LLMAgent(openai.OpenAI(base_url=..., api_key=...), "tiny",
                       system_prompt=env.system_prompt("speaker"), agent_tag="speaker")
    reply = speaker.act(observation)

One `LLMAgent` plays one agent for one game: every `act` sends the whole conversation so far (system, then each
observation as a user turn and each reply, verbatim, as an assistant turn). Each call's prompt therefore extends the
previous call's prompt + completion, and the swarm server merges the calls of one game into one training sample.
`reset()` starts a new conversation (a new game).

A conversation that outgrows the model's context (the server answers 400 `context_length_exceeded`) is cut from the
front: the oldest exchanges go, the system prompt and the newest observation stay, and the call is retried. The
server then starts a new training sample for this agent (merging needs an unchanged prefix); the game goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import openai
from openai.types.chat import ChatCompletion

from marl.protocol import AGENT_HEADER, ErrorCode, agent_headers


class LLMAgent:
    def __init__(self, client: Any, model: str, *, system_prompt: str, max_tokens: int = 64,
                 temperature: float = 1.0, top_p: float | None = None, stop: str | Sequence[str] | None = None,
                 agent_tag: str | None = None, choices: Callable[[], Sequence[str] | None] | None = None):
        """`agent_tag` (the role) tags every call, set once as the `X-Marl-Agent` header of the agent's client: a copy
        of `client` (`with_options`; it shares the connection pool) when one is given, so a client shared by several
        agents stays untagged. `max_tokens`, `temperature`, `top_p` and `stop` go with every call (`top_p` and `stop`
        only when set: the server's defaults otherwise). `choices`, asked before each call, gives the moves the reply
        must be one of (sent as `structured_outputs`; None or empty: a free reply)."""
        self.client = tagged_client(client, agent_tag)
        self.model, self.system_prompt = model, system_prompt
        self.max_tokens, self.temperature, self.agent_tag = max_tokens, temperature, agent_tag
        self.top_p, self.stop = top_p, [stop] if isinstance(stop, str) else list(stop) if stop else None
        self.choices = choices
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self, system_prompt: str | None = None) -> None:
        """Forget the conversation (optionally with a new system prompt, e.g. a new role)."""
        if system_prompt is not None:
            self.system_prompt = system_prompt
        self.messages = [{"role": "system", "content": self.system_prompt}]

    def act(self, observation: str) -> str:
        """Send `observation` as the next user turn; return the model's reply (also kept as the assistant turn)."""
        self.messages.append({"role": "user", "content": str(observation)})
        while True:
            try:
                response = self._complete()
                break
            except Exception as exc:
                if _context_exceeded(exc) and len(self.messages) > 2:
                    self._forget_oldest_exchange()
                    continue
                self.messages.pop()  # a failed call leaves the conversation as it was
                raise
        reply = response.choices[0].message.content or ""
        self.messages.append({"role": "assistant", "content": reply})  # verbatim: the server splices on it
        return reply

    __call__ = act

    def remember(self, observation: str, move: str) -> None:
        """Add an exchange the model did not generate (`run.explore`'s forced moves) to the conversation, as `act`
        would have: the next call's prompt shows `move` as this agent's reply. The server sees it only as part of that
        prompt (context, mask 0), so `move` is never trained on."""
        self.messages += [{"role": "user", "content": str(observation)}, {"role": "assistant", "content": str(move)}]

    def act_held(self, observation: str, moves: Sequence[str]) -> str:
        """`act` with the reply held to one of `moves`, whatever `choices` says (`run.explore`'s trained moves: the
        server records the held reply as the model's own, at its raw logprobs, and trains on it)."""
        choices, self.choices = self.choices, lambda: list(moves)
        try:
            return self.act(observation)
        finally:
            self.choices = choices

    def _complete(self) -> Any:
        """One chat call with the conversation so far. An OpenAI SDK client sends the body through its `post`, as
        `chat.completions.create` does, but without that method's type walk over every message: 6 ms a call at 30
        messages and growing with the game, the coordinator's largest cost per call (bench/scale.py). Any other
        OpenAI-shaped client gets `chat.completions.create`."""
        body = {"model": self.model, "messages": list(self.messages), **self.sampling_options()}
        held = {"structured_outputs": {"choice": list(moves)}} if self.choices and (moves := self.choices()) else {}
        if isinstance(self.client, openai.OpenAI):
            return self.client.post("/chat/completions", body={**body, **held}, cast_to=ChatCompletion)
        return self.client.chat.completions.create(**body, **({"extra_body": held} if held else {}))

    def sampling_options(self) -> dict[str, Any]:
        """The sampling settings every call sends."""
        options: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature}
        if self.top_p is not None:
            options["top_p"] = self.top_p
        if self.stop:
            options["stop"] = list(self.stop)
        return options

    def _forget_oldest_exchange(self) -> None:
        """Drop the oldest user turn and the replies after it (keep the system prompt and the newest turn)."""
        del self.messages[1]
        while len(self.messages) > 2 and self.messages[1]["role"] != "user":
            del self.messages[1]


def tagged_client(client: Any, agent_tag: str | None) -> Any:
    """`client` with `agent_tag` as its `X-Marl-Agent` default header: the one place an agent's calls get their tag."""
    if agent_tag is None:
        return client
    if not hasattr(client, "with_options"):
        raise TypeError(f"agent_tag needs an OpenAI SDK client (it sets the {AGENT_HEADER} header with `with_options`);"
                        f" got {type(client).__name__!r}: set that header on it yourself and pass no agent_tag")
    return client.with_options(default_headers=agent_headers(agent_tag))


def _context_exceeded(exc: Exception) -> bool:
    """Whether a failed call was refused for its length, by the error's code (the openai SDK's `exc.code`, else the
    code in its `exc.body`), never by its message."""
    code = getattr(exc, "code", None)
    body = getattr(exc, "body", None)
    if code is None and isinstance(body, Mapping):
        error = body.get("error", body)
        code = error.get("code") if isinstance(error, Mapping) else None
    return code == ErrorCode.CONTEXT_LENGTH_EXCEEDED


class ScriptedAgent:
    """Plays `agent` in `env` by the env's rule-based `scripted_action` (scripted opponents, tests)."""

    def __init__(self, env: Any, agent: str):
        self.env, self.agent = env, agent

    def reset(self) -> None:
        pass

    def act(self, observation: str) -> str:
        return self.env.scripted_action(self.agent)

    __call__ = act

    def remember(self, observation: str, move: str) -> None:
        """A forced move (`run.explore`): a script keeps no conversation."""

    def act_held(self, observation: str, moves: Sequence[str]) -> str:
        """A forced move (`run.explore`, trained): a script plays the first of `moves` (it is given one)."""
        return list(moves)[0]
