"""`marl run TOPOLOGY.yaml [key=value ...]`: start what runs locally, connect to the rest, play games, train.

The run directory (`run.run_dir`, default `runs/<name>`) gets:
  topology.yaml             the resolved topology (overrides applied)
  logs/<server>.log         output of every local server (logs/<past_of server>/ and logs/eval/: one per snapshot)
  servers/<server>/         each local server's data dir: ledger, checkpoints, metrics.jsonl (one line per step)
  games.jsonl               one `GameRecord` per finished game: task, rewards per role, policy versions, invalid
                            actions, replies, the winner (for games with teams), the transcript and the env's
                            summary (`run.transcripts`; `marl games show RUN_DIR`)
  reward_curves.png         mean reward per role against each trainable server's policy version (`marl plot`)
  servers.json              where the local servers listen, for `marl overwatch TOPOLOGY.yaml` (owner-only)
  decisions.sqlite          the two-phase commit decisions of games across several servers
                            (`marl.transaction.decision_log`)
  evals.jsonl, evals.png    with `run.eval_every`: greedy games between checkpoints as training goes (marl/eval/)
  exploitability.jsonl,     with `run.eval_exploitability` too: each evaluation's distance from a Nash equilibrium
  exploitability.png        (marl/eval/exploitability_curve.py)

The run stops after `run.games` games (exactly that many are played and recorded), once every trainable server took
`run.max_steps` training steps, or when it gives up: a game that failed `run.max_failures` times in a row, a local
server that died more than `marl.runner.launch.MAX_RESTARTS` (3) times, a server that keeps stopping with an error
(`RunSummary.error` says which; `marl run` then exits 1). Ctrl-C (or SIGTERM) aborts every open lease and stops the
servers this run started.

Who does what: `marl.runner.launch` starts and supervises the local servers, `marl.runner.server_watch.ServerMonitor`
watches every trainable server (lease gating, revival, the live table), `marl.transaction.coordinator` plays one game,
`marl.games.schedule` schedules them; `marl.league` serves the snapshots of past_of servers, `marl.eval.periodic`
evaluates checkpoints every `run.eval_every` steps; this module wires them together and shows the live table and the
summary.

With `run.ray` (docs/ray.md), `marl.runner.ray_cluster` starts and supervises the local servers instead, as Ray actors,
and with `run.ray.spread_games` plays each game as a Ray task. A server actor that Ray restarted may listen on a new
URL: `_Session._server_restarted` points its endpoint (which the monitor and the coordinator read at every use) and
servers.json at it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from marl.client import SwarmClient, SwarmError
from marl.eval.exploitability_curve import check_measurable
from marl.eval.info_states import PolicySeats
from marl.eval.periodic import PeriodicEval
from marl.games.record import GameRecord, append_game
from marl.games.schedule import CallbackFailed, FailedAttempt, episodes, play_games
from marl.games.table import ExploringStarts
from marl.league import SnapshotPool, snapshot_pools
from marl.plan import plan_topology
from marl.protocol import ADMIN_TOKEN_ENV, EngineState, ServerStatus
from marl.runner.endpoints import Endpoint, SnapshotPoolEndpoint, StaticEndpoint, TrainableEndpoint
from marl.runner.launch import (
    SERVERS_FILE,
    ServerProcess,
    ServerStartError,
    ServerWatch,
    Supervisor,
    last_error_line,
    port_in_use,
    threads_per_server,
)
from marl.runner.server_watch import ServerMonitor, ServerView
from marl.runner.stall_watch import LearnerNeeds, StallWatch
from marl.topology import Problem, ServerKind, ServerSpec, Topology, TopologyError
from marl.topology.bundles import ray_bundles
from marl.topology.graph import LEARNER_SEPARATOR
from marl.topology.spec import VLLMSpec
from marl.transaction.coordinator import Coordinator, GameSettings
from marl.transaction.decision_log import DecisionLog
from marl.transaction.two_phase import redrive
from marl.watching.collapse import CollapseWatch
from marl.watching.plot import percent, plot_run, summarize_games
from marl.watching.terminal import safe

if TYPE_CHECKING:  # imported at run time only with run.ray: a run without it never imports ray
    from marl.runner.ray_cluster import RayCluster, RayServer, RaySupervisor

log = logging.getLogger("marl.runner.run")
#: the live table's and the closing line's "recent reward" is the mean over this many games per role
RECENT_GAMES = 50
#: seconds between two progress lines where the live table is not drawn (stdout is not a terminal)
PROGRESS_EVERY_S = 30.0


@dataclass
class RunSummary:
    run_dir: Path
    games: int  # games played and recorded in games.jsonl
    failed: int  # failed attempts (each failed game is replayed)
    retried: int  # replays of failed games
    seconds: float
    policy_versions: dict[str, int]
    interrupted: bool = False
    error: str | None = None  # why the run gave up: a game that kept failing, a server that kept dying


class _Board:
    """The run's tallies and its games.jsonl; renders the live table (with the monitor's view of the servers)."""

    def __init__(self, games_path: Path, target: int | None):
        self.lock = threading.Lock()
        self.target = target
        self.games = self.failed = self.retried = 0
        # role -> the last RECENT_GAMES rewards (bounded: a run of 100,000 games keeps no more than 50 per role)
        self.rewards: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=RECENT_GAMES))
        # role -> what it did in those games, as the env's categories (where the env labels actions)
        self.actions: dict[str, deque[str]] = defaultdict(lambda: deque(maxlen=RECENT_GAMES))
        self.last_error = ""
        self._file = open(games_path, "a")

    def record(self, result: GameRecord) -> int:
        """Write `result` to games.jsonl and count it; returns the games recorded so far."""
        with self.lock:
            append_game(self._file, result)  # first: a game counts once it is in games.jsonl
            self.games += 1
            for role, reward in result.role_rewards.items():
                self.rewards[role].append(reward)
            for role, labels in result.actions.items():
                self.actions[role].extend(labels)
            return self.games

    def failure(self, failure: FailedAttempt) -> None:
        with self.lock:
            self.failed += 1
            self.retried += failure.retrying
            self.last_error = str(failure.error)

    def close(self) -> None:
        with self.lock:
            try:
                self._file.close()
            except OSError as exc:  # only a line whose write already failed, and ended the run saying so, is lost
                log.warning("could not close games.jsonl: %s", exc)

    def recent_rewards(self) -> dict[str, float]:
        """Mean reward per role over the last RECENT_GAMES games."""
        with self.lock:
            return {role: sum(v) / len(v) for role, v in sorted(self.rewards.items())}

    def action_counts(self) -> dict[str, Counter[str]]:
        """Per role, how often it made each labelled move over the last RECENT_GAMES games."""
        with self.lock:
            return {role: Counter(labels) for role, labels in sorted(self.actions.items()) if labels}

    def recent_actions(self) -> dict[str, str]:
        """Per role, the shares of what it did over the last RECENT_GAMES games ("pick 3 80%, pick 1 20%"): a
        role that collapsed onto one answer shows it here first."""
        return {role: ", ".join(f"{label} {n / sum(c.values()):.0%}" for label, n in c.most_common())
                for role, c in self.action_counts().items()}

    def table(self, name: str, started: float, servers: dict[str, ServerView]) -> Table:
        rewards = ", ".join(f"{role} {mean:.2f}" for role, mean in self.recent_rewards().items())
        with self.lock:
            games = f"{self.games}/{self.target}" if self.target else str(self.games)
            table = Table(title=f"marl run {name} — {games} games, {self.failed} failed attempts, {self.retried}"
                                f" retries, {time.monotonic() - started:.0f}s", title_justify="left")
            caption = f"reward (last {RECENT_GAMES} games): {rewards or '-'}"
            if self.last_error:  # its text may quote what a client sent: escaped, and never read as markup
                caption += f"\nlast failure: {safe(self.last_error[:160])}"
            table.caption = Text(caption)
        for column in ("server", "state", "version", "pool (groups / episodes)", "leases"):
            table.add_column(column)
        for server, view in servers.items():
            status, pool = view.status, view.status.pool if view.status else None
            table.add_row(server, Text(safe(view.error)) if view.error else (status.state.value if status else "?"),
                          str(status.policy_version) if status else "?",
                          f"{pool.complete_groups}/{pool.batch_size} · {pool.pending_episodes}" if pool else "-",
                          str(pool.running_leases) if pool else "-")
        return table


def run(path: str, overrides: list[str] | None = None, *, console: Console | None = None) -> RunSummary:
    console = console or Console(soft_wrap=True)  # long lines (paths, URLs) stay whole in logs
    topology = Topology.load(path, overrides or [])
    check_memory_plan(topology, path, console)
    seats = check_measurable(topology, path)  # run.eval_exploitability: a game a solver can check
    for warning in topology.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    run_dir = Path(topology.spec.run.run_dir or f"runs/{topology.name}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "topology.yaml").write_text(yaml.safe_dump(topology.to_dict(), sort_keys=False))
    started = time.monotonic()
    session = _Session(topology, run_dir, console, seats)
    previous_sigterm = _sigterm_as_ctrl_c()
    try:
        session.start()
        session.play(started)
    except KeyboardInterrupt:
        session.interrupted = True
    finally:
        _restore_sigterm(previous_sigterm)
        session.shut_down()
    plot_run(run_dir)
    _print_summary(run_dir, console)
    summary = session.summary(time.monotonic() - started)
    if summary.error:
        console.print("[red]gave up:[/]", Text(safe(summary.error)))
    ending = "interrupted" if summary.interrupted else "stopped" if summary.error else "done"
    console.print(f"{ending}: {summary.games} games, {summary.failed}"
                  f" failed attempts, {summary.retried} retries in {summary.seconds:.0f}s; policy versions"
                  f" {summary.policy_versions}; see {run_dir}")
    return summary


def check_memory_plan(topology: Topology, source: str, console: Console) -> None:
    """`marl plan`'s check before anything starts: TopologyError at the keys to change when a device cannot hold
    what the topology puts on it; its warnings printed."""
    plan = plan_topology(topology.spec)
    if plan.problems:
        raise TopologyError([Problem(p.key, f"{p.message} (`marl plan {source}` shows the memory per device)")
                             for p in plan.problems], source=source)  # fmt: skip
    for note in (n for server in plan.servers for n in server.notes if n.startswith("warning:")):
        console.print(f"[yellow]{note}[/]")
    for server_plan in plan.servers:  # what the topology leaves out, as the plan sized it, for the servers we start
        server = topology.spec.servers[server_plan.server]
        if server.is_local and server_plan.defaults:
            sized = {key.removeprefix("vllm."): value for key, value in server_plan.defaults.items()}
            server.vllm = (server.vllm or VLLMSpec()).model_copy(update=sized)


class _Session:
    """One `marl run`: its local servers, monitor, coordinator and games. `shut_down` undoes whatever `start` did."""

    def __init__(self, topology: Topology, run_dir: Path, console: Console, seats: PolicySeats | None = None):
        self.topology, self.spec, self.run_dir, self.console = topology, topology.spec, run_dir, console
        self.seats = seats  # run.eval_exploitability: the game's seats, whose policies each evaluation measures
        self.plain = not console.is_terminal  # a pipe, a log, nohup: timestamped lines instead of the live table
        self.max_failures = self.spec.run.max_failures
        self.board = _Board(run_dir / "games.jsonl", self.spec.run.games)
        self.collapse = CollapseWatch()  # warns once when a role's replies stopped varying and its reward is flat
        self.token = ""  # the admin token of the local servers
        self.processes: dict[str, ServerProcess | RayServer] = {}
        self.endpoints: dict[str, Endpoint] = {}
        self.pools: dict[str, SnapshotPool] = {}
        self.evals: PeriodicEval | None = None
        self.cluster: RayCluster | None = None  # with run.ray
        self.supervisor: Supervisor | RaySupervisor | None = None
        self.monitor: ServerMonitor | None = None
        self.coordinator: Coordinator | None = None
        self.decisions: DecisionLog | None = None  # the two-phase commits of games across several servers
        self.error: str | None = None  # a game that kept failing
        self.stalls: StallWatch | None = None
        self.stalled: str | None = None  # why a learner can never take a step (run.on_stall: stop)
        self.interrupted = False

    def start(self) -> None:
        token = self.token = os.environ.get(ADMIN_TOKEN_ENV) or secrets.token_urlsafe(24)
        self.decisions = DecisionLog(self.run_dir / "decisions.sqlite")
        self.pools = snapshot_pools(self.topology, self.run_dir, token, seed=self.spec.run.seed,
                                    url_of=lambda server: self.processes[server].url)
        if self.spec.run.ray is not None:
            from marl.runner.ray_cluster import RayCluster

            self.cluster = RayCluster(self.spec.run.ray, self.spec.name, report=self.console.print)
        endpoints = self.endpoints = _start_servers(self.topology, self.run_dir, token, self.processes, self.pools,
                                                    self.say, self._launch)
        self.supervisor = (self.cluster.supervisor(report=self._report_death, on_restart=self._server_restarted)
                           if self.cluster else Supervisor(self.processes, report=self._report_death))
        self.supervisor.start()
        self._finish_earlier_commits(endpoints, token)
        self.monitor = ServerMonitor({name: endpoints[name] for name in self.topology.learners()},
                                     max_revivals=self.max_failures, on_step=self._step_done).start()
        run = self.spec.run
        self.coordinator = Coordinator(
            env_factory=self.topology.make_env,
            role_servers=self.topology.role_learners(),
            endpoints=endpoints,
            settings=GameSettings(lease_timeout_s=run.lease_timeout_s, max_tokens=run.max_tokens,
                                  temperature=run.temperature, transcripts=run.transcripts,
                                  sampling={role: spec.sampling.overrides() for role, spec in self.spec.roles.items()
                                            if spec.sampling is not None},
                                  explore=ExploringStarts(**run.explore.model_dump()) if run.explore else None),
            linked_servers=self.topology.linked_learners(),
            monitor=self.monitor,
            decisions=self.decisions,
            runner=self.cluster.play if self.cluster and run.ray.spread_games else None,
        )
        self.stalls = _stall_watch(self.topology, endpoints)
        if run.eval_every is not None:
            self.evals = PeriodicEval(self.topology, self.run_dir, token, seats=self.seats,
                                      report=self.console.log).start()

    def _launch(self, name: str, server: ServerSpec) -> ServerProcess | RayServer:
        """Start local server `name`: a `marl serve` process here, or with run.ray a Ray actor that runs one."""
        options = dict(model=server.model, revision=server.revision, admin_token=self.token,
                       data_dir=self.run_dir / "servers" / name, log_path=self.run_dir / "logs" / f"{name}.log",
                       static=not server.trainable, device=server.device, port=server.port,
                       prefix_cache_gb=server.prefix_cache_gb,
                       engine=server.engine or "torch", vllm=server.vllm, placement=server.placement,
                       policies={name: policy.lora for name, policy in (server.policies or {}).items()})
        if self.cluster is not None:
            return self.cluster.launch(name, options, ray_bundles(server))
        if server.port is not None and port_in_use("127.0.0.1", server.port):
            raise ServerStartError(f"servers.{name}.port: port {server.port} is taken (address already in use): stop"
                                   f" what listens there, or change servers.{name}.port (or remove it: a free port is"
                                   " picked)")
        environment = threads_per_server(len(self.topology.local_servers()))
        process = ServerProcess(**options, environment=environment).start()
        threads = f", OMP_NUM_THREADS={environment['OMP_NUM_THREADS']}" if environment else ""
        self.say(f"started {server.kind.value} server {name} ({server.model}{threads}) on {process.url}")
        return process

    def say(self, line: str, style: str = "", *, log: bool = False) -> None:
        """Tell the user `line`: in a terminal above the live table (`log`: with the time, as rich logs), else as a
        plain timestamped line (a pipe or a log file, where the table is not drawn)."""
        if self.plain:
            self.console.print(Text(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}", style=style), soft_wrap=True)
        elif log:
            self.console.log(Text(line, style=style))
        else:
            self.console.print(Text(line, style=style))

    def _report_death(self, line: str) -> None:
        self.say(line, "red", log=True)

    def _server_restarted(self, name: str) -> None:
        """Ray restarted server `name`'s actor, maybe on another node or port: point its endpoint and servers.json
        at its URL now (the monitor then finds it OFFLINE and starts its engine)."""
        for learner in self._learners_of(name):
            _repoint(self.endpoints[learner], self.processes[name].url, self.token)
        _write_servers_file(self.run_dir, self.processes, self.token)

    def _learners_of(self, server: str) -> list[str]:
        """The endpoints of local server `server`: its learners (one per policy), or itself."""
        learners = [name for name, (owner, _) in self.topology.learners().items() if owner == server]
        return learners or [server]

    def play(self, started: float) -> None:
        run = self.spec.run

        def table() -> Table:
            return self.board.table(self.spec.name, started, self.monitor.views())

        self.say(f"playing games, {run.concurrency} at a time")
        progress = _Progress(self, PROGRESS_EVERY_S).start() if self.plain else None  # the table is not drawn
        try:
            with Live(get_renderable=table, console=self.console, refresh_per_second=1):
                stats = play_games(self.coordinator, episodes(self.spec.name, run.repeats or 1, run.seed),
                                   concurrency=run.concurrency, games=run.games, max_failures=self.max_failures,
                                   should_stop=self._should_stop, on_result=self._record,
                                   on_failure=self.board.failure, keep_results=False)  # games.jsonl has them
        except CallbackFailed as exc:  # e.g. games.jsonl could not be written: the run stops and says so (exit 1)
            self.console.print()
            self.error = str(exc)
            return
        finally:
            if progress is not None:
                progress.close()
        self.console.print()  # the live table's last line has no newline of its own
        self.error = stats.error or self.stalled

    def _record(self, result: GameRecord) -> None:
        if self.board.record(result) == 1:
            self.say(f"first game done ({result.turns} turns, {result.seconds:.1f}s)", log=True)
        if self.stalls is not None:
            for reason in self.stalls.observe(result, self.monitor.versions(self.stalls.needs)):
                self._stall(reason)

    def _stall(self, reason: str) -> None:
        """A learner can never fill a batch: stop (the default) or, with run.on_stall: warn, say so and go on."""
        if self.spec.run.on_stall == "stop":
            self.stalled = self.stalled or f"{reason} (run.stall_batches; run.on_stall: warn goes on)"
            self.say(f"stopping: {reason}", "red", log=True)
        else:
            self.say(f"warning: {reason}; going on (run.on_stall: warn)", "yellow", log=True)

    def progress_line(self, interval_s: float, games_before: int) -> str:
        """Games so far and per minute over the last `interval_s` seconds (`games_before` at its start), failed
        attempts, and each trainable server's state, version and pool."""
        rate = (self.board.games - games_before) * 60 / interval_s if interval_s > 0 else 0.0
        servers = ", ".join(_server_progress(name, view) for name, view in self.monitor.views().items())
        return f"{self.board.games} games ({rate:.1f}/min), {self.board.failed} failed attempts; {servers}"

    def _should_stop(self) -> bool:
        if self._fatal() or self.stalled:
            return True
        max_steps = self.spec.run.max_steps
        if max_steps is None:
            return False
        versions = self.monitor.versions(self.coordinator.linked)
        return bool(versions) and all(v >= max_steps for v in versions.values())

    def _fatal(self) -> str | None:
        return (self.supervisor and self.supervisor.fatal) or (self.monitor and self.monitor.fatal) or None

    def _step_done(self, server: str, status: ServerStatus) -> None:
        """The monitor saw a new policy version: one line per training step, so progress shows in logs too (a step
        that trained no token says so instead: it is not progress)."""
        rewards = {role: round(mean, 3) for role, mean in self.board.recent_rewards().items()}
        actions = self.board.recent_actions()
        shares = f"; recent actions {json.dumps(actions)}" if actions else ""
        metrics = status.metrics
        if metrics.get("tokens_trained") == 0:
            self.say(f"{server}: step {status.policy_version} trained nothing (no group had a learning signal:"
                     f" {metrics.get('groups_zero_variance', 0):.0f} of {metrics.get('groups', 0):.0f} of zero reward"
                     f" variance); {metrics.get('train_steps_empty', 0):.0f} such steps so far{shares}", "yellow",
                     log=True)
        else:
            self.say(f"{server}: step {status.policy_version} done; {self.board.games} games;"
                     f" recent reward {json.dumps(rewards)}{shares}", log=True)
        for warning in self.collapse.observe(server, status.metrics, self.board.action_counts()):
            self.say(f"warning: {warning}", "yellow", log=True)

    def _finish_earlier_commits(self, endpoints: dict[str, Endpoint], token: str) -> None:
        """A run that stopped inside a game's two-phase commit: apply its logged decision on every server of the
        game that can be reached (the others resolve it from the log at their prepared episode's deadline)."""
        tokens = {}
        for name, (server_name, _) in self.topology.learners().items():
            server = self.spec.servers[server_name]
            remote = server.kind == ServerKind.REMOTE_SWARM
            tokens[endpoints[name].client.url] = os.environ.get(server.admin_token_env or "") if remote else token
        for game_id, outcome in redrive(self.decisions, tokens).items():
            left = f"; {', '.join(outcome.pending)} will resolve it from the log" if outcome.pending else ""
            self.say(f"finished the commit of game {game_id} from an earlier run: {outcome.decision.value}" + left)

    def shut_down(self) -> None:
        if self.supervisor is not None:
            self.supervisor.close()  # first: a server stopped below has not died
        if self.evals is not None:
            self.evals.close()
        if self.coordinator is not None:
            aborted = self.coordinator.abort_all()
            if aborted:
                self.say(f"aborted {aborted} open leases")
            self.coordinator.close()
        if self.monitor is not None:
            self.monitor.close()
        self.board.close()
        if self.decisions is not None:
            self.decisions.close()
        stops = [*(proc.stop for proc in self.processes.values()), *(pool.close for pool in self.pools.values())]
        with ThreadPoolExecutor(len(stops) or 1) as stopping:  # together: each may drain in-flight calls
            list(stopping.map(lambda stop: stop(), stops))
        if self.processes:
            self.say(f"stopped {len(self.processes)} local servers")
        if self.cluster is not None:
            self.cluster.close()

    def summary(self, seconds: float) -> RunSummary:
        versions = self.monitor.versions() if self.monitor else {}
        return RunSummary(run_dir=self.run_dir, games=self.board.games, failed=self.board.failed,
                          retried=self.board.retried, seconds=seconds, policy_versions=versions,
                          interrupted=self.interrupted, error=self.error or self._fatal())


class _Progress(ServerWatch):
    """Where stdout is not a terminal (`| tee`, nohup, CI) rich draws no live table: a plain progress line every
    `every_s` seconds instead (`_Session.progress_line`)."""

    def __init__(self, session: _Session, every_s: float):
        super().__init__(name="progress", poll_s=every_s)
        self.session = session
        self._last = (time.monotonic(), 0)

    def check(self) -> None:
        then, games = self._last
        self._last = (time.monotonic(), self.session.board.games)
        self.session.say(self.session.progress_line(self._last[0] - then, games))


def _server_progress(name: str, view: ServerView) -> str:
    """One trainable server in a progress line: state, policy version, pool."""
    status = view.status
    if view.error is not None or status is None:
        return f"{name} unreachable"
    pool = status.pool
    return f"{name} {status.state.value} v{status.policy_version}" + (
        f" pool {pool.complete_groups}/{pool.batch_size} groups" if pool else "")


def _print_summary(run_dir: Path, console: Console) -> None:
    stats = summarize_games(run_dir)
    if not stats:
        return
    table = Table(title=f"games in {run_dir / 'games.jsonl'}", title_justify="left")
    for column in ("role", "games", "mean reward", "valid replies", "won"):
        table.add_column(column, justify="left" if column == "role" else "right")
    for role, row in stats.items():
        if role != "all":
            table.add_row(role, str(int(row["games"])), f"{row['mean_reward']:.3f}",
                          *(percent(row[key]) for key in ("valid_reply_rate", "win_rate")))
    if "all" in stats:
        table.caption = f"{stats['all']['games_per_hour']:.0f} games/hour"
    console.print(table)


def _sigterm_as_ctrl_c() -> dict | None:
    """Ctrl-C and a scheduler's SIGTERM (Slurm, Kubernetes, `kill`) both clean up: abort leases, stop servers.

    SIGINT gets Python's handler even if this process inherited it ignored (started in the background by a
    non-interactive shell, as CI runners and nohup do): a run must always be stoppable the same way.
    """
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    return {signal.SIGTERM: signal.signal(signal.SIGTERM, interrupt),
            signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}


def _restore_sigterm(previous: dict | None) -> None:
    for signum, handler in (previous or {}).items():
        signal.signal(signum, handler)


def _start_servers(topology: Topology, run_dir: Path, token: str, processes: dict[str, ServerProcess | RayServer],
                   pools: dict[str, SnapshotPool], say: Callable[[str], None],
                   launch: Callable[[str, ServerSpec], ServerProcess | RayServer]) -> dict[str, Endpoint]:
    """Start the local servers with `launch` (into `processes`, so a failure here still stops them) and the first
    snapshots of every past_of server (`pools`), connect to every server, sync the trainable ones' configs and start
    their engines; returns how the coordinator reaches each. `ServerStartError` names a server that did not come up
    and why. `say` tells the user each stage."""
    spec = topology.spec
    for name in topology.local_servers():
        processes[name] = launch(name, spec.servers[name])
    for proc in processes.values():
        proc.wait_healthy()
    if processes:
        say(f"{len(processes)} local servers answer; loading models (an alias such as smollm2-135m is built into"
            " the cache on first use, about a minute; the servers' logs are in " f"{run_dir / 'logs'})")
    _write_servers_file(run_dir, processes, token)
    learners = topology.learners()
    endpoints = {name: _endpoint(topology, name, processes, pools, token) for name, server in spec.servers.items()
                 if not server.policies}  # a server of policies is reached as its learners
    endpoints.update({name: _endpoint(topology, server, processes, pools, token, policy=policy)
                      for name, (server, policy) in learners.items() if policy is not None})
    started = time.monotonic()

    def boot(name: str) -> None:
        endpoint = endpoints[name]
        if name in pools:
            pool = pools[name].start()
            source = pool.spec.server + (f"{LEARNER_SEPARATOR}{pool.spec.policy}" if pool.spec.policy else "")
            say(f"past_of server {name} serves snapshots {pool.versions()} of {source}")
            return
        process = processes.get(learners[name][0] if name in learners else name)
        try:
            if endpoint.trainable:
                endpoint.client.auto_sync_train_config_and_start_engine(endpoint.train_config)
            elif process is not None:  # a local static server loads its model at start-up
                with SwarmClient(process.url, admin_token=token, max_wait_s=3600) as client:
                    client.wait_until_state(EngineState.STATIC)
            else:
                return
        except SwarmError as exc:
            raise _boot_failure(name, exc, process) from None
        say(f"{name}: model loaded, engine running ({time.monotonic() - started:.0f}s)")

    with ThreadPoolExecutor(len(endpoints) or 1) as pool:
        list(pool.map(boot, list(endpoints)))
    return endpoints


def _boot_failure(name: str, exc: SwarmError, process: ServerProcess | RayServer | None) -> ServerStartError:
    """Why server `name`'s engine did not start, in one line: the server's answer, or how its process ended and its
    log's last error line."""
    log_path = getattr(process, "log_path", None)
    exit_code = process.exit_code() if isinstance(process, ServerProcess) else None
    if exit_code is not None:
        why = f"its process {process.describe_exit()}"
        last = last_error_line(log_path, since=process.log_start)
        why += f": {last}" if last else ""
    else:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return ServerStartError(f"server {name} did not start its engine: {why}"
                            + (f" (log: {log_path})" if log_path else ""))


def _endpoint(topology: Topology, name: str, processes: dict[str, ServerProcess | RayServer],
              pools: dict[str, SnapshotPool], token: str, *, policy: str | None = None) -> Endpoint:
    """How the coordinator reaches server `name`: a swarm client (trainable; bound to `policy`, one of its LoRA
    policies, for that learner), an OpenAI-compatible URL, or a pool of snapshots (past_of)."""
    server, run = topology.spec.servers[name], topology.spec.run
    if server.kind == ServerKind.PAST_SNAPSHOTS:
        return SnapshotPoolEndpoint(name, pools[name])
    if server.kind == ServerKind.LOCAL_TRAINABLE:
        client = SwarmClient(processes[name].url, admin_token=token, max_wait_s=3600, policy=policy)
    elif server.kind == ServerKind.REMOTE_SWARM:
        client = SwarmClient(server.swarm_url, admin_token=os.environ.get(server.admin_token_env or ""),
                             max_wait_s=3600, policy=policy)
    elif server.kind == ServerKind.LOCAL_STATIC:
        return StaticEndpoint(name, base_url=processes[name].url + "/v1", model=server.model)
    else:
        return StaticEndpoint(name, base_url=server.url, model=server.model,
                              api_key=os.environ.get(server.api_key_env or "", "none"))
    train = server.policy_train(policy) if policy is not None else server.train
    learner = f"{name}{LEARNER_SEPARATOR}{policy}" if policy is not None else name
    return TrainableEndpoint(learner, client=client, max_concurrency=run.per_server_concurrency, train_config=train)


def _stall_watch(topology: Topology, endpoints: dict[str, Endpoint]) -> StallWatch:
    """The stall watch of the run's linked learners: each one's roles, and the games a batch of its takes."""
    run, seating = topology.spec.run, topology.role_learners()
    needs = {}
    for learner in topology.linked_learners():
        train = getattr(endpoints[learner], "train_config", None)
        batch = train.batch_size * train.num_repeat if train is not None else 1
        if train is not None and train.overlap:  # rollouts may run max_staleness batches ahead of a slow step
            batch *= 1 + train.max_staleness
        needs[learner] = LearnerNeeds(tuple(role for role, who in seating.items() if who == learner), batch)
    return StallWatch(needs, stall_batches=run.stall_batches, in_flight=run.concurrency)


def _repoint(endpoint: Endpoint, url: str, token: str) -> None:
    """Point a local server's endpoint at its new `url`; the monitor and the coordinator read `client` and `base_url`
    at every use, so the next read goes there."""
    if isinstance(endpoint, StaticEndpoint):
        endpoint.base_url = url + "/v1"
    else:  # the old client is left open: other threads may still hold it, and its connections died with the server
        endpoint.client = SwarmClient(url, admin_token=token, max_wait_s=3600, policy=endpoint.client.policy)


def _write_servers_file(run_dir: Path, processes: dict[str, ServerProcess | RayServer], token: str) -> None:
    """Where the local servers listen, for `marl overwatch TOPOLOGY.yaml`; owner-only, it holds the admin token.
    A Ray server actor also says where it runs (node, actor name)."""
    servers = {}
    for name, proc in processes.items():
        servers[name] = {"url": proc.url, "admin_token": token}
        if not isinstance(proc, ServerProcess):
            servers[name].update(proc.placement())
    path = run_dir / SERVERS_FILE
    tmp = path.with_name(SERVERS_FILE + ".tmp")  # replaced whole: a reader never sees half a file
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(servers, f, indent=2)
    tmp.replace(path)
