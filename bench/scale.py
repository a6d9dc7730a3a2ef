"""marl's own control-plane cost at cluster load, by simulation: one real `marl serve --engine simulated` under many
concurrent leases (latency, CPU, memory, ledger), its memory after many recorded episodes, and the coordinator's rate.

    python bench/scale.py                          # the default (~6 min on 2 shared cores): 16, 128, 512, 1024
                                                   # leases; 10,000 episodes; 8 signalling + 4 Werewolves games
    python bench/scale.py --out results/scale      # also results/scale/scale.json and scale.png
    python bench/scale.py --leases 1024 --duration 60 --turns 3 --max-tokens 32 --skip-memory --skip-coordinator
    python bench/scale.py --episodes 100000 --skip-load --skip-coordinator   # the memory acceptance figure
    python bench/scale.py --smoke                  # a minute: a tiny sweep, 100 episodes, 4 games

Load sweep. The server is one real trainable `marl serve --engine simulated` subprocess (`--speed 1.0`: the latency
model of vLLM serving a 7B on one H100, `servers.engines.simulated`; its trainer a 7B GRPO step on 8 H100s), the
tokenizer the tiny test model's. It trains as it rolls: batch_size 8 x num_repeat 8, `overlap: true` (leases go on
while a step trains; `max_staleness` as large as the most leases need, so that no begin is refused for being ahead).
For each point, that many leases run at once in a closed loop: begin, `--turns` chat calls of a growing conversation
(`--max-tokens` each), end with a random reward, begin again. A call's latency as the client saw it minus the engine's
wall time for it (the `Server-Timing: engine;dur=<ms>, marl;dur=<ms>` header every non-streaming chat completion
carries) is marl's added latency: HTTP, the lease's key, the prompt rendered and spliced, the reply shaped, the call
recorded, and any wait of the request or the reply in the client's own loop or the kernel. The header's `marl` is the
server's own part of it, timed inside the server from its first sight of the request (`own p50`, `own p99`): what it
leaves out is the client's and the network's, and the wait before the server's loop reads the request. The engine's
wall time includes waiting for a slot (256 run at once) and for a weight swap, as in vLLM; it also includes any delay
of the server's event loop in waking the engine's sleeps, so when the server's loop is saturated (CPU near one core)
part of marl's cost shows as engine time: read the server's CPU column with the latency. Calls and episodes are
counted when they finish within the measured window (after `--warmup`); server CPU-seconds (utime + stime of
/proc/<pid>/stat) over the window per 1,000 chat calls (all its work: begins, ends, training included); VmRSS at the
end of the point; the ledger's pages (as a reader sees them, its WAL included) per 1,000 episodes recorded so far.

The load generator is `--workers` processes, each with its own asyncio loop and one aiohttp session with a
connection per lease: aiohttp sends a request's headers and body in one write and costs a fraction of httpx's CPU
(an httpx client wrote the headers, then the body after its loop's next turn; on a saturated client that gap, which
the server counts from the headers on, reached hundreds of ms at 1,024 leases and showed as marl's own time). That
it is not the limit is checked, not assumed: each worker measures its own event loop's lag
(a 10 ms ticker's overshoot: a saturated client loop would delay reading replies, and that delay would count as
marl's), and its CPU share; the table prints the worst worker's loop lag p99 and CPU. On this 2-core machine the
workers and the server share the cores, so a point where the client lag p99 is not small beside marl's p99 says so.

Memory. A fresh server at `--memory-speed` (fast) plays episodes of one call (`--memory-max-tokens`) with 64 leases;
its VmRSS is read after 1,000 recorded episodes and after each further checkpoint up to `--episodes`. Note that the
lease table remembers the last 10,000 closed episodes and dead keys (`servers.episodes.leases._REMEMBERED`, ~0.3 KB
each): RSS grows until 10,000 episodes by design; growth beyond that is per-episode state kept for good.

Coordinator. `marl run` (the real coordinator, a subprocess) on a topology whose servers are remote swarm servers
(`swarm_url:`): simulated `marl serve` processes at `--coordinator-speed` (1: real time), trained as they play (batch
1 x 4 games). It plays `--signalling-games` signalling games (speaker, listener) and `--werewolves-games` Werewolves
games (9 players: 3 werewolves and the seer on the two servers, the rest scripted); games/hour is wall time, start-up
of `marl run` included, the training steps (the simulated trainer's) holding games up as in a real run; the
coordinator's CPU-seconds (its rusage, from wait4) after the first call (its start-up left out) per 1,000 chat calls
the servers served (`marl_calls_total`). The simulated engine's replies are random tokens, so most LLM moves are
invalid and fall back as the envs decide: the call counts are the envs' real ones for such players, not a trained
model's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

import aiohttp
import httpx

from marl.protocol import SERVER_TIMING_HEADER, TIMING_ENGINE, TIMING_MARL, parse_server_timing  # noqa: E402

ADMIN = "-scale-bench-admin"
BATCH_SIZE, NUM_REPEAT = 8, 8  # 64 episodes per step
MEMORY_LEASES = 64


# --- the server ------------------------------------------------------------------------------------------------------


def start_server(model_dir: Path, data_dir: Path, speed: float, max_leases: int | None = None):
    """A trainable simulated server, ROLLING with the bench's training config (`max_leases` None: OFFLINE, for a
    coordinator to configure and start)."""
    from marl.protocol import TrainConfig
    from marl.runner.launch import ServerProcess

    proc = ServerProcess(model=str(model_dir), admin_token=ADMIN, data_dir=data_dir, device="cpu",
                         served_name="sim", engine="simulated", simulated_speed=speed,
                         log_path=data_dir.parent / f"{data_dir.name}.log").start()  # fmt: skip
    proc.wait_healthy(timeout=120)
    if max_leases is None:
        return proc
    # A begin is never refused for running ahead (`rollouts_ahead`): the simulated trainer, a step and a weight swap
    # per 64 episodes, falls behind the rollouts at hundreds of leases and the pool grows by tens of episodes a
    # second; refused begins, retried every 0.5 s, would be most of the server's requests.
    staleness = max_leases // (BATCH_SIZE * NUM_REPEAT) + 100
    config = TrainConfig(batch_size=BATCH_SIZE, num_repeat=NUM_REPEAT, overlap=True, max_staleness=staleness,
                         max_leases=max_leases, lease_patience_s=120, save_freq=0)
    with httpx.Client(base_url=proc.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60) as http:
        assert http.post("/control/config", json=config.model_dump(mode="json")).status_code == 200
        assert http.post("/control/start").status_code == 200
        deadline = time.monotonic() + 120
        while http.get("/control/status").json()["state"] != "ROLLING":
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server never rolled; see {proc.log_path}")
            time.sleep(0.1)
    return proc


def process_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds user + system, resident bytes) of a process, from /proc."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14 and 15)
    rss = next((int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("VmRSS:")), 0)  # none: the process has exited, not yet reaped (a zombie)
    return cpu, rss


def ledger_usage(data_dir: Path) -> tuple[int, int]:
    """(bytes the ledger's pages hold, episodes recorded in it), as a reader sees it (its WAL included): the files'
    sizes would count the WAL's high-water mark (sqlite keeps it ~4 MB) and the free pages."""
    db = sqlite3.connect(f"file:{data_dir / 'ledger.sqlite'}?mode=ro", uri=True, timeout=30)
    try:
        pages = db.execute("PRAGMA page_count").fetchone()[0] - db.execute("PRAGMA freelist_count").fetchone()[0]
        episodes = db.execute("SELECT count(*) FROM episodes").fetchone()[0]
        return pages * db.execute("PRAGMA page_size").fetchone()[0], episodes
    finally:
        db.close()


# --- the load generator (worker processes) ----------------------------------------------------------------------------


@dataclass
class Load:
    """What every worker is told: the server, the leases it runs, and when to stop."""

    url: str
    leases: int
    turns: int
    max_tokens: int
    stop_at: float  # time.monotonic() (system-wide): begin no episode after it
    episodes: int | None = None  # or stop after this many episodes (the memory phase)
    worker: int = 0


@dataclass
class WorkerResult:
    calls: list[tuple[float, float, float, float]] = field(default_factory=list)  # (finished at, seen s, engine s,
    # the server's own s)
    episodes: list[float] = field(default_factory=list)  # ended at
    refused: int = 0  # 503s at begin, waited out
    dropped: int = 0  # connections the server closed mid-request (counted; the episode is given up, a new one begun)
    errors: list[str] = field(default_factory=list)
    loop_lag: list[float] = field(default_factory=list)  # seconds a 10 ms ticker woke late
    cpu_s: float = 0.0
    wall_s: float = 0.0


def worker_main(load: Load, queue) -> None:
    started, cpu = time.monotonic(), time.process_time()
    result = WorkerResult()
    try:
        asyncio.run(_drive(load, result))
    except Exception as exc:  # reported by the parent, which exits non-zero
        result.errors.append(f"{type(exc).__name__}: {exc}")
    result.cpu_s, result.wall_s = time.process_time() - cpu, time.monotonic() - started
    queue.put(result)


async def _drive(load: Load, result: WorkerResult) -> None:
    # keep-alive shorter than the server's (uvicorn: 5 s): never reuse a connection the server is closing
    connector = aiohttp.TCPConnector(limit=load.leases + 8, keepalive_timeout=2.0)
    budget = [load.episodes if load.episodes is not None else -1, 0]  # [episodes left (-1: no limit), begun]
    async with aiohttp.ClientSession(load.url, connector=connector, timeout=aiohttp.ClientTimeout(total=600),
                                     headers={"Authorization": f"Bearer {ADMIN}"}) as client:  # fmt: skip
        ticker = asyncio.create_task(_tick(result))
        try:
            await asyncio.gather(*(_lease_loop(client, load, result, budget) for _ in range(load.leases)))
        finally:
            ticker.cancel()


async def _tick(result: WorkerResult) -> None:
    while True:
        before = time.monotonic()
        await asyncio.sleep(0.01)
        result.loop_lag.append(max(0.0, time.monotonic() - before - 0.01))


async def _lease_loop(client: aiohttp.ClientSession, load: Load, result: WorkerResult, budget: list[int]) -> None:
    rng = random.Random()
    while time.monotonic() < load.stop_at and budget[0] != 0:
        budget[0] -= 1 if budget[0] > 0 else 0
        task = f"w{load.worker}-t{budget[1] // NUM_REPEAT}"  # num_repeat episodes of each task: GRPO groups fill
        budget[1] += 1
        try:
            await _episode(client, load, result, task, rng)
        except aiohttp.ClientConnectionError:  # its lease expires on the server (lease_patience_s)
            result.dropped += 1
        except Exception as exc:
            result.errors.append(f"{type(exc).__name__}: {exc}")
            return


async def _post(client: aiohttp.ClientSession, path: str, body: dict, headers: dict | None = None,
                ) -> tuple[int, Mapping[str, str], dict]:  # fmt: skip
    """POST `body`; the status, the headers and the JSON reply (aiohttp: headers and body go out in one write)."""
    async with client.post(path, json=body, headers=headers) as r:
        reply = await r.json(content_type=None)
        if r.status >= 400 and r.status != 503:
            raise RuntimeError(f"{path} answered {r.status}: {str(reply)[:300]}")
        return r.status, r.headers, reply


async def _episode(client: aiohttp.ClientSession, load: Load, result: WorkerResult, task: str,
                   rng: random.Random) -> None:  # fmt: skip
    while (begun := await _post(client, "/episodes/begin", {"client_id": "scale"}))[0] == 503:
        result.refused += 1
        await asyncio.sleep(float(begun[1].get("retry-after", "0.5")))
    lease = begun[2]
    key = {"Authorization": f"Bearer {lease['api_key']}"}
    path = f"{urlsplit(lease['base_url']).path}/chat/completions"
    messages = [{"role": "system", "content": "You play a game of Werewolves; answer in a few words."}]
    for turn in range(load.turns):
        messages.append({"role": "user", "content": f"Round {turn}: player_{rng.randrange(9)} accuses "
                                                    f"player_{rng.randrange(9)}. Whom do you vote for?"})
        sent = time.monotonic()
        _, headers, reply = await _post(client, path, {"model": lease["model"], "max_tokens": load.max_tokens,
                                                       "messages": messages}, key)  # fmt: skip
        done = time.monotonic()
        timing = parse_server_timing(headers[SERVER_TIMING_HEADER])
        result.calls.append((done, done - sent, timing[TIMING_ENGINE] / 1000, timing[TIMING_MARL] / 1000))
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""})
    await _post(client, f"/episodes/{lease['episode_id']}/end",
                {"client_id": "scale", "task_id": task, "reward": rng.random()})
    result.episodes.append(time.monotonic())


def run_workers(loads: list[Load]) -> list[WorkerResult]:
    """Run one worker process per load; their results once all have finished."""
    context = mp.get_context("spawn")  # no fork of a parent that may hold threads
    queue = context.Queue()
    procs = [context.Process(target=worker_main, args=(load, queue), daemon=True) for load in loads]
    for proc in procs:
        proc.start()
    results = [queue.get() for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    problems = [e for r in results for e in r.errors]
    if problems:
        raise RuntimeError(f"{len(problems)} load errors, e.g. {problems[0]}")
    return results


def split(total: int, parts: int) -> list[int]:
    parts = max(1, min(parts, total))
    return [total // parts + (i < total % parts) for i in range(parts)]


# --- the load sweep -----------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def load_point(proc, data_dir: Path, leases: int, args) -> dict:
    """One point of the sweep: `leases` concurrent leases for warmup + duration seconds; its figures."""
    pid = proc.proc.pid
    begin_at = time.monotonic() + 4.0  # workers start (spawned, imports) within this
    window = (begin_at + args.warmup, begin_at + args.warmup + args.duration)
    loads = [Load(url=proc.url, leases=n, turns=args.turns, max_tokens=args.max_tokens, stop_at=window[1], worker=i)
             for i, n in enumerate(split(leases, args.workers))]  # fmt: skip
    usage: dict[str, tuple] = {}

    async def sample() -> None:  # the server's usage at the window's edges, while the workers run
        for name, at in (("start", window[0]), ("end", window[1])):
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            usage[name] = process_usage(pid)

    async def both() -> list[WorkerResult]:
        sampler = asyncio.create_task(sample())
        results = await asyncio.to_thread(run_workers, loads)
        await sampler
        return results

    results = asyncio.run(both())
    ledger_bytes, recorded = ledger_usage(data_dir)
    return summarize(leases, results, window, usage, ledger_bytes, recorded)


def summarize(leases: int, results: list[WorkerResult], window: tuple[float, float], usage: dict,
              ledger_bytes: int, recorded: int) -> dict:  # fmt: skip
    inside = [c for r in results for c in r.calls if window[0] <= c[0] <= window[1]]
    episodes = sum(window[0] <= t <= window[1] for r in results for t in r.episodes)
    seconds = window[1] - window[0]
    marl_ms = [(seen - engine) * 1000 for _, seen, engine, _ in inside]
    server_ms = [own * 1000 for *_, own in inside]
    cpu = usage["end"][0] - usage["start"][0]
    return {
        "leases": leases,
        "episodes_per_s": episodes / seconds,
        "calls_per_s": len(inside) / seconds,
        "calls": len(inside),
        "seen_p50_ms": percentile([c[1] * 1000 for c in inside], 50),
        "engine_p50_ms": percentile([c[2] * 1000 for c in inside], 50),
        "marl_p50_ms": percentile(marl_ms, 50),
        "marl_p99_ms": percentile(marl_ms, 99),
        "marl_mean_ms": statistics.fmean(marl_ms) if marl_ms else float("nan"),
        "server_marl_p50_ms": percentile(server_ms, 50),
        "server_marl_p99_ms": percentile(server_ms, 99),
        "server_cpu_util": cpu / seconds,
        "server_cpu_s_per_1k_calls": cpu / max(len(inside), 1) * 1000,
        "server_rss_mb": usage["end"][1] / 2**20,
        "ledger_kb_per_1k_episodes": ledger_bytes / max(recorded, 1) * 1000 / 1024,
        "begins_refused": sum(r.refused for r in results),
        "connections_dropped": sum(r.dropped for r in results),
        "client_lag_p99_ms": max(percentile(r.loop_lag, 99) for r in results) * 1000,
        "client_cpu_util": max(r.cpu_s / r.wall_s for r in results),
    }


LOAD_COLUMNS = (  # (key, title, format) of the printed table
    ("leases", "leases", "{:d}"), ("episodes_per_s", "ep/s", "{:.1f}"), ("calls_per_s", "calls/s", "{:.1f}"),
    ("engine_p50_ms", "engine p50", "{:.0f}"), ("marl_p50_ms", "marl p50", "{:.2f}"),
    ("marl_p99_ms", "marl p99", "{:.2f}"), ("server_marl_p50_ms", "own p50", "{:.2f}"),
    ("server_marl_p99_ms", "own p99", "{:.2f}"), ("server_cpu_util", "srv cpu", "{:.2f}"),
    ("server_cpu_s_per_1k_calls", "cpu-s/1k", "{:.2f}"), ("server_rss_mb", "RSS MB", "{:.0f}"),
    ("ledger_kb_per_1k_episodes", "ledger KB/1k ep", "{:.0f}"),
    ("client_lag_p99_ms", "client lag p99", "{:.0f}"), ("client_cpu_util", "client cpu", "{:.2f}"),
    ("connections_dropped", "dropped", "{:d}"),
)


def print_rows(rows: list[dict], columns, header: bool = True) -> None:
    widths = [max(len(title), 8) + 1 for _, title, _ in columns]
    if header:
        print("".join(f"{title:>{w}}" for (_, title, _), w in zip(columns, widths)))
    for row in rows:
        print("".join(f"{fmt.format(row[key]):>{w}}" for (key, _, fmt), w in zip(columns, widths)))


def load_sweep(model_dir: Path, scratch: Path, args) -> list[dict]:
    data_dir = scratch / "load-server"
    proc = start_server(model_dir, data_dir, args.speed, max_leases=max(args.leases) + 256)
    rows = []
    try:
        for leases in args.leases:
            rows.append(load_point(proc, data_dir, leases, args))
            print_rows(rows[-1:], LOAD_COLUMNS, header=len(rows) == 1)
            sys.stdout.flush()
    finally:
        proc.stop()
    return rows


# --- memory growth ------------------------------------------------------------------------------------------------


def memory_growth(model_dir: Path, scratch: Path, args) -> list[dict]:
    """The server's RSS after each checkpoint of recorded episodes (1,000 first, up to `--episodes`)."""
    data_dir = scratch / "memory-server"
    proc = start_server(model_dir, data_dir, args.memory_speed, max_leases=MEMORY_LEASES + 64)
    marks = sorted({m for m in (1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000, args.episodes)
                    if m <= args.episodes and m >= min(1000, args.episodes)})  # fmt: skip
    rows: list[dict] = []
    try:
        for mark in marks:
            done = rows[-1]["target"] if rows else 0
            loads = [Load(url=proc.url, leases=n, turns=1, max_tokens=args.memory_max_tokens, stop_at=float("inf"),
                          episodes=e, worker=i)
                     for i, (n, e) in enumerate(zip(split(MEMORY_LEASES, args.workers),
                                                    split(mark - done, args.workers)))]  # fmt: skip
            started, cpu_before = time.monotonic(), process_usage(proc.proc.pid)[0]
            run_workers(loads)
            seconds = time.monotonic() - started
            cpu, rss = process_usage(proc.proc.pid)
            ledger_bytes, recorded = ledger_usage(data_dir)
            rows.append({"target": mark, "episodes": recorded, "rss_mb": rss / 2**20, "ledger_mb": ledger_bytes / 2**20,
                         "episodes_per_s": (mark - done) / seconds, "server_cpu_util": (cpu - cpu_before) / seconds,
                         "server_cpu_ms_per_episode": (cpu - cpu_before) / (mark - done) * 1000})
            print(f"{recorded:>10d} episodes recorded  RSS {rows[-1]['rss_mb']:7.1f} MB  ledger"
                  f" {rows[-1]['ledger_mb']:6.1f} MB  {rows[-1]['episodes_per_s']:6.0f} episodes/s  server CPU"
                  f" {rows[-1]['server_cpu_util']:.2f}, {rows[-1]['server_cpu_ms_per_episode']:.1f} ms/episode")
            sys.stdout.flush()
    finally:
        proc.stop()
    return rows


# --- the coordinator ----------------------------------------------------------------------------------------------

TOKEN_ENV = "MARL_SCALE_BENCH_ADMIN"
TRAIN = "{job: %s, batch_size: 1, num_repeat: 4}"
GAMES = {  # game: (its servers, its roles and env in topology YAML)
    "signalling": (("speaker_model", "listener_model"), """roles:
  speaker: {server: speaker_model, team: speaker}
  listener: {server: listener_model, team: listener}
env:
  class: envs.signalling:SignallingGame
  args: {num_items: 3, max_invalid_retries: 0}
"""),
    "werewolves": (("wolves_model", "seer_model"), """roles:
  werewolf: {server: wolves_model, count: 3, team: werewolves}
  seer: {server: seer_model, team: village}
  villager: {scripted: true, count: 3, team: village}
  witch: {scripted: true, team: village}
  hunter: {scripted: true, team: village}
env:
  class: envs.werewolves:Werewolves
  args: {max_rounds: 3}
"""),
}


def topology_yaml(game: str, urls: dict[str, str], games: int, run_dir: Path, concurrency: int = 4,
                  spread: bool = False) -> str:
    """The coordinator's run; `spread`: its games played as Ray tasks (`run.ray.spread_games` on a local Ray)."""
    servers = "".join(f"  {name}:\n    swarm_url: {url}\n    admin_token_env: {TOKEN_ENV}\n    trainable: true\n"
                      f"    train: {TRAIN % game}\n" for name, url in urls.items())
    ray = "  ray: {address: local, spread_games: true}\n" if spread else ""
    return (f"name: scale-{game}\nservers:\n{servers}{GAMES[game][1]}run:\n  games: {games}\n  repeats: 4\n"
            f"  concurrency: {concurrency}\n  max_tokens: 32\n  lease_timeout_s: 300\n  run_dir: {run_dir}\n{ray}")


def served_calls(url: str) -> int:
    page = httpx.get(f"{url}/metrics", timeout=30).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith("marl_calls_total")))


def play_games(model_dir: Path, scratch: Path, game: str, games: int, args) -> dict:
    """`marl run` of `games` games on simulated remote swarm servers: games/hour, its CPU per 1,000 calls (with
    `--spread-games`, its own process's: the Werewolves games' players run in Ray's workers)."""
    import os
    import subprocess

    spread = args.spread_games and game == "werewolves"
    procs = {name: start_server(model_dir, scratch / name, args.coordinator_speed) for name in GAMES[game][0]}
    try:
        topology = scratch / "topology.yaml"
        urls = {name: proc.url for name, proc in procs.items()}
        topology.write_text(topology_yaml(game, urls, games, scratch / "run", args.coordinator_concurrency, spread))
        with open(scratch / "marl-run.log", "wb") as log:
            started = time.monotonic()
            child = subprocess.Popen([sys.executable, "-m", "marl.cli", "run", str(topology)], stdout=log,
                                     stderr=subprocess.STDOUT, env={**os.environ, TOKEN_ENV: ADMIN})  # fmt: skip
            samples, status, usage = watch_usage(child.pid, list(procs.values()))
            seconds = time.monotonic() - started
        if os.waitstatus_to_exitcode(status) != 0:
            tail = (scratch / "marl-run.log").read_text()[-2000:]
            raise RuntimeError(f"marl run of {game} failed:\n{tail}")
        calls = sum(served_calls(p.url) for p in procs.values())
    finally:
        for proc in procs.values():
            proc.stop()
    playing_cpu, playing_calls = while_playing(samples)
    cpu = usage.ru_utime + usage.ru_stime
    return {"game": game, "spread_games": spread, "concurrency": args.coordinator_concurrency, "games": games,
            "seconds": seconds,
            "games_per_hour": games / seconds * 3600,
            "calls": calls, "coordinator_cpu_s": cpu, "coordinator_playing_cpu_s": playing_cpu,
            "coordinator_cpu_s_per_1k_calls": playing_cpu / max(playing_calls, 1) * 1000,
            "calls_per_game": calls / games}


def watch_usage(pid: int, procs: list) -> tuple[list[tuple[float, int]], int, object]:
    """(the coordinator's CPU-seconds, the calls its servers have served) every 0.2 s until it exits; then its
    wait status and rusage."""
    import os

    samples = []
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return samples, status, usage
        samples.append((process_usage(pid)[0], sum(served_calls(p.url) for p in procs)))
        time.sleep(0.2)


def while_playing(samples: list[tuple[float, int]]) -> tuple[float, int]:
    """CPU-seconds and calls from the first call served to the last: start-up (imports, engine starts) and
    wind-down (the run's last checkpoint and plots) left out of the cost per call."""
    final = samples[-1][1] if samples else 0
    if not final:
        return 0.0, 0
    first = next(sample for sample in samples if sample[1])
    last = next(sample for sample in samples if sample[1] == final)
    return last[0] - first[0], last[1] - first[1]


def coordinator_rate(model_dir: Path, scratch: Path, args) -> list[dict]:
    rows = []
    for game, games in (("signalling", args.signalling_games), ("werewolves", args.werewolves_games)):
        rows.append(play_games(model_dir, scratch / f"coordinator-{game}", game, games, args))
        row = rows[-1]
        label = game + " (Ray tasks)" * row["spread_games"]
        print(f"{label:>12}: {row['games']} games in {row['seconds']:.0f} s = {row['games_per_hour']:.0f} games/hour,"
              f" {row['calls']} calls; coordinator {row['coordinator_cpu_s']:.1f} CPU-s, of which"
              f" {row['coordinator_playing_cpu_s']:.1f} from the first call to the last:"
              f" {row['coordinator_cpu_s_per_1k_calls']:.1f} CPU-s per 1,000 calls")
        sys.stdout.flush()
    return rows


# --- output ---------------------------------------------------------------------------------------------------------


def plot(load_rows: list[dict], memory_rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    if load_rows:
        x = [r["leases"] for r in load_rows]
        left.plot(x, [r["marl_p50_ms"] for r in load_rows], "o-", label="marl p50")
        left.plot(x, [r["marl_p99_ms"] for r in load_rows], "s-", label="marl p99")
        left.plot(x, [r["server_marl_p99_ms"] for r in load_rows], "d-", label="server's own p99")
        left.axhline(5.0, color="grey", linestyle=":", label="goal p99 5 ms")
        left.set(xscale="log", yscale="log", xlabel="concurrent leases", ylabel="marl's added latency per call (ms)")
        twin = left.twinx()
        twin.plot(x, [r["calls_per_s"] for r in load_rows], "^--", color="tab:green", label="calls/s")
        twin.set_ylabel("chat calls/s")
        left.legend(loc="upper left")
        twin.legend(loc="lower right")
    if memory_rows:
        right.plot([r["episodes"] for r in memory_rows], [r["rss_mb"] for r in memory_rows], "o-")
        right.set(xscale="log", xlabel="episodes recorded", ylabel="server RSS (MB)",
                  ylim=(0, 1.15 * max(r["rss_mb"] for r in memory_rows)))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", default="16,128,512,1024", help="the sweep's concurrent leases, comma-separated")
    parser.add_argument("--turns", type=int, default=3, help="chat calls per episode")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--duration", type=float, default=30.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds per point before measuring")
    parser.add_argument("--speed", type=float, default=1.0, help="the load sweep's --simulated-speed (1: real time)")
    parser.add_argument("--workers", type=int, default=2, help="load-generator processes")
    parser.add_argument("--episodes", type=int, default=10_000, help="the memory phase's last checkpoint")
    parser.add_argument("--memory-speed", type=float, default=1000.0)
    parser.add_argument("--memory-max-tokens", type=int, default=2)
    parser.add_argument("--signalling-games", type=int, default=8, help="the coordinator's signalling games")
    parser.add_argument("--werewolves-games", type=int, default=4, help="the coordinator's Werewolves games")
    parser.add_argument("--coordinator-speed", type=float, default=1.0)
    parser.add_argument("--coordinator-concurrency", type=int, default=4, help="the coordinator's games in flight")
    parser.add_argument("--spread-games", action="store_true",
                        help="the Werewolves games as Ray tasks (run.ray.spread_games): the coordinator's own cost")
    parser.add_argument("--skip-load", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-coordinator", action="store_true")
    parser.add_argument("--out", type=Path, help="write scale.json and scale.png here")
    parser.add_argument("--smoke", action="store_true", help="a tiny sweep: does the bench run?")
    args = parser.parse_args(argv)
    if args.smoke:
        args.leases, args.duration, args.warmup, args.episodes = "4,16", 1.0, 0.3, 100
        args.signalling_games, args.werewolves_games, args.coordinator_speed = 2, 2, 20.0
    args.leases = [int(n) for n in str(args.leases).split(",")]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    from tests.tiny_model import build_tiny_model

    results: dict[str, list[dict]] = {"load": [], "memory": [], "coordinator": []}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = build_tiny_model(Path(scratch) / "tiny")
        if not args.skip_load:
            print(f"load sweep: speed {args.speed:g}, {args.turns} calls of <= {args.max_tokens} tokens per episode,"
                  f" {args.duration:g} s per point after {args.warmup:g} s, {args.workers} load processes")
            results["load"] = load_sweep(model_dir, Path(scratch), args)
        if not args.skip_memory:
            print(f"memory: speed {args.memory_speed:g}, 1 call of <= {args.memory_max_tokens} tokens per episode,"
                  f" {MEMORY_LEASES} leases")
            results["memory"] = memory_growth(model_dir, Path(scratch), args)
        if not args.skip_coordinator:
            print(f"coordinator: marl run on simulated remote swarm servers at speed {args.coordinator_speed:g}")
            results["coordinator"] = coordinator_rate(model_dir, Path(scratch), args)
    memory = results["memory"]
    if memory:
        first, last = memory[0], memory[-1]
        print(f"RSS after {first['episodes']} episodes {first['rss_mb']:.1f} MB, after {last['episodes']}"
              f" {last['rss_mb']:.1f} MB: x{last['rss_mb'] / first['rss_mb']:.2f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        (args.out / "scale.json").write_text(json.dumps({"settings": settings, **results}, indent=2))
        plot(results["load"], memory, args.out / "scale.png")
        print(f"wrote {args.out / 'scale.json'} and {args.out / 'scale.png'}")

if __name__ == "__main__":
    main()
