"""One generation on the data plane, whatever API asked for it: run the engine, record exactly what it produced.

Every data-plane API (chat completions and the APIs translated to it, and `/v1/completions`) ends here, so there is
one engine call path and one recording path: the prompt ids given, the generated ids and their logprobs as the engine
returned them, the policy version, the agent tag, recorded on the call's session (its lease) once it finishes.

`engine_s` is the wall time the engine took (from asking it for the generation to its last token: waiting for a slot
or a weight swap, prefill, decode), which a non-streaming chat completion reports in its `Server-Timing` header beside
the server's own time on the call (`server_timing`, `marl.protocol.SERVER_TIMING_HEADER`).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Protocol

from marl import protocol as p
from marl.protocol import EngineState, ErrorCode
from servers.backends import InferenceEngine, SamplingParams
from servers.calls.chat_format import ChatFormatter
from servers.episodes.samples import CallRecord
from servers.errors import Refusal
from servers.metrics.telemetry import Telemetry


class ServedModel(Protocol):
    """What the data plane reads of whatever serves the model (the engine lifecycle, or a static server)."""

    model: str  # as configured (an alias or a path): accepted as a request's `model` too, never shown
    served_name: str
    state: EngineState
    policy_version: int
    engine: InferenceEngine | None
    formatter: ChatFormatter | None


class CallSession(Protocol):
    """What a call runs under: its lease on a trainable server (`servers.episodes.leases.Lease`), nothing on a static
    one."""

    calls: list[CallRecord]  # earlier calls, for prompt splicing

    def busy(self) -> AbstractContextManager[None]:
        """Entered while the engine generates for the call."""

    def record(self, call: CallRecord) -> bool:
        """Keep the finished call; False if it came too late (the lease died meanwhile)."""


class CallService(Protocol):
    """What a call reads of the service that started it (`servers.calls.chat.ChatService`)."""

    model: ServedModel
    telemetry: Telemetry

    def finished(self, session: CallSession, call: CallRecord) -> None:
        """Count the finished call and record it on its session."""


class NonFiniteOutput(RuntimeError):
    """The engine gave a NaN or infinite logprob: the weights overflow (a frozen adapter of huge values). Such a
    token can be neither sent (JSON has no NaN) nor trained on, so the call fails there and is never recorded."""

    def __init__(self, token_index: int):
        super().__init__(f"the logprob of generated token {token_index} is not finite (NaN or inf): its weights"
                         " overflow (docs/lora-policies.md, 'Adapters whose weights overflow'); the call is not"
                         " recorded")


class EngineCall:
    """Runs the engine for one call (the session counts as busy meanwhile) and records the call once it finishes."""

    def __init__(self, service: CallService, session: CallSession, prompt_ids: list[int], params: SamplingParams,
                 agent: str):
        self.service, self.session = service, session
        if params.affinity is None:  # a lease's calls share one replica's prefix cache (SamplingParams.affinity)
            params = replace(params, affinity=getattr(session, "episode_id", None))
        self.prompt_ids, self.params, self.agent = prompt_ids, params, agent
        model = service.model
        self.engine, self.formatter, self.model_name = model.engine, model.formatter, model.served_name
        self._model = model
        #: The version of the weights that generate the call: read again at its first token (with `overlap` the
        #: weights may change while a call waits; never while it generates: engines swap between generations).
        self.version = model.policy_version
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish = "length"
        self.engine_s = 0.0  # wall seconds inside the engine's generate (module docstring)

    async def chunks(self) -> AsyncIterator[list[int]]:
        """The generated ids as they come; the call is recorded once the engine finishes."""
        with self.session.busy(), self.service.telemetry.generation.generating():
            first, started = True, time.perf_counter()
            async for chunk in self.engine.generate(self.prompt_ids, self.params):
                if first:
                    self.version, first = self._model.policy_version, False
                if not math.isfinite(sum(chunk.logprobs, 0.0)):  # finite exactly when every term is
                    raise NonFiniteOutput(len(self.ids) + next(
                        i for i, x in enumerate(chunk.logprobs) if not math.isfinite(x)))
                self.ids += chunk.token_ids
                self.logprobs += chunk.logprobs
                if chunk.finish_reason:
                    self.finish = chunk.finish_reason
                self.engine_s = time.perf_counter() - started
                yield chunk.token_ids
        self.service.finished(self.session, CallRecord(
            agent=self.agent, prompt_ids=self.prompt_ids, completion_ids=self.ids, logprobs=self.logprobs,
            policy_version=self.version))

    async def run(self) -> None:
        """The whole generation; a failure is a `Refusal` (500 `engine_error`)."""
        try:
            async for _ in self.chunks():
                pass
        except Refusal:  # refused before generating (its lease was sealed meanwhile): not an engine failure
            raise
        except Exception as exc:
            raise self.failed(exc) from exc

    def failed(self, exc: Exception) -> Refusal:
        """A failed generation, kept in the server's error log too: `last_error` then says why (a dead engine). A
        `Refusal` (the call was refused before it generated) is passed on as it is."""
        if isinstance(exc, Refusal):
            return exc
        if isinstance(exc, NonFiniteOutput):
            refusal = Refusal(500, ErrorCode.NON_FINITE_OUTPUT, f"model {self.model_name}: {exc}")
        else:
            refusal = Refusal(500, ErrorCode.ENGINE_ERROR, f"generation failed: {exc}")
        self.service.telemetry.errors.report(refusal.message)
        return refusal

    def server_timing(self, received_at: float) -> str:
        """The `Server-Timing` header value of the finished call (`marl.protocol.SERVER_TIMING_HEADER`): the engine's
        wall time and the server's own since `received_at` (`time.perf_counter()`), in milliseconds."""
        marl_s = max(0.0, time.perf_counter() - received_at - self.engine_s)
        return f"{p.TIMING_ENGINE};dur={self.engine_s * 1000:.3f}, {p.TIMING_MARL};dur={marl_s * 1000:.3f}"

    def usage(self) -> p.Usage:
        return p.Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.ids),
                       total_tokens=len(self.prompt_ids) + len(self.ids))
