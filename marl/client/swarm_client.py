"""`SwarmClient`, the one public client class: the control plane and the lease calls on one transport core.

It adds nothing but `episode()` (which joins the lease calls to the `Episode` context manager) to the parts it is
composed of, each in its own module:

- `core.py` `ClientCore`: the constructor, the pooled `httpx.Client`, the admin token, the retry loop, `close()`;
- `control.py` `ControlPlane`: config sync, engine start and stop, status, pool, monitor, health, frozen policies;
- `leases.py` `LeaseCalls`: begin, end, prepare, commit, abort, renew, state, and a lease's OpenAI clients.
"""

from __future__ import annotations

from typing import Any

from marl.client.control import ControlPlane
from marl.client.episode import Episode
from marl.client.leases import LeaseCalls


class SwarmClient(ControlPlane, LeaseCalls):
    """Client of ONE swarm server: control plane (config, start/stop, status, pool) and episode leases.

    `url` is the server's root (e.g. "http://gpu-box:8000"). `admin_token` defaults to `$MARL_ADMIN_TOKEN`.
    `client_id` identifies this client as the holder of the leases it begins (only it may end or abort them); it
    defaults to a fresh random id. `timeout` bounds one HTTP request, and is the default time budget of calls that
    do not wait for the server (status, end, abort, ...); `max_wait_s` is the default budget of calls that do
    (begin_episode, wait_until_state, auto_sync_train_config_and_start_engine). Every call takes `timeout=` to
    override its budget.
    """

    def episode(
        self, task: Any, *, timeout: float | None = None, heartbeat_s: float | None = None, policy: str | None = None
    ) -> Episode:
        """Context manager: begin a lease on enter, end or abort it on exit. A crash never leaks a lease.

        Inside the block set `ep.reward` (and optionally `ep.agent_rewards`, `ep.metadata`): the episode is ended
        with it on a normal exit. Or call `ep.end(output)` yourself. If the block raises, the episode is aborted and
        the exception propagates; if it exits without a reward, the episode is aborted with a warning.
        `heartbeat_s` renews the lease in the background every that many seconds (for agents that think long
        between model calls). `timeout` bounds the wait for the lease. `policy`: as in `begin_episode`.
        """
        return Episode(self, task, timeout=timeout, heartbeat_s=heartbeat_s, policy=policy)
