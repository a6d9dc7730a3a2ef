"""Ray: with `run.ray`, `marl run` runs each local server as a Ray actor, and with `run.ray.spread_games` each game as
a Ray task. Every use of Ray lives here; `marl.runner.run` imports this module only when the topology sets `run.ray`, so
a run without it never imports ray (docs/ray.md).

- `RayCluster(spec, run_name)` joins Ray at `run.ray.address`: `local` starts a private instance that `close()` stops;
  `auto`, `HOST:PORT` and `ray://HOST:PORT` join a cluster someone else runs, which `close()` only leaves.
- `RayCluster.launch(name, options, resources)` makes one `_ServerActor`, placed by the server's `resources` (CPU
  defaults to 1) and named `<run id>.<server>` in the namespace `marl`. On its node the actor runs `marl serve` as a
  subprocess (`marl.runner.launch.ServerProcess`, listening on the node's IP, killed with the actor however it dies) on
  the run's data dir for that server, with the run's admin token. It sees only the GPUs Ray gave the actor
  (CUDA_VISIBLE_DEVICES; empty without `resources: {GPU: n}`), and its `placement` indices number those from 0.
- Deaths: when its `marl serve` dies, the actor exits; Ray restarts a dead actor (`max_restarts=MAX_RESTARTS`) on a node
  that has its resources, and the new actor starts `marl serve` again on the same data dir, so the server resumes from
  its ledger and checkpoints, as `marl.runner.launch.Supervisor` does locally. `RaySupervisor` sees each new
  incarnation, reports it and calls `on_restart(name)`: the run then points the server's endpoint at its new URL. Once
  Ray gives up on an actor (restarts spent, or a server that could not start) `fatal` says which server and why.
- `RayCluster.play` is the coordinator's `GameRunner` for `run.ray.spread_games`: the game (env and players) runs as a
  Ray task on any node, spread over the nodes; leasing, lease renewal and the commit stay with `marl run`.
- `close()` stops the servers, kills the actors this run made and calls `ray.shutdown()`. Never `ray stop`: no Ray
  process that this run did not start is touched.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from marl.games.record import GameRecord
from marl.games.table import GameFailed, GameTable
from marl.runner.endpoints import StaticEndpoint
from marl.runner.launch import MAX_RESTARTS, RayGroup, ServerProcess, ServerWatch
from marl.topology import Problem, TopologyError
from marl.topology.bundles import RayBundles
from marl.topology.spec import RaySpec

log = logging.getLogger("marl.runner.ray_cluster")

NAMESPACE = "marl"
_START_TIMEOUT_S = 600.0  # placing an actor (a node may have to free its resources) and starting its server
_STOP_TIMEOUT_S = 30.0
_WATCH_S = 1.0  # how often an actor checks its server process


@ray.remote
class _ServerActor:
    """One `marl serve` on the node Ray placed this actor on; it lives and dies with its server process."""

    def __init__(self, options: dict[str, Any], group: str | None, ranks: bool):
        # its trainer's ranks (`ranks`) and vLLM's replicas after the first go into the bundles after its own
        # (`group`), started by the server (servers.trainers.ray_ranks, servers.engines.vllm_ray); None: neither
        joined = None if group is None else RayGroup(group, ray.get_runtime_context().gcs_address, ranks)
        self.process = ServerProcess(host=ray.util.get_node_ip_address(), die_with_parent=True,
                                     environment=server_gpu_environment(ray.get_gpu_ids()), ray_group=joined,
                                     **options).start()  # fmt: skip
        self.process.wait_healthy()
        self.incarnation = uuid.uuid4().hex  # new at every (re)start: how the driver tells a restart
        self.stopping = False
        threading.Thread(target=self._watch, name="watch-server", daemon=True).start()

    def where(self) -> dict[str, str]:
        return {"url": self.process.url, "node_id": ray.get_runtime_context().get_node_id(),
                "incarnation": self.incarnation}

    def stop(self) -> None:
        self.stopping = True
        self.process.stop()

    def _watch(self) -> None:
        """A dead server takes its actor with it: exiting with an error is what makes Ray restart the actor."""
        while not self.stopping:
            if self.process.exit_code() is not None:
                with open(self.process.log_path, "a") as log_file:
                    log_file.write(f"marl serve {self.process.describe_exit()}; its Ray actor exits for Ray to"
                                   " restart it\n")
                os._exit(1)
            time.sleep(_WATCH_S)


def server_gpu_environment(gpu_ids: Sequence[int | str]) -> dict[str, str]:
    """What GPUs a server actor's `marl serve` sees: the ones Ray gave the actor (`resources: {GPU: n}`), which its
    `placement` indices number from 0; none for an actor without GPUs (Ray would leave it seeing all of its node's)."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(gpu) for gpu in gpu_ids)}


@ray.remote(num_cpus=0, max_retries=0, scheduling_strategy="SPREAD")
def _play_game(table: GameTable, task_id: str, seed: int, leases: dict,
               statics: dict[str, StaticEndpoint], episode: int) -> GameRecord:
    # Never retried by Ray: a replay would add calls to leases that already have some; marl.games.schedule replays a
    # failed game itself, on new leases.
    try:
        return table.play(task_id, seed, leases, statics, episode=episode)
    except Exception as exc:  # noqa: BLE001 - sent back as a message: not every exception can be pickled
        raise GameFailed(f"game {task_id} failed on Ray node {ray.util.get_node_ip_address()}: {exc!r}") from None


class RayServer:
    """`marl run`'s handle on one server actor: the URL and node of its current incarnation."""

    def __init__(self, name: str, actor: ray.actor.ActorHandle, actor_name: str, log_path: Path,
                 report: Callable[[str], None], group: PlacementGroup | None = None):
        self.name, self.actor, self.actor_name, self.log_path, self.report = name, actor, actor_name, log_path, report
        self.group = group  # the server's placement group (its actor in bundle 0, its trainer's ranks after it)
        self.url = self.node_id = self.incarnation = ""
        self.restarts = 0
        self._asking: ray.ObjectRef | None = None  # a `where` call not answered yet

    def wait_healthy(self, timeout: float = _START_TIMEOUT_S) -> None:
        try:
            self.update(ray.get(self.actor.where.remote(), timeout=timeout))
            self.report(f"server {self.name} is up on {self.url} (Ray node {self.node_id[:12]})")
        except GetTimeoutError:
            raise RuntimeError(f"server {self.name} did not start within {timeout:g}s: no node had its resources"
                               f" free, or its server is slow to start (see {self.log_path}; `ray status`)") from None
        except RayActorError as exc:
            raise RuntimeError(f"server {self.name} could not start: {_last_line(exc)}; see {self.log_path}") from None

    def update(self, where: dict[str, str]) -> None:
        self.url, self.node_id, self.incarnation = where["url"], where["node_id"], where["incarnation"]

    def poll(self) -> dict[str, str] | None:
        """Where the actor is now, if it has answered since the last poll (never blocks). Raises `RayActorError`:
        `ActorDiedError` once Ray gave up on it, another while it restarts."""
        if self._asking is None:
            self._asking = self.actor.where.remote()
        ready, _ = ray.wait([self._asking], timeout=0)
        if not ready:
            return None
        asked, self._asking = self._asking, None
        return ray.get(asked)

    def placement(self) -> dict[str, str]:
        """What servers.json says of it besides its URL (so that a user or a test can find its actor)."""
        return {"ray_node_id": self.node_id, "ray_actor": self.actor_name, "ray_namespace": NAMESPACE}

    def stop(self) -> None:
        """Stop its server (SIGTERM: it drains and saves), then kill the actor for good."""
        try:
            ray.get(self.actor.stop.remote(), timeout=_STOP_TIMEOUT_S)
        except RayError as exc:  # dead or restarting: its server went (or goes) with it
            log.info("could not stop server %s through its actor: %s", self.name, _last_line(exc))
        ray.kill(self.actor, no_restart=True)
        if self.group is not None:
            remove_placement_group(self.group)


class RaySupervisor(ServerWatch):
    """Watches the server actors: reports every restart Ray made and hands it to `on_restart(name)` (the server's
    URL may have changed); `fatal` says which server Ray gave up on. Same interface as
    `marl.runner.launch.Supervisor`."""

    def __init__(self, servers: Mapping[str, RayServer], *, report: Callable[[str], None],
                 on_restart: Callable[[str], None], poll_s: float = 1.0):
        super().__init__(name="ray-supervisor", poll_s=poll_s)
        self.servers, self.report, self.on_restart = servers, report, on_restart

    def check(self) -> None:
        """One pass over the actors."""
        for name, server in self.servers.items():
            if self.fatal:
                return
            try:
                where = server.poll()
            except ActorDiedError as exc:
                self.fatal = (f"server {name}: Ray gave up on its actor after {server.restarts} restarts"
                              f" ({_last_line(exc)}); see {server.log_path}")
                continue
            except RayActorError:  # restarting
                continue
            if where is None or where["incarnation"] == server.incarnation:
                continue
            server.restarts += 1
            server.update(where)
            self.report(f"server {name} died and Ray restarted it ({server.restarts}/{MAX_RESTARTS}) on node"
                        f" {server.node_id[:12]}, now on {server.url}; log: {server.log_path}")
            self.on_restart(name)


class RayCluster:
    """This run's connection to Ray, the server actors it made, and the game runner of `run.ray.spread_games`."""

    def __init__(self, spec: RaySpec, run_name: str, *, report: Callable[[str], None]):
        """Join Ray at `spec.address`; `report(line)` tells the user where each server runs."""
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Worker output stays out of the live table: each server logs to its own file.
        options: dict[str, Any] = {"namespace": NAMESPACE, "log_to_driver": False}
        if spec.address == "local":
            options["include_dashboard"] = False
        sigterm = signal.getsignal(signal.SIGTERM)
        ray.init(address=spec.address, **options)
        if threading.current_thread() is threading.main_thread():
            # ray.init makes SIGTERM exit at once; `marl run`'s handler tears the run down first.
            signal.signal(signal.SIGTERM, sigterm)
        self.report = report
        self.run_id = f"{run_name}-{uuid.uuid4().hex[:8]}"
        self.servers: dict[str, RayServer] = {}

    def launch(self, name: str, options: dict[str, Any], bundles: RayBundles) -> RayServer:
        """Make server `name`'s placement group (`bundles`: its actor's, then one per trainer rank and one per vLLM
        replica after the first) and its actor in bundle 0 (`options`: `ServerProcess`'s); the actor starts its
        server in the background (`RayServer.wait_healthy` waits for it). Raises `TopologyError`, naming the key, if
        the cluster cannot hold the group."""
        actor_name = f"{self.run_id}.{name}"
        group = _placement_group(name, actor_name, bundles)
        options = {**options, "data_dir": Path(options["data_dir"]).resolve(),
                   "log_path": Path(options["log_path"]).resolve()}
        if Path(options["model"]).exists():  # a local directory: the same path on the node (a shared filesystem)
            options["model"] = str(Path(options["model"]).resolve())
        wanted = bundles.bundles[0]
        actor = _ServerActor.options(
            name=actor_name, max_restarts=MAX_RESTARTS, max_task_retries=0, **_actor_resources(wanted),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
        ).remote(options, actor_name if bundles.ranks or bundles.replicas else None, bool(bundles.ranks))
        more = [f"{bundles.ranks} trainer ranks of {_amounts(bundles.rank_bundle)}"] if bundles.ranks else []
        if bundles.replicas:
            more.append(f"{bundles.replicas} more vLLM replicas of {_amounts(bundles.replica_bundle)}")
        self.report(f"started Ray actor {actor_name} for server {name} ({options['model']}), asking for"
                    f" {_amounts(wanted)}{''.join(f' and {m}' for m in more)}")
        self.servers[name] = RayServer(name, actor, actor_name, options["log_path"], self.report, group)
        return self.servers[name]

    def supervisor(self, *, report: Callable[[str], None], on_restart: Callable[[str], None]) -> RaySupervisor:
        return RaySupervisor(self.servers, report=report, on_restart=on_restart)

    @staticmethod
    def play(table: GameTable, task_id: str, seed: int, leases: dict, statics: dict[str, StaticEndpoint],
             episode: int = 0) -> GameRecord:
        """A `marl.transaction.coordinator.GameRunner`: play the game as a Ray task on any node and wait for its
        record."""
        try:
            return ray.get(_play_game.remote(table, task_id, seed, leases, statics, episode))
        except RayTaskError as exc:  # its text is the whole remote traceback: keep the failure's own message
            if isinstance(exc.cause, GameFailed):
                raise exc.cause from None
            raise GameFailed(f"game {task_id} failed in a Ray task: {_last_line(exc)}") from None

    def close(self) -> None:
        """Leave Ray, and stop the instance if this run started it (`local`). The actors this run made, if still
        alive (`RayServer.stop` kills them first), die with the connection: they belong to this driver."""
        ray.shutdown()


def _placement_group(name: str, group_name: str, bundles: RayBundles) -> PlacementGroup:
    """The server's placement group, once Ray has reserved it; `TopologyError` naming the key if no node (or, with
    STRICT_PACK, no single node) can hold it, or it is not reserved within `_START_TIMEOUT_S`."""
    _check_placeable(name, bundles)
    group = placement_group([dict(b) for b in bundles.bundles], strategy=bundles.strategy, name=group_name)
    ready, _ = ray.wait([group.ready()], timeout=_START_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise TopologyError([Problem(f"servers.{name}.resources", f"Ray did not reserve the server's placement group"
                                     f" ({_amounts(bundles.total())} in {len(bundles.bundles)} bundles,"
                                     f" {bundles.strategy}) within {_START_TIMEOUT_S:g}s: other work holds those"
                                     " resources (`ray status`)")])
    return group


def _check_placeable(name: str, bundles: RayBundles) -> None:
    """Fail now, naming the key, rather than wait forever for nodes that do not exist."""
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    have = sorted({key for node in nodes for key in node if not key.startswith("node:")})
    nodes_have = f"(the {len(nodes)} nodes have: {', '.join(have)})"

    def fits(wanted: Mapping[str, float]) -> bool:
        return any(all(node.get(key, 0.0) >= amount for key, amount in wanted.items()) for node in nodes)

    problem = None
    if not fits(bundles.bundles[0]):
        problem = Problem(f"servers.{name}.resources", f"no node of the Ray cluster has {_amounts(bundles.bundles[0])}"
                          f" {nodes_have}; give it resources that one node has, or add such a node (ray start"
                          " --resources=...)")
    elif bundles.ranks and not fits(bundles.rank_bundle):
        problem = Problem(f"servers.{name}.rank_resources", f"no node of the Ray cluster has"
                          f" {_amounts(bundles.rank_bundle)} for a trainer rank {nodes_have}; give rank_resources"
                          " that a node has, or add such nodes")
    elif bundles.replicas and not fits(bundles.replica_bundle):
        problem = Problem(f"servers.{name}.replica_resources", f"no node of the Ray cluster has"
                          f" {_amounts(bundles.replica_bundle)} for a vLLM replica {nodes_have}; give"
                          " replica_resources that a node has, or add such nodes")
    elif bundles.strategy == "STRICT_PACK" and not fits(bundles.total()):
        problem = Problem(f"servers.{name}.placement.nodes", f"no node of the Ray cluster holds the server and its"
                          f" {_members(bundles)} together ({_amounts(bundles.total())}) {nodes_have}; let"
                          " them span machines (placement.nodes: 2 or more), or ask for less")
    elif not all(sum(node.get(key, 0.0) for node in nodes) >= amount for key, amount in bundles.total().items()):
        key = "rank_resources" if bundles.ranks else "replica_resources"
        problem = Problem(f"servers.{name}.{key}", f"the Ray cluster has less than the server and its"
                          f" {_members(bundles)} ask for ({_amounts(bundles.total())}) {nodes_have}")
    if problem is not None:
        raise TopologyError([problem])


def _members(bundles: RayBundles) -> str:
    """What shares the server's group, in words."""
    parts = [f"{bundles.ranks} trainer ranks"] * bool(bundles.ranks)
    return " and ".join(parts + [f"{bundles.replicas} more vLLM replicas"] * bool(bundles.replicas))


def _actor_resources(wanted: Mapping[str, float]) -> dict[str, Any]:
    """Ray's actor options for `wanted` (a bundle's resources)."""
    custom = {key: amount for key, amount in wanted.items() if key not in ("CPU", "GPU", "memory")}
    return {"num_cpus": wanted.get("CPU", 1.0), "num_gpus": wanted.get("GPU", 0), "memory": wanted.get("memory"),
            "resources": custom}


def _amounts(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{key}: {amount:g}" for key, amount in resources.items())


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
