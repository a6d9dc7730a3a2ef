"""vLLM's replicas after the first as Ray actors in the server's placement group (servers/engines/vllm_ray.py): on two
Ray nodes on this machine, a two-replica engine whose second replica's bundle can only be placed on the other node.
The replicas are stand-in vLLM processes (tests/servers/stand_in_vllm.py), reached through the relay its actor
runs; the relay alone is tested against a foreign peer. None of it has run on a GPU."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from ray_nodes import two_ray_nodes

from servers.engines.vllm_process import VLLMSettings
from tests.servers.stand_in_vllm import stand_in_python
from tests.servers.test_vllm_replicas import calls, generate

ray = pytest.importorskip("ray")
from servers.engines.vllm_ray import Relay  # noqa: E402 - needs ray

pytestmark = pytest.mark.timeout(300)

GROUP = "vllm-ray-test"
SYNC = ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"]


@pytest.fixture(scope="module")
def ray_cluster():
    with two_ray_nodes({"node_a": 1}, {"node_b": 1}) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def engine(ray_cluster, model_dir, tmp_path_factory):
    """A two-replica engine under Ray: bundle 0 (the server's) on node_a, bundle 1 (replica 1's) on node_b."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from servers.engines.vllm_engine import VLLMEngine

    group = placement_group([{"CPU": 0.1, "node_a": 0.1}, {"CPU": 0.1, "node_b": 1}], strategy="PACK", name=GROUP)
    ray.get(group.ready(), timeout=60)
    scratch = tmp_path_factory.mktemp("ray-replicas")
    engine = VLLMEngine(model_dir, device="cpu", settings=VLLMSettings(data_parallel_size=2),
                        python=stand_in_python(scratch), work_dir=scratch / "work", start_timeout_s=60,
                        ray_group=GROUP, ray_address=ray_cluster.address)  # fmt: skip
    try:
        yield engine
    finally:
        engine.close()
        remove_placement_group(group)


def replica_actors() -> list[str]:
    return named(f"{GROUP}.replica1.")


def bundle_nodes() -> dict[int, str]:
    group = next(g for g in ray.util.placement_group_table().values() if g["name"] == GROUP)
    return group["bundles_to_node_id"]


def node_with(resource: str) -> str:
    return next(node["NodeID"] for node in ray.nodes() if node["Alive"] and resource in node["Resources"])


def test_the_second_replica_runs_in_a_ray_actor_in_its_bundle_on_the_other_node(engine):
    assert bundle_nodes()[1] == node_with("node_b") != node_with("node_a")
    assert len(replica_actors()) == 1
    local, remote = engine.replica_urls
    assert local.startswith("http://127.0.0.1:")  # the first replica: a subprocess of this server, on loopback
    assert remote.startswith(f"http://{ray.util.get_node_ip_address()}:")  # the other's relay, on its node's address
    for url in engine.replica_urls:
        assert calls(url) == ["/v1/completions"]  # the start's one-token check, through the relay for the second
    assert (engine.work_dir / "vllm-1.log").exists()  # written by the actor (a shared filesystem here)


def test_calls_stream_through_the_relay_and_a_weight_load_reaches_both_replicas(engine, model_dir):
    before = [calls(url).count("/v1/completions") for url in engine.replica_urls]
    for turn in range(2):
        assert generate(engine, "episode-a", stream=bool(turn)) == [5, 6]
        assert generate(engine, "episode-b", stream=bool(turn)) == [5, 6]
    after = [calls(url).count("/v1/completions") for url in engine.replica_urls]
    assert sorted(a - b for a, b in zip(after, before)) == [2, 2]  # one lease per replica, both its calls there
    marks = [len(calls(url)) for url in engine.replica_urls]
    engine.load_weights_from(model_dir)
    for url, mark in zip(engine.replica_urls, marks):
        assert calls(url)[mark:] == SYNC


def test_a_killed_replica_actor_is_started_again_in_its_bundle_with_the_engines_weights(engine, model_dir):
    engine.load_weights_from(model_dir)  # what the new replica must be given again
    old_name, old_url = replica_actors()[0], engine.replica_urls[1]
    ray.kill(ray.get_actor(old_name, namespace="marl"), no_restart=True)
    wait_until(lambda: engine.stats.restarts == 1 and engine._replicas.replicas[1].supervisor.serving, 120)
    assert replica_actors() != [old_name] and len(replica_actors()) == 1  # a new actor...
    assert bundle_nodes()[1] == node_with("node_b")  # ...in the same bundle
    new_url = engine.replica_urls[1]
    assert new_url != old_url
    assert calls(new_url) == [*SYNC, "/v1/completions"]  # the engine's weights replayed, then the one-token check
    for key in ("episode-a", "episode-b", "episode-c"):
        assert generate(engine, key) == [5, 6]


def test_the_relay_passes_bytes_from_an_allowed_peer_and_closes_on_any_other(engine):
    upstream = int(engine.replica_urls[0].rsplit(":", 1)[1])  # the first replica's stand-in, on loopback
    allowed = Relay("127.0.0.1", upstream, ["127.0.0.1"])
    foreign = Relay("127.0.0.1", upstream, ["10.255.255.1"])  # only another machine may connect
    try:
        assert httpx.get(f"http://127.0.0.1:{allowed.port}/health").status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{foreign.port}/health")
        assert foreign.refused == 1 and allowed.refused == 0
    finally:
        allowed.close()
        foreign.close()


def test_the_relay_closes_a_connection_when_nothing_listens_behind_it():
    relay = Relay("127.0.0.1", _closed_port(), ["127.0.0.1"])
    try:
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{relay.port}/health", timeout=10)
    finally:
        relay.close()


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_closing_the_engine_ends_its_replica_actors_and_a_start_that_fails_leaves_none(ray_cluster, model_dir,
                                                                                       tmp_path: Path):
    from ray.util.placement_group import placement_group, remove_placement_group

    from servers.engines.vllm_engine import VLLMEngine

    group = placement_group([{"CPU": 0.1}, {"CPU": 0.1}, {"CPU": 0.1}], name="closing-test")
    ray.get(group.ready(), timeout=60)
    try:
        engine = VLLMEngine(model_dir, device="cpu", settings=VLLMSettings(data_parallel_size=3),
                            python=stand_in_python(tmp_path), work_dir=tmp_path / "work", start_timeout_s=60,
                            ray_group="closing-test")  # fmt: skip
        assert len(named("closing-test.replica")) == 2
        engine.close()
        wait_until(lambda: not named("closing-test.replica"))
        with pytest.raises((OSError, RuntimeError), match="no vLLM environment"):  # no python for the replicas
            VLLMEngine(model_dir, device="cpu", settings=VLLMSettings(data_parallel_size=3),
                       python=tmp_path / "no-such-python", work_dir=tmp_path / "work2", start_timeout_s=60,
                       ray_group="closing-test")  # fmt: skip
        wait_until(lambda: not named("closing-test.replica"))
    finally:
        remove_placement_group(group)


def named(prefix: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


def wait_until(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_replica_spawner_refuses_a_group_without_its_bundle(ray_cluster, model_dir, tmp_path: Path):
    from ray.util.placement_group import placement_group, remove_placement_group

    from servers.engines.vllm_process import VLLMLaunch
    from servers.engines.vllm_ray import ray_replica_spawner

    group = placement_group([{"CPU": 0.1}], name="no-replica-bundles")
    ray.get(group.ready(), timeout=60)
    try:
        launch = VLLMLaunch(model_dir, 64, settings=VLLMSettings(data_parallel_size=2), ray_group="no-replica-bundles")
        with pytest.raises(ValueError, match="too few for 1 vLLM replicas"):
            ray_replica_spawner(launch, 1)
    finally:
        remove_placement_group(group)
