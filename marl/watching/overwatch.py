"""`marl overwatch`: a live terminal monitor of one or many swarm servers, side by side.

    marl overwatch http://gpu-a:10086 http://gpu-b:10086      # any servers (admin token: $MARL_ADMIN_TOKEN)
    marl overwatch topologies/signalling-cpu.yaml             # every server of a topology (while `marl run` runs)
    marl overwatch topologies/signalling-cpu.yaml run.run_dir=runs/x   # with the overrides `marl run` was given
    marl overwatch URL --once                                 # print one snapshot and exit (logs, pipes, CI)

Every second it reads each server's `GET /control/monitor` (one call: state, policy version, detailed pool, recent
training steps, tokens/s, latest errors) in a thread pool, so a slow or dead server never stalls the others, and
draws one panel per server. An unreachable server shows as UNREACHABLE with its last known numbers and comes back
by itself; a restarted one (a new instance id) is flagged. Keys: 1-9 show one server, 0 or a shows all, tab / left /
right move between servers, q quits. Textual draws plain terminal cells: it works inside tmux and over SSH.
"""

from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from textual.app import App, ComposeResult
from textual.containers import Horizontal
from textual.widgets import Footer, Static

from marl.client import SwarmClient, SwarmError, SwarmRefused
from marl.protocol import ADMIN_TOKEN_ENV, EngineState, MonitorSnapshot, StepRecord, TrainingProgress
from marl.runner.launch import SERVERS_FILE
from marl.topology.graph import LEARNER_SEPARATOR
from marl.topology.spec import ServerSpec
from marl.watching.collapse import collapsed
from marl.watching.terminal import safe

_STATE_STYLE = {
    EngineState.OFFLINE: "bold white on grey35",
    EngineState.BOOTING: "bold black on yellow",
    EngineState.ROLLING: "bold black on green",
    EngineState.ROLLING_POST: "bold black on cyan",
    EngineState.WEIGHT_SYNCING: "bold white on blue",
    EngineState.STATIC: "bold black on white",
}
_BARS = "▁▂▃▄▅▆▇█"


class OverwatchError(ValueError):
    """Bad arguments: the message says what to pass instead."""


@dataclass
class Source:
    name: str
    url: str
    admin_token: str | None = None
    policy: str | None = None  # one LoRA policy of a server of several: its own row (pool, steps, rewards)


@dataclass
class ServerView:
    """What the monitor knows about one server: the latest snapshot and how it got (or failed to get) it."""

    source: Source
    snapshot: MonitorSnapshot | None = None
    last_ok: float | None = None  # unix time of the latest good read
    unreachable_since: float | None = None
    problem: str | None = None  # why the latest read failed
    refused: bool = False  # the server answered, and refused (a missing or wrong admin token): it is reachable
    restarts: int = 0
    restarted_at: float | None = None
    _client: SwarmClient | None = field(default=None, repr=False)

    def poll(self, timeout: float = 2.0) -> None:
        if self._client is None:
            self._client = SwarmClient(self.source.url, admin_token=self.source.admin_token, timeout=timeout,
                                       policy=self.source.policy)
        try:
            snapshot = self._client.monitor(timeout=timeout)
        except SwarmRefused as exc:  # it answered: reachable, but says no
            self.problem, self.refused = safe(self._refusal(exc)[:400]), True  # may quote what the server sent
            return
        except (SwarmError, httpx.HTTPError) as exc:
            self.problem, self.refused = safe(str(exc).splitlines()[0][:400]), False
            if self.unreachable_since is None:
                self.unreachable_since = time.time()
            return
        if self.snapshot is not None and snapshot.instance_id != self.snapshot.instance_id:
            self.restarts += 1
            self.restarted_at = time.time()
        self.snapshot, self.last_ok, self.unreachable_since, self.problem = snapshot, time.time(), None, None
        self.refused = False

    def _refusal(self, exc: SwarmRefused) -> str:
        """What the server's refusal means here, and what to do: the admin token first."""
        if exc.status_code not in (401, 403):
            return str(exc).splitlines()[0]
        given = "no admin token was given" if self.source.admin_token is None else "the admin token was refused"
        return (f"{given} (HTTP {exc.status_code}): pass --admin-token or set ${ADMIN_TOKEN_ENV} to the server's"
                " token (`marl run` writes its own to the run directory's servers.json)")

    def _trouble(self, now: float) -> str:
        """The headline of a failed read: refused, or unreachable since when."""
        if self.refused:
            return "REFUSED"
        return f"UNREACHABLE for {_duration(now - (self.unreachable_since or now))}"

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    # --- drawing -------------------------------------------------------------------------------------------------

    def render(self, now: float | None = None) -> RenderableType:
        now = time.time() if now is None else now
        snap = self.snapshot
        title = Text(self.source.name, style="bold")
        if self.problem is not None and snap is None:
            body = Text(f"{self._trouble(now)}\n{self.problem}", style="bold red")
            return Panel(body, title=title, subtitle=self.source.url, border_style="red")
        if snap is None:
            return Panel(Text("connecting..."), title=title, subtitle=self.source.url)

        status, pool = snap.status, snap.pool
        head = Text()
        head.append(f" {status.state.value} ", style=_STATE_STYLE.get(status.state, "bold"))
        head.append(f"  policy v{status.policy_version}  {safe(status.model)}  up {_duration(now - snap.started_at)}")
        lines: list[RenderableType] = [head]
        if snap.training is not None:
            lines.append(_training_line(snap.training))
        if self.problem is not None:
            lines.append(Text(f"{self._trouble(now)} (last seen {_duration(now - self.last_ok)} ago): {self.problem}",
                              style="bold red"))
        if self.restarted_at is not None and now - self.restarted_at < 60:
            lines.append(Text(f"restarted {_duration(now - self.restarted_at)} ago (restarts seen: {self.restarts})",
                              style="bold yellow"))

        if pool is not None:
            target_episodes = pool.batch_size * pool.num_repeat
            lines.append(Text.assemble(
                "pool    ", _bar(pool.complete_groups, pool.batch_size),
                f" {pool.complete_groups}/{pool.batch_size} groups · "
                f"{pool.pending_episodes}/{target_episodes} episodes"))
            lines.append(Text(f"leases  {pool.running_leases} running · {pool.free_slots} free · "
                              f"requeued {pool.requeued} · expired {pool.expired} · discarded {pool.discarded}"))
            for lease in sorted(pool.leases, key=lambda x: -x.idle_s)[:6]:
                near = lease.idle_s > 0.8 * lease.patience_s
                lines.append(Text.assemble(
                    f"  {lease.episode_id[:8]} idle ", _bar(lease.idle_s, lease.patience_s, width=8,
                                                          style="red" if near else "green"),
                    f" {lease.idle_s:.0f}s/{lease.patience_s:.0f}s · {lease.calls} calls"
                    f" · {safe(lease.client_id[:16])}"))
            if len(pool.leases) > 6:
                lines.append(Text(f"  ... {len(pool.leases) - 6} more", style="dim"))

        lines.append(Text(f"tokens/s {snap.tokens_per_s:.1f} · calls {status.metrics.get('calls', 0):.0f} · "
                          f"train steps {len(snap.recent_steps) and snap.recent_steps[-1].step}"))
        idle = _idle_work(status.metrics)
        if idle:
            lines.append(Text(idle, style="bold yellow"))
        lines.append(_reward_table(snap))
        if snap.errors:
            latest = snap.errors[-1]
            stamp = time.strftime("%H:%M:%S", time.localtime(latest.time))
            lines.append(Text(f"last error [{stamp}] {safe(latest.message[:300])}", style="red"))
        border = "red" if self.problem else "yellow" if status.state != EngineState.ROLLING else "green"
        return Panel(Group(*lines), title=title, subtitle=self.source.url, border_style=border)


def _reward_table(snap: MonitorSnapshot) -> RenderableType:
    steps = snap.recent_steps
    if not steps:
        return Text("reward  (no training step yet)", style="dim")
    roles = sorted({key.split("/", 1)[1] for s in steps for key in s.metrics if key.startswith("reward_mean/")})
    keys = [(role, f"reward_mean/{role}", f"reward_std/{role}") for role in roles] or [
        ("all", "reward_mean", "reward_std")]
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    table.add_column("role")
    table.add_column("reward (last step)", justify="right")
    table.add_column(f"last {min(len(steps), 30)} steps")
    table.add_column("reply nll · same replies", justify="right")  # a policy that stops exploring: both fall/rise
    for role, mean_key, std_key in keys:
        history = [s.metrics[mean_key] for s in steps[-30:] if mean_key in s.metrics]
        last = next((s.metrics for s in reversed(steps) if mean_key in s.metrics), {})
        table.add_row(Text(safe(role)), f"{last.get(mean_key, math.nan):.3f} ± {last.get(std_key, math.nan):.3f}",
                      sparkline(history), _diversity(last, "" if role == "all" else f"/{role}"))
    return Group(table, Text(step_caption(steps[-1]), style="dim"))


def _diversity(metrics: dict[str, float], suffix: str) -> Text:
    """The role's reply nll and share of groups with one reply (servers.trainers.step_metrics.reply_diversity), in
    red once its replies stopped varying."""
    nll, same = metrics.get(f"reply_nll{suffix}"), metrics.get(f"groups_same_reply{suffix}")
    if nll is None or same is None:
        return Text("")
    return Text(f"{nll:.3f} · {same:.0%}", style="red" if collapsed(nll, same) else "")


def _idle_work(metrics: dict[str, float]) -> str:
    """What this server did that trained nothing (never shown as progress): steps without a trained token, and
    episodes of groups in which its agent never called the model."""
    empty, silent = metrics.get("train_steps_empty", 0), metrics.get("episodes_silent", 0)
    parts = [f"{empty:.0f} of {metrics.get('train_steps', 0):.0f} steps trained nothing (no group with a learning"
             " signal)"] if empty else []
    if silent:
        parts.append(f"{silent:.0f} episodes dropped: the agent never called the model in them")
    return " · ".join(parts)


def step_caption(step: StepRecord) -> str:
    """The latest step's loss, rollout idle fraction, staleness and importance weights (those it reported)."""
    m = step.metrics
    parts = [f"step {step.step}"]
    if "loss" in m:
        parts.append(f"loss {m['loss']:.4f}")
    if "rollout_idle_frac" in m:
        parts.append(f"rollouts idle {m['rollout_idle_frac']:.0%}")
    if m.get("staleness_max"):
        parts.append(f"stale {m.get('staleness_mean', 0):.2f} (max {m['staleness_max']:.0f}) versions")
    if m.get("offpolicy_frac"):
        parts.append(f"off-policy {m['offpolicy_frac']:.0%} · IS weight {m.get('importance_weight_mean', 0):.2f}"
                     f" (capped {m.get('importance_capfrac', 0):.0%})")
    return " · ".join(parts)


def sparkline(values: list[float]) -> str:
    """One block character per value, scaled between the values' min and max."""
    if not values:
        return ""
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        return _BARS[len(_BARS) // 2] * len(values)
    return "".join(_BARS[round((v - lo) / (hi - lo) * (len(_BARS) - 1))] for v in values)


def _bar(value: float, total: float, width: int = 12, style: str = "green") -> Text:
    filled = 0 if total <= 0 else max(0, min(width, round(width * value / total)))
    return Text.assemble(("█" * filled, style), ("░" * (width - filled), "dim"))


def _training_line(training: TrainingProgress) -> Text:
    what = f"step {training.step} on {training.samples} samples · {_duration(training.seconds)}"
    if training.done is None or not training.total:
        return Text(f"training {what}")
    return Text.assemble("training ", _bar(training.done, training.total),
                         f" {training.done}/{training.total} micro-batches · {what}")


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


# --- where the servers are ------------------------------------------------------------------------------------------


def resolve_sources(targets: list[str], admin_token: str | None = None) -> list[Source]:
    """URLs as given, or one topology YAML and the key=value overrides `marl run` was given: its local servers (from
    the run dir of `marl run`, `run.run_dir` included) and remote ones."""
    token = admin_token or os.environ.get(ADMIN_TOKEN_ENV)
    if not targets:
        raise OverwatchError("give server URLs (http://host:port) or one topology file (topologies/NAME.yaml)")
    if targets[0].endswith((".yaml", ".yml")):
        overrides = targets[1:]
        if not all("=" in override and not override.startswith(("http://", "https://")) for override in overrides):
            raise OverwatchError(f"after the topology {targets[0]}, give key=value overrides only (as `marl run`"
                                 f" takes them, e.g. run.run_dir=runs/x); got {' '.join(overrides)}")
        return _topology_sources(Path(targets[0]), overrides, token)
    sources = []
    for url in targets:
        if not url.startswith(("http://", "https://")):
            raise OverwatchError(f"{url!r} is neither a URL (http://host:port) nor a single topology .yaml file")
        sources.append(Source(name=url.split("://", 1)[1].rstrip("/"), url=url.rstrip("/"), admin_token=token))
    return sources


def _topology_sources(path: Path, overrides: list[str], token: str | None) -> list[Source]:
    from marl.topology import ServerKind, Topology

    topology = Topology.load(str(path), overrides, check_env=False)
    spec = topology.spec
    run_dir = Path(spec.run.run_dir or f"runs/{spec.name}")
    local = {}
    if (run_dir / SERVERS_FILE).exists():
        local = json.loads((run_dir / SERVERS_FILE).read_text())
    sources = []
    for name, server in spec.servers.items():
        if server.kind in (ServerKind.LOCAL_TRAINABLE, ServerKind.LOCAL_STATIC):
            if name not in local:
                run = " ".join(["marl run", str(path), *overrides])
                raise OverwatchError(f"no address for local server '{name}': {run_dir / SERVERS_FILE} is written by "
                                     f"`{run}` while it runs; start the run first (give overwatch the same"
                                     " overrides), or pass URLs")
            sources += _policy_sources(name, server, local[name]["url"], local[name].get("admin_token") or token)
        elif server.kind == ServerKind.REMOTE_SWARM:
            remote_token = os.environ.get(server.admin_token_env or "") or token
            sources += _policy_sources(name, server, server.swarm_url.rstrip("/"), remote_token)
        # external OpenAI endpoints are not swarm servers: nothing to monitor
    if not sources:
        raise OverwatchError(f"{path} has no swarm server to watch (only external OpenAI endpoints)")
    return sources


def _policy_sources(name: str, server: ServerSpec, url: str, token: str | None) -> list[Source]:
    """A server's row, or one row per LoRA policy (named as `marl run` names the learner: server.policy)."""
    if not server.policies:
        return [Source(name, url, token)]
    return [Source(f"{name}{LEARNER_SEPARATOR}{policy}", url, token, policy=policy) for policy in server.policies]


def poll_all(views: list[ServerView], pool: ThreadPoolExecutor) -> None:
    list(pool.map(lambda view: view.poll(), views))


def print_once(sources: list[Source], console: Console | None = None) -> list[str]:
    """One snapshot of every server, printed (for logs and pipes); returns the names of those that could not be read
    (unreachable, or refused), whose panels say why."""
    console = console or Console()
    views = [ServerView(source) for source in sources]
    with ThreadPoolExecutor(max(1, len(views))) as pool:
        poll_all(views, pool)
    for view in views:
        console.print(view.render())
        view.close()
    return [view.source.name for view in views if view.problem is not None]


# --- the terminal UI ----------------------------------------------------------------------------------------------


class ServerPanel(Static):
    DEFAULT_CSS = "ServerPanel { width: 1fr; height: auto; }"

    def __init__(self, view: ServerView, **kwargs):
        super().__init__(**kwargs)
        self.view = view

    def refresh_view(self) -> None:
        self.update(self.view.render())


class OverwatchApp(App):
    TITLE = "marl overwatch"
    BINDINGS = [
        ("q", "quit", "quit"),
        ("a", "show_all", "all"),
        ("0", "show_all", "all"),
        ("tab", "next_server", "next"),
        ("right", "next_server", "next"),
        ("left", "previous_server", "previous"),
        *[(str(i), f"show({i - 1})", "") for i in range(1, 10)],
    ]
    CSS = "Horizontal { height: auto; }"

    def __init__(self, sources: list[Source], interval_s: float = 1.0):
        super().__init__()
        self.views = [ServerView(source) for source in sources]
        self.interval_s = interval_s
        self.focused_index: int | None = None  # None: all side by side
        self._pool = ThreadPoolExecutor(max(1, len(self.views)), thread_name_prefix="overwatch")
        self.polls = 0  # completed refresh rounds (tests wait on it)

    def compose(self) -> ComposeResult:
        with Horizontal():
            for i, view in enumerate(self.views):
                yield ServerPanel(view, id=f"server-{i}")
        yield Footer()

    def on_mount(self) -> None:
        self._refresh_all()
        self.set_interval(self.interval_s, self._refresh_all)

    def _refresh_all(self) -> None:
        self.run_worker(self._poll, thread=True, exclusive=True, group="poll")

    def _poll(self) -> None:
        poll_all(self.views, self._pool)
        self.call_from_thread(self._after_poll)

    def _after_poll(self) -> None:
        self.polls += 1
        self._redraw()

    def _redraw(self) -> None:
        for i, panel in enumerate(self.query(ServerPanel)):
            panel.display = self.focused_index is None or self.focused_index == i
            panel.refresh_view()

    def action_show(self, index: int) -> None:
        if index < len(self.views):
            self.focused_index = index
            self._redraw()

    def action_show_all(self) -> None:
        self.focused_index = None
        self._redraw()

    def action_next_server(self) -> None:
        self.focused_index = 0 if self.focused_index is None else (self.focused_index + 1) % len(self.views)
        self._redraw()

    def action_previous_server(self) -> None:
        self.focused_index = len(self.views) - 1 if self.focused_index is None else (
            (self.focused_index - 1) % len(self.views))
        self._redraw()

    def on_unmount(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for view in self.views:
            view.close()
