"""Frozen policies: past adapters of a server's LoRA policies, served as they were, on the server's one engine.

A `past_of` server whose source is a LoRA policy (`past_of: {server: team, policy: speaker}`) plays that policy's
past selves. They are adapters, so the server of policies serves them itself, next to the live ones: `marl run`
loads each snapshot as a *frozen policy* (`POST /control/frozen {name: speaker@3, adapter: .../step_3/adapter}`)
into the shared engine, which batches its calls with everyone else's. No model is loaded again; an adapter takes one
slot of the engine's adapter stacks (`InferenceEngine.unload_adapter` frees it once the league retires it).

A frozen policy is never trained and never recorded: its calls run unleased, like a static server's
(`servers.calls.chat.Unleased`), under the one key the load route hands out (`FrozenPolicy.api_key`), and the
request's `model` picks the frozen policy. Its name holds `FROZEN_SEPARATOR` (`speaker@3`), which no policy name
does, so it never shadows a live policy's adapter. Version 0 (a fresh adapter: B = 0) serves the base alone
(`adapter: null`): the same tokens, and no slot.

A load reads the adapter's files itself, off the event loop and within a time bound, and refuses (400, naming the
file) a malformed directory, a file that is no regular file, and weights that are not finite
(`servers.policies.adapter_files`): one bad adapter never reaches the engine that serves every policy.

Frozen policies live in the engine: when the engine restarts (stop, then start) they are gone, and the list says
so; the league loads them again.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path

from marl import protocol as p
from marl.protocol import FROZEN_KEY_PREFIX, EngineState, ErrorCode
from servers.backends import GenerationChunk, InferenceEngine, SamplingParams
from servers.calls.chat import CallSession, ChatService, Unleased
from servers.calls.chat_format import ChatFormatter
from servers.errors import Refusal, excerpt
from servers.metrics.telemetry import Telemetry
from servers.policies.adapter_files import AdapterProblem, read_adapter_within
from servers.policies.views import Shared


class FrozenEngine(InferenceEngine):
    """A frozen policy's view of the shared engine: every generation with its adapter (None: the base alone)."""

    def __init__(self, engine: InferenceEngine, adapter: str | None) -> None:
        self._engine, self.adapter = engine, adapter
        self.tokenizer, self.context_length = engine.tokenizer, engine.context_length
        self.eos_token_ids, self.takes_tensors = engine.eos_token_ids, engine.takes_tensors

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        return self._engine.generate(prompt_ids, replace(params, adapter=self.adapter))


@dataclass
class _FrozenModel:
    """What the data plane reads of a frozen policy (a `servers.calls.chat.ServedModel`)."""

    served_name: str
    engine: FrozenEngine
    formatter: ChatFormatter
    policy_version: int
    state: EngineState = EngineState.STATIC

    @property
    def model(self) -> str:
        return self.served_name


@dataclass
class _Frozen:
    info: p.FrozenPolicy
    engine: InferenceEngine  # the shared engine it was loaded into: a restarted engine no longer serves it
    service: ChatService


class FrozenPolicies:
    """The frozen policies of one server of policies: load, unload, list, and the service of a call's `model`."""

    def __init__(self, engine: Shared[InferenceEngine], formatter: Callable[[], ChatFormatter | None]) -> None:
        self._engine, self._formatter = engine, formatter
        self.key = FROZEN_KEY_PREFIX + secrets.token_urlsafe(24)
        self.telemetry = Telemetry()  # counted, never recorded
        self._loaded: dict[str, _Frozen] = {}
        self._changing = asyncio.Lock()  # one load or unload at a time

    def live(self) -> dict[str, _Frozen]:
        """The frozen policies the engine running now serves."""
        engine = self._engine.current
        return {name: frozen for name, frozen in self._loaded.items() if frozen.engine is engine}

    def listed(self) -> p.FrozenPolicyList:
        return p.FrozenPolicyList(data=[frozen.info for frozen in self.live().values()])

    def models(self) -> list[p.ModelCard]:
        return [p.ModelCard(id=name, max_model_len=frozen.engine.context_length)
                for name, frozen in self.live().items()]

    async def load(self, body: p.LoadFrozenPolicyRequest) -> p.FrozenPolicy:
        """Serve `body.adapter` as frozen policy `body.name`; the same load again answers the same."""
        async with self._changing:
            engine, formatter = self._ready()
            known = self.live().get(body.name)
            if known is not None:
                if known.info.adapter == body.adapter:
                    return known.info
                raise Refusal(409, ErrorCode.FROZEN_POLICY_EXISTS, f"frozen policy '{body.name}' is loaded from"
                              f" {known.info.adapter or 'the base model'}: unload it first (DELETE"
                              f" {p.ROUTE_FROZEN}/{body.name}), or give this one another name", param="name")
            if body.adapter is not None:
                await self._load_adapter(engine, body.name, Path(body.adapter))
            info = p.FrozenPolicy(name=body.name, adapter=body.adapter, policy_version=body.policy_version,
                                  api_key=self.key)
            model = _FrozenModel(body.name, FrozenEngine(engine, body.name if body.adapter else None), formatter,
                                 body.policy_version or 0)
            self._loaded[body.name] = _Frozen(info, engine, ChatService(model, _no_admission, self.telemetry))
            return info

    async def unload(self, name: str) -> p.FrozenPolicyList:
        """Stop serving frozen policy `name`; its adapter's engine slot is freed once its running calls finished."""
        async with self._changing:
            frozen = self.live().get(name)
            self._loaded.pop(name, None)  # new calls are refused from now on
            if frozen is None:
                raise Refusal(404, ErrorCode.FROZEN_POLICY_NOT_FOUND, f"no frozen policy '{name}' is loaded here"
                              f" (loaded: {', '.join(self.live()) or 'none'})", param="name")
            if frozen.info.adapter is not None:
                await asyncio.to_thread(frozen.engine.unload_adapter, name)
            return self.listed()

    def admit(self, api_key: str | None) -> CallSession | None:
        """An unleased session for the frozen policies' key; None for any other key."""
        if api_key is None or not api_key.startswith(FROZEN_KEY_PREFIX):
            return None
        if not secrets.compare_digest(api_key.encode(), self.key.encode()):
            raise Refusal(401, ErrorCode.INVALID_API_KEY, "unknown key for this server's frozen policies: use the"
                          f" api_key that {p.ROUTE_FROZEN} returned")
        return Unleased()

    def service(self, model: str) -> ChatService:
        """The service of frozen policy `model` (404 `model_not_found` once unloaded)."""
        frozen = self.live().get(model)
        if frozen is None:
            raise Refusal(404, ErrorCode.MODEL_NOT_FOUND, f"model {excerpt(model)} is not served here: the frozen"
                          f" policies are {', '.join(self.live()) or 'none'} (see GET /v1/models)", param="model")
        return frozen.service

    def _ready(self) -> tuple[InferenceEngine, ChatFormatter]:
        engine, formatter = self._engine.current, self._formatter()
        if engine is None or formatter is None:
            raise Refusal(503, ErrorCode.ENGINE_UNAVAILABLE, "no policy's engine runs yet: frozen policies load into"
                          " it once the server is rolling", retry_after_s=2.0)
        return engine, formatter

    @staticmethod
    async def _load_adapter(engine: InferenceEngine, name: str, directory: Path) -> None:
        """Read and check the adapter's files off the event loop, within a time bound (servers.policies.adapter_files),
        then load it: the tensors read, or (an engine in another process) the directory, now known to be sound."""
        try:
            tensors, spec = await read_adapter_within(directory)
        except AdapterProblem as exc:  # it names the file
            raise Refusal(400, ErrorCode.INVALID_REQUEST, f"adapter {exc}", param="adapter") from exc
        try:
            if engine.takes_tensors:
                await asyncio.to_thread(engine.load_adapter, name, tensors, spec)
            else:
                await asyncio.to_thread(engine.load_adapter_from, name, directory)
        except (ValueError, OSError) as exc:  # tensors that do not fit the model
            raise Refusal(400, ErrorCode.INVALID_REQUEST, f"adapter {str(directory)[-200:]}: {str(exc)[:500]}",
                          param="adapter") from exc


def _no_admission(api_key: str | None) -> CallSession:
    raise AssertionError("a frozen policy's calls are admitted by FrozenPolicies.admit")
