"""Where a local server runs under `run.ray`: its Ray placement group, one description that `marl run`
(marl.ray_cluster) places and `marl plan` reads (docs/ray.md, "Placement groups").

Bundle 0 is the server's own actor (`servers.NAME.resources`: the HTTP server and its inference engine, with the
engine's GPUs); with `train.trainer: fsdp`, bundles 1..N are the trainer's N ranks, one each
(`servers.NAME.rank_resources`, one CPU unless it says otherwise; by default also one GPU when the server runs on GPUs:
`device: cuda`, or no device and `resources` with a GPU). The strategy
follows `placement.nodes`: one machine (1, the default) packs every bundle onto one node (STRICT_PACK: a box's GPUs
together); more lets Ray spread them over as few nodes as hold them (PACK), and a node's ranks are then its local
ranks (servers.trainers.ray_ranks). Plain data: no Ray import here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import ServerSpec

__all__ = ["RayBundles", "on_gpus", "ray_bundles", "server_ranks"]


@dataclass(frozen=True)
class RayBundles:
    """A server's placement group: `bundles[0]` its actor's resources, `bundles[1:]` one per trainer rank."""

    bundles: tuple[dict[str, float], ...]
    strategy: str  # Ray's: STRICT_PACK (one node) or PACK (as few nodes as hold them)

    @property
    def ranks(self) -> int:
        return len(self.bundles) - 1

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


def ray_bundles(server: ServerSpec) -> RayBundles:
    """The placement group of local server `server` under run.ray (one bundle, its actor's, without ranks)."""
    own = {"CPU": 1.0, **(server.resources or {})}
    on_gpu = on_gpus(server)
    per_rank = {"CPU": 1.0, **(server.rank_resources or ({"GPU": 1.0} if on_gpu else {}))}
    ranks = server_ranks(server)
    nodes = server.placement.nodes if server.placement else 1
    return RayBundles((own, *(dict(per_rank) for _ in range(ranks))), "STRICT_PACK" if nodes == 1 else "PACK")
