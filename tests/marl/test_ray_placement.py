"""Under `run.ray` a server actor's `marl serve` sees the GPUs Ray gave the actor, and none if it asked for none
(marl/runner/ray_cluster.py `server_gpu_environment`, as `_ServerActor` calls it). A private Ray instance that
declares two GPUs this machine does not have: Ray assigns them all the same, which is all that is checked here."""

from __future__ import annotations

import importlib.util
import os
import signal

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (the test extra)")


@pytest.fixture(scope="module")
def ray_with_two_gpus():
    ray = pytest.importorskip("ray")
    sigterm = signal.getsignal(signal.SIGTERM)  # ray.init replaces it
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, namespace="placement-test")
        try:
            yield ray
        finally:
            ray.shutdown()
            signal.signal(signal.SIGTERM, sigterm)


def test_a_server_actor_sees_the_gpus_ray_gave_it_and_no_others(ray_with_two_gpus):
    ray = ray_with_two_gpus
    from marl.runner.ray_cluster import server_gpu_environment

    @ray.remote(num_cpus=0)
    class Probe:  # what `_ServerActor.__init__` computes for its `marl serve`, beside what Ray set for the actor
        def environment(self) -> tuple[dict[str, str], str | None]:
            return server_gpu_environment(ray.get_gpu_ids()), os.environ.get("CUDA_VISIBLE_DEVICES")

    with_gpu = Probe.options(num_gpus=1).remote()
    server_env, actor_env = ray.get(with_gpu.environment.remote(), timeout=120)
    assert server_env["CUDA_VISIBLE_DEVICES"] in ("0", "1") and server_env["CUDA_VISIBLE_DEVICES"] == actor_env
    without = Probe.options(num_gpus=0).remote()
    server_env, _ = ray.get(without.environment.remote(), timeout=120)
    assert server_env == {"CUDA_VISIBLE_DEVICES": ""}  # Ray itself would leave it seeing every GPU of its node
