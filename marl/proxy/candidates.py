"""Generating candidates: the app's request sent through each lease of a turn, over the swarm server's data plane.

Each call goes to the lease's own OpenAI endpoint with the lease's key (never the app's key, never the admin token),
names the served model whatever model the app asked for, is never streamed (the winner is chosen from complete
answers), and is tagged with the turn's agent tag. Every other field of the app's request goes through unchanged.
"""

from __future__ import annotations

import asyncio

import httpx

from marl.protocol import (
    ROUTE_CHAT,
    ChatCompletionRequest,
    ChatCompletionResponse,
    EpisodeLease,
    ErrorCode,
    agent_headers,
)
from marl.proxy.errors import ProxyError, upstream_error

_CHAT_PATH = ROUTE_CHAT.removeprefix("/v1")  # a lease's base_url ends with /v1


class CandidateCaller:
    def __init__(self) -> None:
        # No read timeout: a long generation is the app's to bound (its own request timeout), not the proxy's.
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))

    async def generate_all(self, leases: list[EpisodeLease], request: ChatCompletionRequest,
                           agent: str) -> list[ChatCompletionResponse]:
        """One answer per lease, in lease order; the first failure cancels the others and is raised."""
        calls = [asyncio.ensure_future(self.generate(lease, request, agent)) for lease in leases]
        try:
            return list(await asyncio.gather(*calls))
        finally:
            for call in calls:
                call.cancel()

    async def generate(self, lease: EpisodeLease, request: ChatCompletionRequest,
                       agent: str) -> ChatCompletionResponse:
        body = request.model_copy(update={"model": lease.model, "stream": False, "stream_options": None})
        try:
            response = await self._http.post(
                lease.base_url + _CHAT_PATH, json=body.model_dump(mode="json", exclude_none=True),
                headers={"Authorization": f"Bearer {lease.api_key}", **agent_headers(agent)})
        except httpx.HTTPError as exc:
            raise ProxyError(502, ErrorCode.ENGINE_ERROR, f"the swarm server did not answer a candidate's call"
                             f" ({type(exc).__name__}: {exc or 'no detail'})") from exc
        if response.is_success:
            return ChatCompletionResponse.model_validate_json(response.content)
        raise upstream_error(response)

    async def close(self) -> None:
        await self._http.aclose()
