"""Where a local server runs under `run.ray`: its Ray placement group, one description that `marl run`
(marl.runner.ray_cluster) places and `marl plan` reads (docs/ray.md, "Placement groups").

Bundle 0 is the server's own actor (`servers.NAME.resources`: the HTTP server and its inference engine, with the
engine's GPUs; with vLLM replicas, the first replica's); with `train.trainer: fsdp`, bundles 1..N are the trainer's N
ranks, one each (`servers.NAME.rank_resources`, one CPU unless it says otherwise; by default also one GPU when the
server runs on GPUs: `device: cuda`, or no device and `resources` with a GPU). With `engine: vllm` and
`vllm.data_parallel_size: R > 1`, the last R-1 bundles are vLLM replicas 1..R-1, each a Ray actor of its own
(`servers.NAME.replica_resources`: one CPU, plus `tensor_parallel_size` GPUs on GPUs; servers.engines.vllm_ray).
The strategy
follows `placement.nodes`: one machine (1, the default) packs every bundle onto one node (STRICT_PACK: a box's GPUs
together); more lets Ray spread them over as few nodes as hold them (PACK), and a node's ranks are then its local
ranks (servers.trainers.ray_ranks). Plain data: no Ray import here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import ServerSpec

__all__ = ["RayBundles", "on_gpus", "ray_bundles", "ray_replicas", "server_ranks"]


@dataclass(frozen=True)
class RayBundles:
    """A server's placement group: `bundles[0]` its actor's resources, then one per trainer rank (`ranks`), then one
    per vLLM replica after the first (`replicas`)."""

    bundles: tuple[dict[str, float], ...]
    strategy: str  # Ray's: STRICT_PACK (one node) or PACK (as few nodes as hold them)
    ranks: int = 0
    replicas: int = 0  # vLLM replicas in bundles of their own (all but the first, which runs beside the server)

    @property
    def rank_bundle(self) -> dict[str, float] | None:
        return self.bundles[1] if self.ranks else None

    @property
    def replica_bundle(self) -> dict[str, float] | None:
        return self.bundles[-1] if self.replicas else None

    def total(self) -> dict[str, float]:
        """What the whole group asks of the cluster."""
        out: dict[str, float] = {}
        for bundle in self.bundles:
            for key, amount in bundle.items():
                out[key] = out.get(key, 0.0) + amount
        return out


def server_ranks(server: ServerSpec) -> int:
    """The trainer ranks a local server starts (0: its trainer, if any, runs in the server's process). A server of
    LoRA policies runs one trainer for all of them, as its policies' train: says (the topology checks they agree)."""
    train = server.train
    if server.policies and train is not None:
        train = server.policy_train(next(iter(server.policies)))
    if not server.trainable or train is None or train.trainer != "fsdp":
        return 0
    return train.fsdp.ranks


def on_gpus(server: ServerSpec) -> bool:
    """Does the server run on GPUs under run.ray (its actor sees only the GPUs of its `resources`)?"""
    return server.device == "cuda" or (server.device is None and bool((server.resources or {}).get("GPU")))


def ray_replicas(server: ServerSpec) -> int:
    """The vLLM replicas of a local server that are Ray actors of their own under run.ray (all but the first)."""
    if server.engine != "vllm" or server.vllm is None:
        return 0
    return server.vllm.data_parallel_size - 1


def ray_bundles(server: ServerSpec) -> RayBundles:
    """The placement group of local server `server` under run.ray (one bundle, its actor's, without ranks or
    replicas)."""
    own = {"CPU": 1.0, **(server.resources or {})}
    on_gpu = on_gpus(server)
    per_rank = {"CPU": 1.0, **(server.rank_resources or ({"GPU": 1.0} if on_gpu else {}))}
    tp = server.vllm.tensor_parallel_size if server.vllm is not None else 1
    per_replica = {"CPU": 1.0, **(server.replica_resources or ({"GPU": float(tp)} if on_gpu else {}))}
    ranks, replicas = server_ranks(server), ray_replicas(server)
    nodes = server.placement.nodes if server.placement else 1
    bundles = (own, *(dict(per_rank) for _ in range(ranks)), *(dict(per_replica) for _ in range(replicas)))
    return RayBundles(bundles, "STRICT_PACK" if nodes == 1 else "PACK", ranks, replicas)
