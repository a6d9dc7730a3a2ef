"""A trainable server of several LoRA policies on one base model: one learner per policy, one engine, one trainer.

Each policy is a whole `TrainableServer` of its own (its pool, leases, ledger, train loop, policy version, metrics
and checkpoints, under `data_dir/policies/<name>/`), booted on views of the shared engine and trainer
(`servers.policies.views`). So a policy's step drains and pauses only that policy's leases, its groups never hold
another policy's episodes, and a game with two policies of one server commits them as episodes of two servers.

`PolicyServer` is what the routes see: it picks the learner of a call by the `policy` a begin names (or the query
parameter of a control route), and by the policy name that starts every episode id and follows the key prefix in
every key (`POLICY_SEPARATOR`), so an end, a commit or a chat call finds its learner even after a restart.
Past adapters of the policies are served next to them, untrained and unrecorded (`frozen`: servers.policies.frozen).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path

from marl.protocol import (
    EPISODE_KEY_PREFIX,
    POLICY_SEPARATOR,
    EngineState,
    ErrorCode,
    LoraSpec,
    ModelList,
    MonitorSnapshot,
    ServerStatus,
)
from servers.backends import InferenceEngine
from servers.calls.chat import CallSession, ChatService
from servers.errors import Refusal
from servers.metrics.prometheus import render_all
from servers.policies.frozen import FrozenPolicies
from servers.policies.views import PolicyBackends, PolicyTrainerFactory
from servers.trainable_server import TrainableServer


class PolicyServer:
    def __init__(self, *, model: str, served_name: str, policies: Mapping[str, LoraSpec], data_dir: Path,
                 resolve_model: Callable[[str], Path], engine_factory: Callable[[Path], InferenceEngine],
                 trainer_factory: PolicyTrainerFactory, public_url: str | None = None) -> None:  # fmt: skip
        if not policies:
            raise ValueError("a server of policies needs at least one")
        self.model, self.served_name = model, served_name
        backends = PolicyBackends(policies, engine_factory, trainer_factory,
                                  configs=lambda: {name: s.lifecycle.config for name, s in self.policies.items()})
        self.policies: dict[str, TrainableServer] = {
            name: TrainableServer(model=model, served_name=name, data_dir=data_dir / "policies" / name,
                                  resolve_model=resolve_model, engine_factory=backends.engine_factory(name),
                                  trainer_factory=backends.trainer_factory(name), public_url=public_url,
                                  policy=name)
            for name in policies
        }  # fmt: skip
        #: Past adapters served untrained next to the live policies (a league's `past_of` a policy).
        self.frozen = FrozenPolicies(backends.engine, lambda: next(
            (s.lifecycle.formatter for s in self.policies.values() if s.lifecycle.formatter is not None), None))
        self.chat = PolicyChat({name: server.chat for name, server in self.policies.items()}, self.frozen)

    @property
    def state(self) -> EngineState:
        """OFFLINE or BOOTING while any policy is; else ROLLING while any policy rolls; else the first's."""
        states = [server.state for server in self.policies.values()]
        for state in (EngineState.OFFLINE, EngineState.BOOTING):
            if state in states:
                return state
        return EngineState.ROLLING if EngineState.ROLLING in states else states[0]

    def for_policy(self, policy: str | None) -> TrainableServer:
        if policy is None and len(self.policies) == 1:
            return next(iter(self.policies.values()))
        if policy is None:
            raise Refusal(400, ErrorCode.POLICY_REQUIRED, f"this server trains {len(self.policies)} policies"
                          f" ({', '.join(self.policies)}): name one (`policy`)", param="policy")
        if policy not in self.policies:
            raise Refusal(404, ErrorCode.POLICY_NOT_FOUND, f"policy '{policy}' is not trained here; this server"
                          f" trains {', '.join(self.policies)}", param="policy")
        return self.policies[policy]

    def for_episode(self, episode_id: str) -> TrainableServer:
        policy = episode_id.partition(POLICY_SEPARATOR)[0]
        if policy not in self.policies:
            raise Refusal(404, ErrorCode.EPISODE_NOT_FOUND, f"no episode '{episode_id}' on this server: its episode"
                          f" ids start with a policy's name ({', '.join(self.policies)}) and '{POLICY_SEPARATOR}'")
        return self.policies[policy]

    async def startup(self) -> None:
        for server in self.policies.values():
            await server.startup()

    async def shutdown(self) -> None:
        for server in self.policies.values():
            await server.shutdown()

    async def start_engine(self) -> ServerStatus:
        """Start every OFFLINE policy (together: the shared trainer is built with every policy's config)."""
        offline = [server for server in self.policies.values() if server.state == EngineState.OFFLINE]
        if not offline:
            return await next(iter(self.policies.values())).start_engine()  # the usual 409, naming the state
        for server in offline:
            await server.start_engine()
        return await self.status()

    async def stop_engine(self) -> ServerStatus:
        for server in self.policies.values():
            await server.stop_engine()
        return await self.status()

    async def status(self) -> ServerStatus:
        each = dict(zip(self.policies, await asyncio.gather(*(s.status() for s in self.policies.values())),
                        strict=True))  # fmt: skip
        versions = [status.policy_version for status in each.values()]
        errors = [status.last_error for status in each.values() if status.last_error]
        return ServerStatus(state=self.state, model=self.served_name, policy_version=min(versions),
                            generation=max(status.generation for status in each.values()), step=min(versions),
                            static=False, last_error=errors[-1] if errors else None, policies=each)  # fmt: skip

    async def monitor(self) -> MonitorSnapshot:
        """The whole server: every policy's status (`status.policies`), their steps and errors together."""
        by_policy = {name: await server.monitor() for name, server in self.policies.items()}
        steps = [step.model_copy(update={"policy": name}) for name, s in by_policy.items() for step in s.recent_steps]
        errors = [e.model_copy(update={"message": f"{name}: {e.message}"}) for name, s in by_policy.items()
                  for e in s.errors]  # fmt: skip
        snapshots = list(by_policy.values())
        return snapshots[0].model_copy(update={
            "status": await self.status(), "pool": None,
            "recent_steps": sorted(steps, key=lambda r: r.time)[-100:],
            "tokens_per_s": sum(s.tokens_per_s for s in snapshots),
            "errors": sorted(errors, key=lambda e: e.time),
            "training": next((s.training for s in snapshots if s.training is not None), None)})

    async def metrics_text(self) -> bytes:
        return render_all([await server.metrics_reading() for server in self.policies.values()],
                          model=self.served_name)


class PolicyChat:
    """The data plane of a server of policies: a key's policy is in the key, and its learner's service runs it."""

    def __init__(self, services: Mapping[str, ChatService], frozen: FrozenPolicies) -> None:
        self.services, self.frozen = dict(services), frozen

    def admit(self, api_key: str | None) -> tuple[ChatService | None, CallSession]:
        """The learner's service and lease of an episode key; (None, unleased) for the frozen policies' key."""
        unleased = self.frozen.admit(api_key)
        if unleased is not None:
            return None, unleased
        policy = (api_key or "").removeprefix(EPISODE_KEY_PREFIX).partition(POLICY_SEPARATOR)[0]
        service = self.services.get(policy) if api_key and api_key.startswith(EPISODE_KEY_PREFIX) else None
        if service is None:
            raise Refusal(401, ErrorCode.INVALID_API_KEY, "missing or unknown episode key: use the api_key that"
                          " begin_episode returned")
        return service, service.admit(api_key)

    def route(self, admitted: tuple[ChatService | None, CallSession], model: str) -> tuple[ChatService, CallSession]:
        """A key's learner runs its call; the frozen policies' key runs the frozen policy the call's `model` names."""
        service, session = admitted
        return (self.frozen.service(model) if service is None else service), session

    def models(self) -> ModelList:
        return ModelList(data=[card for service in self.services.values() for card in service.models().data]
                         + self.frozen.models())
