"""What an episode reports at its end: `EpisodeOutput`, and the task id and rewards read from what a caller passes.

`end_episode` and `prepare_episode` take a task as a string, a number, an object with `.task_id` / `.id` or a mapping
with those keys (`task_id_of`), and an output as a float, an `EpisodeOutput`, any object with `.reward` (AgentJet's
`WorkflowOutput`) or a mapping (`output_fields`). Both are checked here, before any request is sent: a bad argument
raises `TypeError` / `ValueError` and leaves the lease as it was.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic_core import to_jsonable_python


@dataclass
class EpisodeOutput:
    """What `end_episode` reports. A bare float means `EpisodeOutput(reward=that_float)`.

    `agent_rewards` gives a different reward per agent tag (`X-Marl-Agent`); agents not listed get `reward`.
    `metadata` is stored with the episode (shown by the episode viewer); values that are not JSON become strings.
    Any object with a `.reward` attribute (and optionally `.agent_rewards`, `.metadata`) is accepted in its place,
    so AgentJet's `WorkflowOutput` works as is.
    """

    reward: float
    agent_rewards: dict[str, float] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def task_id_of(task: Any) -> str:
    """A task id from a string, a number, an object with `.task_id` / `.id`, or a mapping with those keys."""
    if isinstance(task, str):
        task_id = task
    elif isinstance(task, int) and not isinstance(task, bool):
        task_id = str(task)
    elif isinstance(task, Mapping):
        value = task.get("task_id", task.get("id"))
        if value is None:
            raise TypeError(f"task mapping has neither 'task_id' nor 'id' key (keys: {sorted(map(str, task))})")
        task_id = str(value)
    else:
        value = getattr(task, "task_id", None)
        if value is None:
            value = getattr(task, "id", None)
        if value is None:
            raise TypeError(
                f"cannot get a task id from {type(task).__name__!r}: pass a string, or an object with a "
                "`task_id` (or `id`) attribute"
            )
        task_id = str(value)
    if not task_id:
        raise ValueError("task id is empty: episodes of the same task form a GRPO group, so the id must be non-empty")
    return task_id


def _reward(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)  # numpy / torch scalars
        except (TypeError, ValueError):
            raise TypeError(f"{what} must be a number, got {type(value).__name__!r} ({value!r})") from None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{what} is {value}: rewards must be finite (abort the episode instead of reporting it)")
    return value


def output_fields(output: Any) -> tuple[float, dict[str, float] | None, dict[str, Any]]:
    """(reward, agent_rewards, metadata) from a number, an `EpisodeOutput`, any object with `.reward`, or a mapping."""
    if isinstance(output, (int, float)) and not isinstance(output, bool):
        return _reward(output, "reward"), None, {}
    if isinstance(output, Mapping):
        if "reward" not in output:
            raise TypeError(f"output mapping has no 'reward' key (keys: {sorted(map(str, output))})")
        reward, agent_rewards, metadata = output["reward"], output.get("agent_rewards"), output.get("metadata")
    elif hasattr(output, "reward"):
        reward = output.reward
        agent_rewards = getattr(output, "agent_rewards", None)
        metadata = getattr(output, "metadata", None)
    else:
        raise TypeError(
            f"cannot get a reward from {type(output).__name__!r}: pass a float, an EpisodeOutput, or any object "
            "with a `.reward` attribute"
        )
    if reward is None:
        raise ValueError("output.reward is None: set a reward, or call abort_episode() to discard the episode")
    rewards = None
    if agent_rewards is not None:
        if not isinstance(agent_rewards, Mapping):
            raise TypeError(f"agent_rewards must map agent tag -> reward, got {type(agent_rewards).__name__!r}")
        rewards = {str(k): _reward(v, f"agent_rewards[{k!r}]") for k, v in agent_rewards.items()}
    meta: dict[str, Any] = {}
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise TypeError(f"metadata must be a mapping, got {type(metadata).__name__!r}")
        meta = to_jsonable_python(dict(metadata), fallback=str)  # non-JSON values -> str; inf/nan -> null
    return _reward(reward, "reward"), rewards, meta
