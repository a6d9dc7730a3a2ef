"""`marl run` on Ray (marl/runner/ray_cluster.py): server actors placed by their resources on a real 2-node cluster
(two Ray nodes on this machine, `ray.cluster_utils.Cluster`), a killed actor restarted on its data dir, games as Ray
tasks, teardown that leaves the cluster up; the spec keys; and a run without `run.ray` never importing ray.

One cluster for all of them (it takes seconds to start); every process of it, and every `marl run` joining it,
runs with RAY_AUTH_MODE=disabled (Ray turns token authentication on for clusters it starts) and without usage stats.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from ray_nodes import RAY_ENV, two_ray_nodes

from marl.games.record import read_games
from marl.topology import Topology, TopologyError
from marl.transaction.coordinator import GameFailed
from servers.engines.vllm_process import VLLM_PYTHON_ENV
from tests.servers.stand_in_vllm import stand_in_python

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (the test extra)")


TRAIN = {"job": "tiny", "batch_size": 1, "num_repeat": 2, "save_freq": 0}
TOPOLOGY = {
    "name": "tiny-ray",
    "servers": {
        "speaker_model": {"trainable": True, "device": "cpu", "train": TRAIN, "resources": {"node_a": 1}},
        "listener_model": {"trainable": True, "device": "cpu", "train": TRAIN, "resources": {"node_b": 1}},
    },
    "roles": {"speaker": {"server": "speaker_model"}, "listener": {"server": "listener_model"}},
    "env": {"class": "envs.signalling:SignallingGame", "args": {"num_items": 3}},
    "run": {"max_steps": 1, "repeats": 2, "concurrency": 2, "max_tokens": 6},
}


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """Two Ray nodes on this machine: the head has resource node_a, the other node_b, each one rank_slot (rank_resources
    that force two ranks onto two nodes); a vLLM they start is a stand-in (tests/servers/stand_in_vllm.py). Started
    once (this module is its only user, so it stops when the module's tests are done, not at the end of the whole
    session)."""
    stand_in = {VLLM_PYTHON_ENV: str(stand_in_python(tmp_path_factory.mktemp("stand-in")))}
    with two_ray_nodes({"node_a": 1, "rank_slot": 1}, {"node_b": 1, "rank_slot": 1}, env=stand_in) as cluster:
        yield cluster


def write_topology(tmp_path: Path, tiny_model: Path, **run) -> Path:
    spec = json.loads(json.dumps(TOPOLOGY))
    for server in spec["servers"].values():
        server["model"] = str(tiny_model)
    spec["run"].update(run_dir=str(tmp_path / "run"), **run)
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def start_run(path: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "marl.cli", "run", str(path), *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **RAY_ENV, "COLUMNS": "200"})


def wait_for(proc: subprocess.Popen, condition, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{what} did not happen:\n{proc.communicate()[0]}")
        time.sleep(0.2)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.terminate()
        raise AssertionError(f"marl run did not finish:\n{proc.communicate(timeout=60)[0]}") from None


def games_played(run_dir: Path) -> int:
    path = run_dir / "games.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def servers_file(run_dir: Path) -> dict:
    return json.loads((run_dir / "servers.json").read_text())


def node_with(resource: str) -> str:
    import ray

    return next(node["NodeID"] for node in ray.nodes() if node["Alive"] and resource in node["Resources"])


def assert_torn_down(servers: dict) -> None:
    """The run's actors are gone (the cluster learns it within moments); the cluster's own nodes are all still up."""
    import ray

    def gone(entry: dict) -> bool:
        try:
            ray.get_actor(entry["ray_actor"], namespace=entry["ray_namespace"])
        except ValueError:  # no such actor
            return True
        return False

    deadline = time.monotonic() + 30
    while not all(gone(entry) for entry in servers.values()):
        assert time.monotonic() < deadline, f"actors of the run still alive: {servers}"
        time.sleep(0.2)
    assert [node["Alive"] for node in ray.nodes()].count(True) == 2


def assert_complete_records(run_dir: Path, steps: int) -> None:
    games = read_games(run_dir / "games.jsonl")
    assert len(games) >= 2 * steps
    for game in games:
        assert set(game.role_rewards) == {"speaker", "listener"}
        assert set(game.episodes) == set(game.policy_versions) == {"speaker_model", "listener_model"}
    for server in ("speaker_model", "listener_model"):
        metrics = (run_dir / "servers" / server / "metrics.jsonl").read_text().splitlines()
        assert json.loads(metrics[-1])["step"] >= steps


@needs_ray
def test_servers_are_placed_by_their_resources_and_games_run_as_ray_tasks(ray_cluster, tiny_model, tmp_path):
    path = write_topology(tmp_path, tiny_model)
    proc = start_run(path, f"run.ray.address={ray_cluster.address}", "run.ray.spread_games=true")
    output = finish(proc)
    assert proc.returncode == 0, output
    run_dir = tmp_path / "run"
    servers = servers_file(run_dir)
    assert servers["speaker_model"]["ray_node_id"] == node_with("node_a")
    assert servers["listener_model"]["ray_node_id"] == node_with("node_b")
    assert "server speaker_model is up on http://" in output and "stopped 2 local servers" in output
    assert_complete_records(run_dir, steps=1)
    assert_torn_down(servers)


@needs_ray
def test_a_spread_game_is_played_in_a_ray_worker_and_recorded_here(ray_cluster):
    from envs.signalling import SignallingGame
    from marl.agents import ScriptedAgent
    from marl.runner.ray_cluster import RayCluster
    from marl.transaction.coordinator import Coordinator

    here = os.getpid()

    def player(seat):  # sent to the worker with the game (a closure: pickled by value)
        if os.getpid() == here:
            raise RuntimeError("the game was played in the driver's process")
        return ScriptedAgent(seat.env, seat.agent)

    coordinator = Coordinator(env_factory=functools.partial(SignallingGame, num_items=3),
                              role_servers={"speaker": None, "listener": None}, endpoints={}, player_factory=player,
                              runner=RayCluster.play)
    broken = Coordinator(env_factory=functools.partial(SignallingGame, num_items=3), role_servers={"speaker": None},
                         endpoints={}, runner=RayCluster.play, linked_servers=[])
    try:
        record = coordinator.play_game("spread-0", 7)
        assert record.task_id == "spread-0" and set(record.role_rewards) == {"speaker", "listener"}
        assert record.turns == 2 and record.role_rewards["listener"] == 1.0  # the scripted listener picks right
        with pytest.raises(GameFailed, match=r"^game spread-1 failed on Ray node .*has no role 'listener'"):
            broken.play_game("spread-1", 7)  # the worker's error comes back as one line, not a remote traceback
    finally:
        coordinator.close()
        broken.close()


# serial: a restart races the run's lease timeout, and beside another test's load Ray takes long enough to
# restart an actor that games time out and are replayed (174 s in the parallel part against 22 s alone)
@pytest.mark.serial
@needs_ray
def test_a_killed_server_actor_is_restarted_on_its_data_dir_and_the_run_completes(ray_cluster, tiny_model, tmp_path):
    import ray

    path = write_topology(tmp_path, tiny_model)
    proc = start_run(path, f"run.ray.address={ray_cluster.address}", "run.max_steps=2")
    run_dir = tmp_path / "run"
    wait_for(proc, lambda: games_played(run_dir) >= 1, "a first game")
    before = servers_file(run_dir)["listener_model"]
    ray.kill(ray.get_actor(before["ray_actor"], namespace=before["ray_namespace"]), no_restart=False)
    output = finish(proc)
    assert proc.returncode == 0, output
    assert "server listener_model died and Ray restarted it (1/3)" in output
    after = servers_file(run_dir)["listener_model"]
    assert after["ray_node_id"] == before["ray_node_id"] == node_with("node_b")  # the only node with node_b
    assert f"now on {after['url']}" in output  # its URL now (a new port, most likely), reported and recorded
    assert_complete_records(run_dir, steps=2)
    assert_torn_down(servers_file(run_dir))


@needs_ray
def test_sigterm_stops_the_run_and_its_actors_and_leaves_the_cluster_up(ray_cluster, tiny_model, tmp_path):
    path = write_topology(tmp_path, tiny_model)
    proc = start_run(path, f"run.ray.address={ray_cluster.address}", "run.max_steps=1000")
    run_dir = tmp_path / "run"
    wait_for(proc, lambda: games_played(run_dir) >= 1, "a first game")
    servers = servers_file(run_dir)
    proc.send_signal(signal.SIGTERM)
    output = finish(proc, timeout=120)
    assert proc.returncode == 130, output
    assert "stopped 2 local servers" in output
    assert_torn_down(servers)


# --- FSDP ranks as Ray actors in the server's placement group --------------------------------------------------------

FSDP_TRAIN = {"job": "tiny", "batch_size": 1, "num_repeat": 2, "save_freq": 1, "trainer": "fsdp",
              "fsdp": {"ranks": 2, "learning_rate": 1e-3}}
FSDP_TOPOLOGY = {
    "name": "tiny-ray-ranks",
    "servers": {"team": {"trainable": True, "device": "cpu", "train": FSDP_TRAIN, "resources": {"node_a": 1},
                         "rank_resources": {"CPU": 1, "rank_slot": 1}, "placement": {"nodes": 2}}},
    "roles": {"speaker": {"server": "team"}, "listener": {"server": "team"}},
    "env": {"class": "envs.signalling:SignallingGame", "args": {"num_items": 3}},
    "run": {"max_steps": 2, "repeats": 2, "concurrency": 2, "max_tokens": 6},
}


def write_fsdp_topology(tmp_path: Path, tiny_model: Path) -> Path:
    spec = json.loads(json.dumps(FSDP_TOPOLOGY))
    spec["servers"]["team"]["model"] = str(tiny_model)
    spec["run"]["run_dir"] = str(tmp_path / "run")
    path = tmp_path / "fsdp.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def rank_nodes(group_prefix: str) -> dict[int, str]:
    """The node of each rank bundle (1..) of the live placement group whose name starts with `group_prefix`."""
    import ray

    for group in ray.util.placement_group_table().values():
        if group["name"].startswith(group_prefix) and group["state"] == "CREATED":
            return {i: node for i, node in group["bundles_to_node_id"].items() if i > 0}
    return {}


def rank_actors(group_prefix: str, rank: int) -> list[str]:
    """The named rank actors `rank` of the live groups whose names start with `group_prefix`."""
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(group_prefix) and f".rank{rank}." in a["name"]]


def test_rank_places_follow_where_ray_put_the_ranks():
    pytest.importorskip("ray")
    from servers.trainers.ray_ranks import RankWhere, rank_places

    wheres = [RankWhere("a", "10.0.0.1", (4,)), RankWhere("b", "10.0.0.2", (0,)), RankWhere("a", "10.0.0.1", (6,)),
              RankWhere("b", "10.0.0.2", (1,))]
    places = rank_places(wheres, "10.0.0.1", 1234)
    assert [(p.rank, p.local_rank, p.local_world_size) for p in places] == [(0, 0, 2), (1, 0, 2), (2, 1, 2), (3, 1, 2)]
    assert [p.cuda_visible_devices for p in places] == ["4,6", "0,1", "4,6", "0,1"]  # a node's ranks see theirs
    assert {(p.master_addr, p.master_port) for p in places} == {("10.0.0.1", 1234)}
    assert rank_places([RankWhere("a", "h")], "h", 1)[0].cuda_visible_devices is None  # the CPU: gloo


@needs_ray
def test_two_ranks_on_two_ray_nodes_make_the_one_process_step(ray_cluster, tmp_path):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marl.protocol import FSDPConfig, GRPOConfig
    from servers.placement import Placement
    from servers.trainers.fsdp import FSDPTrainer
    from servers.trainers.grpo import GRPOTrainer
    from tests.servers.test_grpo_trainer import make_batch
    from tests.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    knobs = dict(learning_rate=1e-3, micro_batch_tokens=40, kl_coef=0.05, ppo_epochs=2)
    group = placement_group([{"CPU": 0.1}, *[{"CPU": 1, "rank_slot": 1}] * 2], strategy="PACK", name="step-test")
    ray.get(group.ready(), timeout=60)
    try:
        sharded = FSDPTrainer(model, FSDPConfig(ranks=2, **knobs), placement=Placement(ray_group="step-test"))
        try:
            assert len({where.node_id for where in sharded.ranks.wheres}) == 2  # one rank on each node
            one = GRPOTrainer(model, GRPOConfig(**knobs))
            batch = make_batch(one, AutoTokenizer.from_pretrained(model), step=1)
            m_sharded, m_one = sharded.step(batch), one.step(batch)
            got = AutoModelForCausalLM.from_pretrained(sharded.export_weights(tmp_path / "w")).state_dict()
        finally:
            sharded.close()
    finally:
        remove_placement_group(group)
    want = one.policy.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():  # measured: 2e-7 at most
        assert float((got[name] - tensor).norm() / tensor.norm()) <= 1e-5, name
    for key in ("loss", "pg_loss", "grad_norm", "tokens_trained", "samples"):  # as test_fsdp_trainer.py compares
        assert m_sharded[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-7), key


@pytest.mark.serial  # as the killed server actor above
@needs_ray
def test_a_run_trains_with_ranks_on_two_nodes_and_survives_a_killed_rank(ray_cluster, tiny_model, tmp_path):
    """`trainer: fsdp, ranks: 2` under run.ray: the server's ranks are Ray actors in its placement group, one on
    each node; a rank actor killed mid-run fails the step, the server's engine is started again on a new group that
    resumes from the checkpoint, and the run finishes with every episode recorded once and trained at most once."""
    import ray

    proc = start_run(write_fsdp_topology(tmp_path, tiny_model), f"run.ray.address={ray_cluster.address}",
                     "run.max_steps=4")  # steps after the kill: it must not come after the run's last step
    run_dir = tmp_path / "run"
    metrics = run_dir / "servers" / "team" / "metrics.jsonl"
    wait_for(proc, lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, "a first step")
    nodes = rank_nodes("tiny-ray-ranks")
    assert len(set(nodes.values())) == 2, nodes  # rank 0 on one node, rank 1 on the other
    ray.kill(ray.get_actor(rank_actors("tiny-ray-ranks", 1)[0], namespace="marl"), no_restart=True)
    output = finish(proc)
    assert proc.returncode == 0, output
    assert "and 2 trainer ranks of CPU: 1, rank_slot: 1" in output
    assert json.loads(metrics.read_text().splitlines()[-1])["step"] >= 4  # (games in flight may add a step)
    log = (run_dir / "logs" / "team.log").read_text()
    # the step failed (rank 1 died; or, killed mid-collective, rank 0 failed on the dropped connection first)
    assert re.search(r"FSDP trainer: rank \d (died|failed)", log), log[-3000:]
    db = sqlite3.connect(run_dir / "servers" / "team" / "ledger.sqlite")
    episodes = [row[0] for row in db.execute("SELECT episode_id FROM episodes")]
    consumed = db.execute("SELECT consumed_step, COUNT(*) FROM samples WHERE consumed_step > 0"  # -1: stale
                          " GROUP BY consumed_step").fetchall()
    db.close()
    assert len(episodes) == len(set(episodes)) >= 2  # each step trains one group (task, role) of 2 episodes
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [s["step"] for s in steps] == sorted({s["step"] for s in steps})  # each step trained once
    # every claimed sample belongs to a step that happened (the failed step's claim went back to the pool, and the
    # step was taken again from the checkpoint before it), or to the one the run's end stopped (a restart returns it
    # to the pool: servers/episodes/ledger.py `recover`); each sample row has one consumed_step: never two steps
    done = {s["step"] for s in steps}
    assert {step for step, _ in consumed} <= done | {max(done) + 1} and all(n >= 1 for _, n in consumed)
    assert_torn_down(servers_file(run_dir))


@pytest.mark.parametrize("override, key, fragment", [
    ("servers.team.placement.nodes=1", "servers.team.placement.nodes", "holds the server and its 2 trainer ranks"),
    ("servers.team.train.fsdp.ranks=3", "servers.team.rank_resources", "less than the server and its 3"),
    ("servers.team.rank_resources={CPU: 1, big_box: 1}", "servers.team.rank_resources", "for a trainer rank"),
])
@needs_ray
def test_a_placement_group_the_cluster_cannot_hold_is_refused_at_its_key(ray_cluster, tiny_model, tmp_path, override,
                                                                        key, fragment):
    proc = start_run(write_fsdp_topology(tmp_path, tiny_model), f"run.ray.address={ray_cluster.address}", override)
    output = finish(proc, timeout=120)
    assert proc.returncode == 2, output
    assert key in output and fragment in output, output


def test_marl_trainer_node_is_deprecated_and_says_what_to_do():
    result = subprocess.run([sys.executable, "-m", "marl.cli", "trainer-node", "--server", "h", "--node-rank", "1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "deprecated" in result.stderr and "run.ray.address=auto" in result.stderr


class _FakeServer:
    """A `RayServer` whose `poll` answers from a script: a `where` dict, None (no answer yet) or an exception."""

    def __init__(self, *answers):
        self.answers, self.restarts, self.log_path = list(answers), 0, Path("logs/s.log")
        self.url = self.node_id = self.incarnation = ""

    def poll(self):
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def update(self, where):
        self.url, self.node_id, self.incarnation = where["url"], where["node_id"], where["incarnation"]


@needs_ray
def test_the_ray_supervisor_reports_each_new_incarnation_and_gives_up_with_ray():
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from marl.runner.ray_cluster import RaySupervisor

    first, second = ({"url": f"http://10.0.0.{i}:1", "node_id": f"node{i}", "incarnation": f"i{i}"} for i in (1, 2))
    server = _FakeServer(first, None, ActorUnavailableError("restarting", None), second, second, ActorDiedError())
    server.update(first)
    lines, restarted = [], []
    supervisor = RaySupervisor({"s": server}, report=lines.append, on_restart=restarted.append)
    for _ in range(3):
        supervisor.check()
    assert restarted == [] and lines == [] and supervisor.fatal is None  # same actor, no answer yet, restarting
    supervisor.check()
    assert restarted == ["s"] and server.url == "http://10.0.0.2:1" and server.restarts == 1
    assert lines == ["server s died and Ray restarted it (1/3) on node node2, now on http://10.0.0.2:1; log:"
                     " logs/s.log"]
    supervisor.check()  # the same incarnation again: nothing new
    supervisor.check()
    assert restarted == ["s"] and supervisor.fatal.startswith("server s: Ray gave up on its actor after 1 restarts")


SCRIPTED = {
    "name": "scripted",
    "roles": {"speaker": {"scripted": True}, "listener": {"scripted": True}},
    "env": {"class": "envs.signalling:SignallingGame", "args": {"num_items": 3}},
    "run": {"games": 2},
}


def test_a_run_without_run_ray_never_imports_ray(tmp_path):
    spec = {**SCRIPTED, "run": {**SCRIPTED["run"], "run_dir": str(tmp_path / "run")}}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(spec))
    script = ("import sys; import marl.runner.run; assert 'ray' not in sys.modules, 'import';"
              f" summary = marl.runner.run.run({str(tmp_path / 't.yaml')!r}); assert summary.games == 2, summary;"
              " assert 'ray' not in sys.modules, 'run'; print('no ray')")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "no ray" in result.stdout, result.stdout + result.stderr


# --- vLLM's replicas after the first as Ray actors in the server's placement group -----------------------------------

VLLM_TOPOLOGY = {
    "name": "tiny-ray-replicas",
    "servers": {"team": {"trainable": True, "device": "cpu", "engine": "vllm", "train": TRAIN,
                         "vllm": {"data_parallel_size": 2}, "resources": {"node_a": 1},
                         "replica_resources": {"CPU": 1, "node_b": 1}, "placement": {"nodes": 2}}},
    "roles": {"speaker": {"server": "team"}, "listener": {"server": "team"}},
    "env": {"class": "envs.signalling:SignallingGame", "args": {"num_items": 3}},
    "run": {"max_steps": 1, "repeats": 2, "concurrency": 2, "max_tokens": 6},
}


@needs_ray
def test_a_run_serves_and_trains_through_a_vllm_replica_on_the_other_node(ray_cluster, tiny_model, tmp_path):
    """`vllm.data_parallel_size: 2` under run.ray: the second replica is a Ray actor in the last bundle of the
    server's group, on the node its replica_resources name; the run plays its games and its step's weights reach
    both replicas (through the disk), or the step would fail."""
    import ray

    spec = json.loads(json.dumps(VLLM_TOPOLOGY))
    spec["servers"]["team"]["model"] = str(tiny_model)
    spec["run"]["run_dir"] = str(tmp_path / "run")
    (tmp_path / "vllm.yaml").write_text(yaml.safe_dump(spec))
    proc = start_run(tmp_path / "vllm.yaml", f"run.ray.address={ray_cluster.address}")
    replica: list[str] = []

    def placed() -> bool:
        replica[:] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if ".replica1." in a["name"]]
        return bool(replica)

    wait_for(proc, placed, "vLLM replica 1's actor")
    group = replica[0].split(".replica1.")[0]
    assert rank_nodes(group) == {1: node_with("node_b")}  # its bundle, the group's last, is on node_b
    output = finish(proc)
    assert proc.returncode == 0, output
    assert "and 1 more vLLM replicas of CPU: 1, node_b: 1" in output
    log = (tmp_path / "run" / "servers" / "team" / "vllm" / "vllm-1.log").read_text()
    assert "=== vLLM on port" in log  # started by the actor, into the server's data dir (a shared filesystem here)
    metrics = (tmp_path / "run" / "servers" / "team" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(metrics[-1])["step"] >= 1  # a step may start before the run stops the server


@pytest.mark.parametrize("override, key, fragment", [
    (["run.ray.spread_games=true"], "run.ray.address", "missing"),
    (["run.ray.address=http://head:6379"], "run.ray.address", "is not a Ray address"),
    (["run.ray.address=auto", "servers.remote.resources={GPU: 1}"], "servers.remote.resources",
     "only applies to a local server"),
    (["run.ray.address=auto", "servers.past.resources={CPU: 1}"], "servers.past.resources",
     "run on the machine of `marl run`"),
    (["run.ray.address=auto", "servers.learner.resources={CPU: -1}"], "servers.learner.resources.CPU",
     "greater than or equal to 0"),
    (["run.ray.address=auto", "servers.learner.resources={CPU: 0}"], "servers.learner.resources",
     "Ray refuses a bundle that asks for nothing"),
    (["run.ray.address=auto", "servers.learner.rank_resources={CPU: 2}"], "servers.learner.rank_resources",
     "only a trainer with ranks has them"),
    (["run.ray.address=auto", "servers.remote.rank_resources={CPU: 2}"], "servers.remote.rank_resources",
     "only applies to a local server"),
    (["run.ray.address=auto", "servers.learner.train.trainer=fsdp", "servers.learner.device=cpu",
      "servers.learner.rank_resources={GPU: 1}"], "servers.learner.rank_resources.GPU", "runs on the CPU"),
    (["run.ray.address=auto", "servers.learner.train.trainer=fsdp", "servers.learner.resources={GPU: 1}",
      "servers.learner.rank_resources={GPU: 2}"], "servers.learner.rank_resources.GPU", "asks for 2: GPU: 1"),
    (["run.ray.address=auto", "servers.learner.train.trainer=fsdp", "servers.learner.placement={nodes: 2}",
      "servers.learner.engine=vllm", "servers.learner.vllm={weight_sync: nccl}"], "servers.learner.vllm.weight_sync",
     "lets them run on others"),
    # vLLM's replicas after the first: Ray actors in bundles of their own (replica_resources)
    (["run.ray.address=auto", "servers.learner.replica_resources={CPU: 2}"], "servers.learner.replica_resources",
     "only vLLM replicas after the first have them"),
    (["run.ray.address=auto", "servers.remote.replica_resources={CPU: 2}"], "servers.remote.replica_resources",
     "only applies to a local server"),
    (["run.ray.address=auto", "servers.learner.engine=vllm", "servers.learner.resources={GPU: 2}",
      "servers.learner.vllm={data_parallel_size: 2, tensor_parallel_size: 2}", "servers.learner.replica_resources="
      "{GPU: 1}"], "servers.learner.replica_resources.GPU", "each vLLM replica runs on 2 GPU(s) of its own"),
    (["run.ray.address=auto", "servers.learner.engine=vllm", "servers.learner.device=cpu",
      "servers.learner.vllm={data_parallel_size: 2}", "servers.learner.replica_resources={GPU: 1}"],
     "servers.learner.replica_resources.GPU", "its vLLM replicas would not use a GPU"),
    (["run.ray.address=auto", "servers.learner.engine=vllm", "servers.learner.resources={GPU: 2}",
      "servers.learner.vllm={data_parallel_size: 2}", "servers.learner.placement={engine_gpus: [0, 1]}"],
     "servers.learner.placement.engine_gpus", "remove engine_gpus"),
    (["run.ray.address=auto", "servers.learner.engine=vllm", "servers.learner.placement={nodes: 2}",
      "servers.learner.vllm={data_parallel_size: 2, weight_sync: nccl}"], "servers.learner.vllm.weight_sync",
     "maybe on other machines"),
    (["run.ray.address=auto", "servers.learner.engine=vllm", "servers.learner.vllm={data_parallel_size: 2,"
      " weight_sync: ipc}"], "servers.learner.vllm.weight_sync", "ipc meets vLLM on the trainer's GPUs"),
    (["run.ray.address=auto", "servers.learner.trainable=false", "servers.learner.train=null",
      "servers.learner.placement={nodes: 2}"], "servers.learner.placement.nodes", "nor vLLM replicas"),
])
def test_ray_keys_are_checked_at_their_key(override, key, fragment):
    spec = {
        "name": "keys",
        "servers": {"learner": {"model": "m", "trainable": True, "train": TRAIN},
                    "remote": {"swarm_url": "http://gpu:1", "trainable": True, "train": TRAIN},
                    "past": {"past_of": {"server": "learner"}}},
        "roles": {"speaker": {"server": "learner"}, "listener": {"server": "remote"}, "other": {"server": "past"}},
        "env": {"class": "envs.signalling:SignallingGame"},
        "run": {"max_steps": 1},
    }
    with pytest.raises(TopologyError) as error:
        Topology.from_dict(spec, override, check_env=False)
    message = str(error.value)
    assert key in message and fragment in message, message


def test_vllm_replicas_after_the_first_get_bundles_of_their_own_and_may_span_nodes():
    from marl.plan.topology_plan import bundles_note
    from marl.topology.bundles import ray_bundles

    spec = {**SCRIPTED, "servers": {"big": {"model": "m", "engine": "vllm", "resources": {"GPU": 2},
                                            "vllm": {"data_parallel_size": 3, "tensor_parallel_size": 2},
                                            "placement": {"nodes": 2}}},
            "roles": {"speaker": {"server": "big"}, "listener": {"scripted": True}}}
    server = Topology.from_dict(spec, ["run.ray.address=auto"], check_env=False).spec.servers["big"]
    bundles = ray_bundles(server)  # a static server: no ranks; replicas 1 and 2 after the server's bundle
    assert bundles.bundles == ({"CPU": 1, "GPU": 2}, {"CPU": 1, "GPU": 2}, {"CPU": 1, "GPU": 2})
    assert (bundles.ranks, bundles.replicas, bundles.strategy) == (0, 2, "PACK")
    assert bundles_note(bundles).endswith("bundle 0: the server and vLLM's first replica, {CPU: 1, GPU: 2}; bundles"
                                          " 1-2: vLLM replicas 1-2, each {CPU: 1, GPU: 2}")
    spec["servers"]["big"].update(trainable=True, train={**TRAIN, "trainer": "fsdp", "fsdp": {"ranks": 2}},
                                  replica_resources={"CPU": 4, "GPU": 2, "box_b": 1})
    bundles = ray_bundles(Topology.from_dict(spec, ["run.ray.address=auto"], check_env=False).spec.servers["big"])
    assert bundles.bundles[1:] == ({"CPU": 1, "GPU": 1},) * 2 + ({"CPU": 4, "GPU": 2, "box_b": 1},) * 2  # ranks first


@pytest.mark.parametrize("address", ["local", "auto", "ray://head:10001", "10.0.0.5:6379"])
def test_ray_addresses_and_resources_that_load(address):
    spec = {**SCRIPTED, "servers": {"big": {"model": "m", "resources": {"GPU": 1, "CPU": 4, "node_b": 0.5}}},
            "roles": {"speaker": {"server": "big"}, "listener": {"scripted": True}}}
    topology = Topology.from_dict(spec, [f"run.ray.address={address}"], check_env=False)
    assert topology.spec.run.ray.address == address and topology.spec.run.ray.spread_games is False
    assert topology.spec.servers["big"].resources == {"GPU": 1, "CPU": 4, "node_b": 0.5}
    assert Topology.from_dict(spec, check_env=False).spec.run.ray is None  # resources alone: no Ray
