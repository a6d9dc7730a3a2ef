"""AgentScope agents that play games through the coordinator, each role tagged so its server records it.

    from marl.agents.agentscope import Fallback, agentscope_players
    coordinator = Coordinator(..., player_factory=agentscope_players(fallback=Fallback(url, "qwen")))

- `role_model(seat, fallback)`: the role-tagged model factory. An AgentScope `OpenAIChatModel` on the endpoint of the
  server playing the seat's role (for a trainable server: this game's lease), its client sending the role as the
  `X-Marl-Agent` header (set once, on the client's default headers), so the server records the calls under that
  role; with the seat's `max_tokens` and `temperature`. A seat no server plays (a role the topology scripts) gets
  the `fallback`: any OpenAI-compatible endpoint; nothing it generates is trained on.
- `AgentScopePlayer`: one AgentScope 2.x `Agent` (the ReAct agent, renamed in 2.0) behind the synchronous
  `act(observation) -> reply` the coordinator calls. The agent's async `reply` runs on an event loop the player owns
  (the coordinator builds and plays each game's players in one thread); `close()` closes the model's connections
  and the loop at the end of the game.
- `agentscope_players(fallback)`: a `player_factory` for `marl.transaction.coordinator.Coordinator`: AgentScope agents
  on every seat a server plays; scripted seats get the fallback, or stay scripted by the env when there is none.

What AgentScope sends, and why it matters for training (checked against agentscope 2.0.10). The swarm server merges
one agent's calls into one training sample when each call's prompt extends the previous call's prompt + completion
(`servers/episodes/samples.py`). With `OpenAIChatFormatter` (used here), call k sends the system prompt, then every
observation as a `user` message and every earlier reply, verbatim, as an `assistant` message, then the new
observation: the previous prompt + completion is a prefix, so a seat's calls of one game merge into one sample,
exactly as with `marl.agents.LLMAgent`. (Messages also carry a `name`: "game" for observations, the env agent for
replies; chat templates ignore it.) The multi-agent formatters (`OpenAIMultiAgentFormatter`) instead fold the whole
history, replies included, into one user message ("# Conversation History ... <history>game: ...\nplayer_3: ...
</history>"), so no call extends the previous one: every turn would be a sample of its own, its earlier replies
re-sent as plain context. Details kept deliberately:
- Runtime-state injection is off (`InjectionConfig(inject_runtime_state=False)`): by default AgentScope appends the
  current date and time to the conversation (a `<system-reminder>` user turn), so prompts would depend on the clock.
- No tools, `max_iters=1`: one model call per observation (a text reply ends AgentScope's ReAct loop at once).
- An empty reply is kept as an empty assistant turn (AgentScope would drop it from the history, so the next prompt
  would not extend this one).
- AgentScope compresses the history (rewriting it, with the current time in the compression prompt) only past 80% of
  the model's `context_size` (AgentScope's default 128k tokens, estimated): far beyond what a game here sends.
- Lease endpoints get no client retries: a retried call could be recorded twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

try:
    from agentscope.agent import Agent, InjectionConfig, ReActConfig
    from agentscope.credential import OpenAICredential
    from agentscope.formatter import OpenAIChatFormatter
    from agentscope.message import TextBlock, UserMsg
    from agentscope.model import OpenAIChatModel
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("marl.agents.agentscope needs AgentScope: pip install -e '.[agentscope]'") from exc

from marl.games.table import Seat, default_player
from marl.protocol import agent_headers

__all__ = ["AgentScopePlayer", "Fallback", "agentscope_players", "role_model"]

#: The sender name of observations in the agent's history.
OBSERVER_NAME = "game"


@dataclass(frozen=True)
class Fallback:
    """Any OpenAI-compatible endpoint, for seats no server plays (nothing it generates is trained on)."""

    base_url: str
    model: str
    api_key: str = "none"


def role_model(seat: Seat, fallback: Fallback | None = None) -> OpenAIChatModel:
    """An AgentScope chat model for `seat`: its server's endpoint (or `fallback` if no server plays it), role-tagged."""
    if seat.server is not None:
        base_url, model, api_key, retries = seat.base_url, seat.model, seat.api_key, 0 if seat.trainable else 2
    elif fallback is not None:
        base_url, model, api_key, retries = fallback.base_url, fallback.model, fallback.api_key, 2
    else:
        raise ValueError(f"{seat.agent} ({seat.role}) is played by no server: pass a fallback model for it")
    return OpenAIChatModel(
        credential=OpenAICredential(api_key=api_key, base_url=base_url),
        model=model,
        parameters=OpenAIChatModel.Parameters(max_tokens=seat.max_tokens, temperature=seat.temperature,
                                              top_p=seat.top_p),
        extra_body={"stop": list(seat.stop)} if seat.stop else None,  # Parameters has no stop
        stream=False,
        max_retries=retries,
        formatter=OpenAIChatFormatter(),  # system/user/assistant turns: see the module docstring
        client_kwargs={"default_headers": agent_headers(seat.agent_tag), "max_retries": 0, "timeout": 600},
    )


class AgentScopePlayer:
    """Plays one seat for one game with an AgentScope `Agent`; `act(observation)` returns the reply text."""

    def __init__(self, seat: Seat, model: OpenAIChatModel, *, max_iters: int = 1):
        self.seat, self.model, self.max_iters = seat, model, max_iters
        self._loop = asyncio.new_event_loop()
        self.agent = self._new_agent()

    def _new_agent(self) -> Agent:
        return Agent(
            name=self.seat.agent,
            system_prompt=self.seat.system_prompt,
            model=self.model,
            react_config=ReActConfig(max_iters=self.max_iters),
            injection_config=InjectionConfig(inject_runtime_state=False),  # no clock in prompts
        )

    def reset(self) -> None:
        """Forget the conversation (a new game)."""
        self.agent = self._new_agent()

    def act(self, observation: str) -> str:
        reply = self._loop.run_until_complete(self.agent.reply(UserMsg(name=OBSERVER_NAME, content=str(observation))))
        text = reply.get_text_content() or ""
        if not text:
            self._keep_empty_turn()
        return text

    __call__ = act

    def _keep_empty_turn(self) -> None:
        """AgentScope leaves an empty reply out of its history (and so out of the next prompt, which then would not
        extend this call); record it as an empty assistant turn, as `LLMAgent` does."""
        self.agent.state.append_context(self.agent.name, [TextBlock(text="")])

    def close(self) -> None:
        """Close the model's HTTP connections and the event loop (the coordinator calls it when the game ends)."""
        if self._loop.is_closed():
            return
        try:
            self._loop.run_until_complete(self.model.client.close())
        finally:
            self._loop.close()


def agentscope_players(fallback: Fallback | None = None, *, max_iters: int = 1) -> Callable[[Seat], Any]:
    """A `Coordinator` player factory: an AgentScope agent on every seat a server plays; a scripted seat gets the
    `fallback` model, or stays scripted by the env without one."""

    def player(seat: Seat) -> Any:
        if seat.server is None and fallback is None:
            return default_player(seat)
        return AgentScopePlayer(seat, role_model(seat, fallback), max_iters=max_iters)

    return player
