"""What a server's Ray actors share (`run.ray`, docs/ray.md): joining the cluster from `marl serve`, and placing an
actor in one bundle of the server's placement group, which `marl run` made (marl.runner.ray_cluster) with the trainer's
ranks (servers.trainers.ray_ranks) and vLLM's replicas after the first (servers.engines.vllm_ray) in it. Only those
two modules import this one, and only under Ray: a server without it never imports ray."""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

__all__ = ["NAMESPACE", "bundles_of", "join", "last_line", "place"]

#: The Ray namespace of everything a marl run makes (actors, placement groups), as marl.runner.ray_cluster's.
NAMESPACE = "marl"


def join(address: str | None) -> None:
    """Join the Ray cluster at `address` (None: this node's) unless this process already has."""
    if not ray.is_initialized():
        # log_to_driver: the members' output (a CUDA or NCCL abort) lands in this server's log, as a subprocess's does
        ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=True)


def bundles_of(group: str) -> list[dict[str, float]]:
    """Each bundle of placement group `group`: 0 the server's, then the trainer's ranks, then vLLM's replicas."""
    return [dict(bundle) for bundle in ray.util.get_placement_group(group).bundle_specs]


def place(actor_class: Any, group: str, index: int, name: str, env_vars: dict[str, str] | None = None) -> Any:
    """`actor_class.options(...)` for one actor named `name` (in marl's namespace) that asks for exactly bundle
    `index` of placement group `group`."""
    placement_group = ray.util.get_placement_group(group)
    bundle = placement_group.bundle_specs[index]
    custom = {key: amount for key, amount in bundle.items() if key not in ("CPU", "GPU", "memory")}
    strategy = PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=index)
    return actor_class.options(name=name, namespace=NAMESPACE, num_cpus=bundle.get("CPU", 0.0),
                               num_gpus=bundle.get("GPU", 0.0), memory=bundle.get("memory"), resources=custom,
                               scheduling_strategy=strategy, runtime_env={"env_vars": env_vars or {}})


def last_line(exc: BaseException) -> str:
    """The last line of a Ray error (its text is often a whole remote traceback)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
