"""`SwarmClient`: the typed, thread-safe HTTP client of one swarm server.

A training script needs four calls::

    from marl import SwarmClient

    client = SwarmClient("http://gpu-box:8000")                      # admin token from $MARL_ADMIN_TOKEN
    client.auto_sync_train_config_and_start_engine({"batch_size": 8, "num_repeat": 4})

    def rollout(task):
        with client.episode(task) as ep:                              # begins a lease; aborts it if the body raises
            oai = ep.openai(agent="solver")                           # OpenAI SDK bound to this lease
            reply = oai.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": task.prompt}])
            ep.reward = score(task, reply.choices[0].message.content)  # ended with this reward on exit

The call style of AgentJet's swarm API works unchanged::

    episode_id, lease = client.begin_episode()
    try:
        output = run_agent(task, lease.base_url, lease.api_key)       # any object with `.reward`
        client.end_episode(task, episode_id, output)
    except Exception:
        client.abort_episode(episode_id)
        raise

Waiting and retrying. A refusal whose `error.retry_after_s` is set (the engine is BOOTING, ROLLING_POST or
WEIGHT_SYNCING, every lease slot is busy, or an end or prepare found the episode's own model call still generating
past the server's wait: `calls_in_flight`) is temporary: the call retries with exponential backoff (starting at
`retry_after_s`, capped at 5 s, with jitter) until its `timeout`, then raises `SwarmTimeout`. Any other error raises at
once (`SwarmRefused` for a 4xx, `SwarmError` otherwise); its `.code` is the server's `ErrorCode`: branch on that,
never on the message text. Transport errors (connection refused or reset, timeouts) are retried the same way on
idempotent calls: GETs, begin, config, stop, renew, and end, prepare and commit, which the server answers with the
stored outcome when it had already acted on the same request (`replayed`). Abort and start are retried only when the
request provably never left this machine (connection refused, connect or pool timeout).

A game spanning several servers commits with `prepare_episode` on each, then `commit_episode` on each (two-phase
commit; `marl.transaction.two_phase` drives it with the coordinator's decision log).

Thread safety: one `httpx.Client` (thread-safe) is shared by every thread; a `SwarmClient` holds no per-episode state,
so any number of threads may begin, end and abort episodes concurrently.

The package, one concern a module (httpx's layering: a transport core, the API on top, a documented error tree):

| module | owns |
|---|---|
| `errors.py` | `SwarmError` / `SwarmRefused` / `SwarmTimeout`, and how a server's refusal maps to them (with a hint) |
| `core.py` | `ClientCore`: the pooled `httpx.Client` (`connection_limits`), the admin token, timeouts, the retry loop |
| `control.py` | `ControlPlane`: config sync, engine start and stop, status, pool, monitor, health, frozen policies |
| `leases.py` | `LeaseCalls`: begin, end, prepare, commit, abort, renew and state of a lease; its OpenAI clients |
| `output.py` | `EpisodeOutput`, and the task id and rewards read from what `end_episode` is given |
| `episode.py` | `Episode`: one lease as a context manager, with an optional heartbeat |
| `swarm_client.py` | `SwarmClient`, composed of `ControlPlane` and `LeaseCalls` (one public class, as before) |

Everything is imported from here, `marl.client` (or from `marl`); the modules are the layout, not the API. Every
module logs to the one logger `marl.client`.
"""

from __future__ import annotations

from marl.client.core import connection_limits
from marl.client.episode import Episode
from marl.client.errors import SwarmError, SwarmRefused, SwarmTimeout
from marl.client.output import EpisodeOutput
from marl.client.swarm_client import SwarmClient
from marl.protocol import ADMIN_TOKEN_ENV, RUNNING_STATES

__all__ = [
    "ADMIN_TOKEN_ENV",
    "RUNNING_STATES",
    "Episode",
    "EpisodeOutput",
    "SwarmClient",
    "SwarmError",
    "SwarmRefused",
    "SwarmTimeout",
    "connection_limits",
]
