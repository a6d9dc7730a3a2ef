"""`marl run TOPOLOGY.yaml [key=value ...]`: start what runs locally, connect to the rest, play games, train.

The run directory (`run.run_dir`, default `runs/<name>`) gets:
  topology.yaml             the resolved topology (overrides applied)
  logs/<server>.log         output of every local server
  servers/<server>/         each local server's data dir: ledger, checkpoints, metrics.jsonl (one line per step)
  games.jsonl               one line per finished game: task, rewards per role, policy versions, invalid actions,
                            the winner (for games with teams)
  reward_curves.png         mean reward per role against each trainable server's policy version (`marl plot`)
  servers.json              where the local servers listen, for `marl overwatch TOPOLOGY.yaml` (owner-only)
Ctrl-C aborts every open lease and stops the servers this run started.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml
from rich.console import Console
from rich.live import Live
from rich.table import Table

from marl.client import SwarmClient, SwarmError
from marl.coordinator import (
    Coordinator,
    Endpoint,
    GameResult,
    GameSettings,
    play_games,
    tasks,
)
from marl.launch import SERVERS_FILE, ServerProcess
from marl.plot import percent, plot_run, summarize_games
from marl.protocol import EngineState
from marl.topology import ServerKind, Topology

log = logging.getLogger("marl.run")

MAX_RESTARTS = 3  # deaths of one local server that `marl run` repairs before it gives up


@dataclass
class RunSummary:
    run_dir: Path
    games: int
    failed: int
    seconds: float
    policy_versions: dict[str, int]
    interrupted: bool = False
    error: str | None = None  # why the run gave up (a local server that keeps dying)


class _Board:
    """What the live display and the stop condition read: per-server status and the game tallies."""

    def __init__(self, trainable: list[str]):
        self.lock = threading.Lock()
        self.status: dict[str, dict] = {name: {} for name in trainable}
        self.games = 0
        self.failed = 0
        self.rewards: dict[str, list[float]] = defaultdict(list)  # role -> recent rewards
        self.last_error = ""
        self.fatal: str | None = None  # set when the run must stop (a local server that keeps dying)

    def recent_rewards(self, games: int = 50) -> dict[str, float]:
        """Mean reward per role over the last `games` games (call with the lock held)."""
        return {role: sum(v[-games:]) / len(v[-games:]) for role, v in sorted(self.rewards.items())}

    def versions(self) -> dict[str, int]:
        with self.lock:
            return {name: s.get("policy_version", 0) for name, s in self.status.items()}

    def table(self, name: str, started: float) -> Table:
        with self.lock:
            table = Table(title=f"marl run {name} — {self.games} games, {self.failed} failed,"
                                f" {time.monotonic() - started:.0f}s", title_justify="left")
            for column in ("server", "state", "version", "pool (groups / episodes)", "leases"):
                table.add_column(column)
            for server, s in self.status.items():
                pool = s.get("pool") or {}
                table.add_row(server, s.get("state", "?"), str(s.get("policy_version", "?")),
                              f"{pool.get('complete_groups', 0)}/{pool.get('batch_size', '?')}"
                              f" · {pool.get('pending_episodes', 0)}", str(pool.get("running_leases", 0)))
            rewards = ", ".join(f"{role} {mean:.2f}" for role, mean in self.recent_rewards().items())
            table.caption = f"reward (last 50 games): {rewards or '-'}" + (
                f"\nlast failure: {self.last_error[:160]}" if self.last_error else "")
            return table


def run(path: str, overrides: list[str] | None = None, *, console: Console | None = None) -> RunSummary:
    console = console or Console(soft_wrap=True)  # long lines (paths, URLs) stay whole in logs
    topology = Topology.load(path, overrides or [])
    for warning in topology.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    spec = topology.spec
    run_dir = Path(spec.run.run_dir or f"runs/{spec.name}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "topology.yaml").write_text(yaml.safe_dump(topology.to_dict(), sort_keys=False))
    token = os.environ.get("MARL_ADMIN_TOKEN") or secrets.token_urlsafe(24)

    started = time.monotonic()
    processes: dict[str, ServerProcess] = {}
    coordinator: Coordinator | None = None
    interrupted = False
    board = _Board(topology.trainable_servers())
    previous_sigterm = _sigterm_as_ctrl_c()
    try:
        endpoints = _start_servers(topology, run_dir, token, processes, console)
        env_class = topology.env_class()
        coordinator = Coordinator(
            env_factory=lambda: env_class(**spec.env.args),
            role_servers={role: topology.server_of(role) for role in spec.roles},
            endpoints=endpoints,
            settings=GameSettings(lease_timeout_s=spec.run.lease_timeout_s, max_tokens=spec.run.max_tokens,
                                  temperature=spec.run.temperature),
        )
        interrupted = _play(topology, coordinator, endpoints, board, run_dir, console, started, processes)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        _restore_sigterm(previous_sigterm)
        if coordinator is not None:
            aborted = coordinator.abort_all()
            if aborted:
                console.print(f"aborted {aborted} open leases")
            coordinator.close()
        with ThreadPoolExecutor(len(processes) or 1) as stopping:  # together: each may drain in-flight calls
            list(stopping.map(ServerProcess.stop, processes.values()))
        if processes:
            console.print(f"stopped {len(processes)} local servers")
    plot_run(run_dir)
    _print_summary(run_dir, console)
    summary = RunSummary(run_dir=run_dir, games=board.games, failed=board.failed,
                         seconds=time.monotonic() - started, policy_versions=board.versions(), interrupted=interrupted,
                         error=board.fatal)
    if summary.error:
        console.print(f"[red]gave up:[/] {summary.error}")
    console.print(f"{'interrupted' if interrupted else 'done'}: {summary.games} games ({summary.failed} failed) in"
                  f" {summary.seconds:.0f}s; policy versions {summary.policy_versions}; see {run_dir}")
    return summary


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


def _supervise(processes: dict[str, ServerProcess], board: _Board, console: Console) -> None:
    """Restart a local server that died (it resumes from its ledger and checkpoints; the coordinator then syncs its
    config and starts its engine again). After MAX_RESTARTS deaths of one server the run gives up."""
    for name, proc in processes.items():
        if proc.exit_code() is None or board.fatal:
            continue
        what = proc.describe_exit()
        if proc.restarts >= MAX_RESTARTS:
            board.fatal = f"local server {name} {what}, {proc.restarts + 1} times; see {proc.log_path}"
            continue
        proc.restarts += 1
        console.log(f"[red]local server {name} {what}[/]; restarting it ({proc.restarts}/{MAX_RESTARTS}),"
                    f" log: {proc.log_path}")
        log.warning("local server %s %s; restarting it (%d/%d)", name, what, proc.restarts, MAX_RESTARTS)
        proc.start()


def _start_servers(topology: Topology, run_dir: Path, token: str, processes: dict[str, ServerProcess],
                   console: Console) -> dict[str, Endpoint]:
    spec = topology.spec
    for name in topology.local_servers():
        server = spec.servers[name]
        processes[name] = ServerProcess(
            model=server.model, admin_token=token, data_dir=run_dir / "servers" / name,
            log_path=run_dir / "logs" / f"{name}.log", static=not server.trainable, device=server.device,
            port=server.port, prefix_cache_gb=server.prefix_cache_gb,
        ).start()
        console.print(f"started {server.kind.value} server {name} ({server.model}) on {processes[name].url}")
    for proc in processes.values():
        proc.wait_healthy()
    _write_servers_file(run_dir, processes, token)

    endpoints: dict[str, Endpoint] = {}
    for name, server in spec.servers.items():
        if server.kind == ServerKind.LOCAL_TRAINABLE:
            client = SwarmClient(processes[name].url, admin_token=token, max_wait_s=3600)
            endpoints[name] = Endpoint(name, client=client, max_concurrency=spec.run.per_server_concurrency,
                                       train_config=server.train.model_dump())
        elif server.kind == ServerKind.REMOTE_SWARM:
            client = SwarmClient(server.swarm_url, admin_token=os.environ.get(server.admin_token_env or ""),
                                 max_wait_s=3600)
            endpoints[name] = Endpoint(name, client=client, max_concurrency=spec.run.per_server_concurrency,
                                       train_config=server.train.model_dump())
        elif server.kind == ServerKind.LOCAL_STATIC:
            endpoints[name] = Endpoint(name, base_url=processes[name].url + "/v1", model=server.model)
        else:
            endpoints[name] = Endpoint(name, base_url=server.url, model=server.model,
                                       api_key=os.environ.get(server.api_key_env or "", "none"))

    def boot(name: str) -> None:
        endpoint = endpoints[name]
        if endpoint.trainable:
            endpoint.client.auto_sync_train_config_and_start_engine(endpoint.train_config)
        elif name in processes:  # a local static server loads its model at start-up
            with SwarmClient(processes[name].url, admin_token=token, max_wait_s=3600) as client:
                client.wait_until_state(EngineState.STATIC)

    console.print("loading models (SmolLM2 is converted once, then cached)...")
    with ThreadPoolExecutor(len(endpoints) or 1) as pool:
        list(pool.map(boot, list(endpoints)))
    return endpoints


def _write_servers_file(run_dir: Path, processes: dict[str, ServerProcess], token: str) -> None:
    """Where the local servers listen, for `marl overwatch TOPOLOGY.yaml`; owner-only, it holds the admin token."""
    path = run_dir / SERVERS_FILE
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({name: {"url": proc.url, "admin_token": token} for name, proc in processes.items()}, f, indent=2)


def _play(topology: Topology, coordinator: Coordinator, endpoints: dict[str, Endpoint], board: _Board,
          run_dir: Path, console: Console, started: float, processes: dict[str, ServerProcess]) -> bool:
    spec = topology.spec
    games_file = open(run_dir / "games.jsonl", "a")
    stop_polling = threading.Event()

    def poll() -> None:
        while not stop_polling.is_set():
            for name in board.status:
                try:
                    status = endpoints[name].client.status(timeout=5).model_dump(mode="json")
                except (SwarmError, OSError) as exc:
                    status = {"state": f"unreachable ({type(exc).__name__})"}
                with board.lock:
                    before = board.status[name].get("policy_version", 0)
                    board.status[name] = {**board.status[name], **status}
                    rewards = board.recent_rewards()
                if status.get("policy_version", 0) > before:  # one line per training step: progress in logs too
                    console.log(f"{name}: step {status['policy_version']} done; {board.games} games;"
                                f" recent reward {json.dumps({r: round(v, 3) for r, v in rewards.items()})}")
            _supervise(processes, board, console)
            stop_polling.wait(1.0)

    def should_stop() -> bool:
        if board.fatal:
            return True
        if spec.run.games is not None and board.games >= spec.run.games:
            return True
        if spec.run.max_steps is not None:
            versions = board.versions()
            return bool(versions) and all(v >= spec.run.max_steps for v in versions.values())
        return False

    def on_result(result: GameResult | None, error: Exception | None) -> None:
        with board.lock:
            if result is None:
                board.failed += 1
                board.last_error = str(error)
                return
            board.games += 1
            for role, reward in result.role_rewards.items():
                board.rewards[role].append(reward)
        games_file.write(json.dumps({"time": time.time(), **result.__dict__}) + "\n")
        games_file.flush()

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    interrupted = False
    try:
        with Live(get_renderable=lambda: board.table(spec.name, started), console=console, refresh_per_second=1):
            play_games(coordinator, tasks(spec.name, spec.run.repeats or 1, spec.run.seed),
                       concurrency=spec.run.concurrency, should_stop=should_stop, on_result=on_result)
        console.print()  # the live table's last line has no newline of its own
    except KeyboardInterrupt:
        interrupted = True
    finally:
        stop_polling.set()
        games_file.close()
    return interrupted
