"""Two Ray nodes on this machine, for the tests of marl under `run.ray` (tests/marl/test_ray.py,
tests/servers/test_vllm_ray.py): custom node resources stand in for machines, so that a bundle that asks for one
lands on its node. Token authentication is off and usage stats unsent, as a test cluster on loopback needs."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

import pytest

RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


@contextlib.contextmanager
def two_ray_nodes(head: dict[str, float], other: dict[str, float], cpus: int = 2,
                  env: dict[str, str] | None = None) -> Iterator[Any]:  # fmt: skip
    """A head node with custom resources `head` and a second node with `other` (`cpus` CPUs each, `env` in their
    environment, which every actor of theirs inherits); this process joins as a driver (to find and kill actors).
    Stops only the nodes it started."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    sigterm = signal.getsignal(signal.SIGTERM)  # ray.init replaces it
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {**RAY_ENV, **(env or {})}.items():
            patch.setenv(key, value)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "resources": head,
                                                                "include_dashboard": False})  # fmt: skip
        try:
            cluster.add_node(num_cpus=cpus, resources=other)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False)
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()
            signal.signal(signal.SIGTERM, sigterm)
