"""The control plane of `SwarmClient`: config sync, engine start and stop, status, pool, health, frozen policies.

`ControlPlane` is a mixin of `ClientCore` (`marl/client/core.py`: every call goes through its retry loop). These
calls act on the server, not on one episode; most need the admin token. `auto_sync_train_config_and_start_engine`
is the one idempotent way to make a server train a config whatever state it is in, safe to run from every client;
`wait_until_state` polls the status until the engine reaches a state, and says why when a boot fails.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import httpx

from marl.client.core import ClientCore
from marl.client.errors import SwarmError, SwarmRefused, SwarmTimeout
from marl.protocol import (
    ROUTE_CONFIG,
    ROUTE_FROZEN,
    ROUTE_FROZEN_ONE,
    ROUTE_HEALTH,
    ROUTE_MONITOR,
    ROUTE_POOL,
    ROUTE_START,
    ROUTE_STATUS,
    ROUTE_STOP,
    RUNNING_STATES,
    ConfigResponse,
    EngineState,
    ErrorCode,
    ErrorInfo,
    FrozenPolicy,
    FrozenPolicyList,
    LoadFrozenPolicyRequest,
    MonitorSnapshot,
    PoolInfo,
    ServerStatus,
    TrainConfig,
)

log = logging.getLogger("marl.client")


class ControlPlane(ClientCore):
    """The server's control plane (config, engine, status, pool, frozen policies); see `SwarmClient`."""

    def health(self, timeout: float | None = None) -> bool:
        """True if the server answers its health check (no auth, no retry)."""
        try:
            resp = self._http.get(ROUTE_HEALTH, timeout=timeout or self.timeout)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    def status(self, *, timeout: float | None = None) -> ServerStatus:
        """Engine state, model, policy version, pool and metrics."""
        return self._call("GET", ROUTE_STATUS, ServerStatus, what="status", params=self._policy_params,
                          timeout=timeout)

    def pool(self, *, timeout: float | None = None) -> PoolInfo:
        """How far the rollout pool is from the next training step, and which leases are running."""
        return self._call("GET", ROUTE_POOL, PoolInfo, what="pool", params=self._policy_params, timeout=timeout)

    def monitor(self, *, timeout: float | None = None) -> MonitorSnapshot:
        """Everything `marl overwatch` shows: status, detailed pool, recent steps, tokens/s, latest errors."""
        return self._call("GET", ROUTE_MONITOR, MonitorSnapshot, what="monitor", params=self._policy_params,
                          timeout=timeout)

    def sync_train_config(
        self, config: TrainConfig | Mapping[str, Any], *, timeout: float | None = None
    ) -> ConfigResponse:
        """Send the full training config. Validated here first, so a typo in a key fails before any request.

        Raises `SwarmRefused` (409) if the engine is not OFFLINE and runs a different config.
        """
        cfg = self._as_config(config)
        return self._call(
            "POST", ROUTE_CONFIG, ConfigResponse, what="sync_train_config", json=cfg.model_dump(mode="json"),
            params=self._policy_params, timeout=timeout,
        )

    def start_engine(self, *, timeout: float | None = None) -> ServerStatus:
        """OFFLINE -> BOOTING (returns at once; see `wait_until_state`). 409 `engine_not_offline` otherwise."""
        return self._call("POST", ROUTE_START, ServerStatus, what="start_engine", retry="unsent",
                          params=self._policy_params, timeout=timeout)

    def stop_engine(self, *, timeout: float | None = None) -> ServerStatus:
        """Stop the engine (any state -> OFFLINE). This stops training for every client of this server."""
        return self._call("POST", ROUTE_STOP, ServerStatus, what="stop_engine", params=self._policy_params,
                          timeout=timeout)

    def load_frozen_policy(self, name: str, adapter: str | None, *, policy_version: int | None = None,
                           timeout: float | None = None) -> FrozenPolicy:
        """Serve a past adapter of one of the server's LoRA policies as frozen policy `name` (`speaker@3`): calls
        with `model=name` and the returned `api_key` at the server's /v1 run it, unrecorded. `adapter`: a PEFT
        adapter directory on the server's filesystem (None: the base model, a fresh adapter's outputs). Waits for
        the engine (up to `timeout`, default `max_wait_s`); loading the same name and adapter again is a no-op."""
        body = LoadFrozenPolicyRequest(name=name, adapter=adapter, policy_version=policy_version)
        return self._call("POST", ROUTE_FROZEN, FrozenPolicy, what="load_frozen_policy",
                          json=body.model_dump(mode="json"), timeout=self.max_wait_s if timeout is None else timeout)

    def frozen_policies(self, *, timeout: float | None = None) -> list[FrozenPolicy]:
        """The frozen policies the server's engine serves now (none after the engine restarted)."""
        return self._call("GET", ROUTE_FROZEN, FrozenPolicyList, what="frozen_policies", timeout=timeout).data

    def unload_frozen_policy(self, name: str, *, timeout: float | None = None) -> list[FrozenPolicy]:
        """Stop serving frozen policy `name` (its engine slot is freed once its calls finished); the ones left.
        `SwarmRefused` 404 `frozen_policy_not_found` if it is not loaded."""
        path = ROUTE_FROZEN_ONE.format(name=name)
        return self._call("DELETE", path, FrozenPolicyList, what="unload_frozen_policy", timeout=timeout).data

    def wait_until_state(
        self, *states: EngineState | str, timeout: float | None = None, poll_s: float = 1.0
    ) -> ServerStatus:
        """Poll the status until the engine is in one of `states` (default: any running state); return that status.

        Raises `SwarmTimeout` after `timeout` (default `max_wait_s`), and `SwarmError` if the engine falls from
        BOOTING back to OFFLINE while OFFLINE is not one of `states` (the boot failed: the error says why).
        """
        wanted = {_state(s) for s in states} if states else set(RUNNING_STATES)
        names = "/".join(sorted(s.value for s in wanted))
        budget = self.max_wait_s if timeout is None else timeout
        start = time.monotonic()
        deadline = start + budget
        pause = min(0.05, poll_s)
        seen_booting = False
        while True:
            st = self.status(timeout=max(deadline - time.monotonic(), 0.0))
            if st.state in wanted:
                return st
            if st.state is EngineState.BOOTING:
                seen_booting = True
            elif st.state is EngineState.OFFLINE and seen_booting:
                raise SwarmError(
                    f"wait for {names}: the engine at {self.url} went from BOOTING back to OFFLINE "
                    f"(last error: {st.last_error or 'none reported'}). Check the server log, fix the cause "
                    "(model path, memory, ...), then start it again.",
                    what="wait_until_state",
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SwarmTimeout(
                    f"wait for {names}: the engine at {self.url} is still {st.state.value} after "
                    f"{time.monotonic() - start:.1f}s (timeout={budget}s). Pass a larger timeout= (or max_wait_s=), "
                    "or check the server with `marl status`.",
                    waited_s=time.monotonic() - start, last_state=st.state, what="wait_until_state",
                )
            time.sleep(min(pause, remaining))
            pause = min(pause * 1.5, poll_s)

    def auto_sync_train_config_and_start_engine(
        self, config: TrainConfig | Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> ServerStatus:
        """Make the server train `config`, whatever state it is in; idempotent, safe to run from every client.

        - OFFLINE: sync the config, start the engine, wait until it runs.
        - BOOTING: check the config is the same, wait until it runs.
        - ROLLING / ROLLING_POST / WEIGHT_SYNCING with the same config: nothing to do.
        - running with a different config: raises `SwarmRefused` (call `stop_engine()` first, deliberately).
        - STATIC: raises `SwarmRefused` (a static server serves a fixed model and trains nothing).

        Returns the status once the engine runs. `config=None` means the server's defaults (`TrainConfig()`).
        """
        cfg = self._as_config(config if config is not None else TrainConfig())
        budget = self.max_wait_s if timeout is None else timeout
        deadline = time.monotonic() + budget

        def remaining() -> float:
            return max(deadline - time.monotonic(), 0.0)

        booted = False  # a boot was started by this call, or waited out: OFFLINE now means it failed
        while True:
            st = self.status(timeout=remaining())
            if st.static or st.state is EngineState.STATIC:
                raise self._static_refusal(st)
            if st.state in RUNNING_STATES:
                self._check_same_config(cfg, st, remaining())
                return st
            if st.state is EngineState.BOOTING:
                self._check_same_config(cfg, st, remaining())
                self.wait_until_state(*RUNNING_STATES, EngineState.OFFLINE, timeout=remaining())
                booted = True
                continue  # re-check: running (another client may have reconfigured it meanwhile) or failed
            if st.state is EngineState.OFFLINE:
                if booted:  # never restart a failing boot in a loop
                    raise SwarmError(
                        f"auto_sync_train_config_and_start_engine: the engine at {self.url} fell back to OFFLINE "
                        f"after booting (last error: {st.last_error or 'none reported'}). Check the server log, fix "
                        "the cause (model path, memory, ...), then run this again.",
                        what="auto_sync_train_config_and_start_engine",
                    )
                self.sync_train_config(cfg, timeout=remaining())
                try:
                    self.start_engine(timeout=remaining())
                    booted = True
                except SwarmRefused as exc:
                    if exc.code is not ErrorCode.ENGINE_NOT_OFFLINE:
                        raise
                    log.info("start_engine on %s raced with another client (already started); re-checking", self.url)
                continue
            raise SwarmError(f"auto_sync_train_config_and_start_engine: unexpected engine state {st.state}")

    def _static_refusal(self, st: ServerStatus) -> SwarmRefused:
        message = (
            f"auto_sync_train_config_and_start_engine: {self.url} is a STATIC server (it serves {st.model!r} without "
            "training). Do not sync a train config to it; call its model directly."
        )
        error = ErrorInfo(message=message, code=ErrorCode.STATIC_SERVER.value, state=st.state)
        return SwarmRefused(message, error=error, what="auto_sync_train_config_and_start_engine")

    def _check_same_config(self, cfg: TrainConfig, st: ServerStatus, timeout: float) -> None:
        """Sync `cfg` to a started engine: accepted only if it equals the running config (the server compares the
        validated configs, so an AgentJet-style flat `learning_rate` equals the same value given in `grpo`)."""
        try:
            self.sync_train_config(cfg, timeout=timeout)
        except SwarmRefused as exc:
            if exc.code is not ErrorCode.ENGINE_NOT_OFFLINE:
                raise
            raise SwarmRefused(
                f"auto_sync_train_config_and_start_engine: the engine at {self.url} is {st.state.value} with a "
                f"different train config ({exc.error.message if exc.error else exc}). To change it, call "
                "stop_engine() first (this stops training for every client of this server), then run this again; "
                "or sync the same config the server runs.",
                status_code=409, error=exc.error, what="auto_sync_train_config_and_start_engine",
            ) from exc

    @staticmethod
    def _as_config(config: TrainConfig | Mapping[str, Any]) -> TrainConfig:
        if isinstance(config, TrainConfig):
            return config
        if isinstance(config, Mapping):
            return TrainConfig.model_validate(dict(config))  # ValidationError names the bad key
        raise TypeError(f"config must be a TrainConfig or a dict of its fields, got {type(config).__name__!r}")


def _state(value: EngineState | str) -> EngineState:
    try:
        return EngineState(value.upper() if isinstance(value, str) else value)
    except ValueError:
        raise ValueError(f"unknown engine state {value!r}; one of {[s.value for s in EngineState]}") from None
