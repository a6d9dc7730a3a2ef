"""Rollouts during training (issue 22): games per hour and the rollout idle fraction, `overlap: false` against
`true`, when every game waits on a slow co-player.

    python bench/overlap.py                       # SmolLM2-135M learner, 1 s co-player, 8 steps per side
    python bench/overlap.py --out DIR             # also DIR/overlap.json
    python bench/overlap.py --smoke               # a tiny random model, 2 steps per side, 0.3 s co-player
    python bench/overlap.py --engine simulated --game werewolves --speed 2 --steps 5 --concurrency 32
                                                  # the scheduling alone, a trainer on devices of its own (~12 min)
    python bench/overlap.py --engine simulated --game werewolves --speed 2 --steps 5 --concurrency 32
        --max-rounds 10 --valid-action-bonus 0.2 --ppo-epochs 2
                                                  # the issue's 10-round games, a step twice as long (~22 min)

The game (`--game signalling`) is the signalling game of `topologies/signalling-cpu.yaml`: its speaker is the learner
(a trainable server, the shipped settings: batches of 2 groups of 8), its listener a static model behind an OpenAI
URL that answers each call `--delay` seconds late, standing for a frozen 235B behind an API. The delay lives here, in
a proxy of this script's own in front of a `marl serve --static` server; the product knows nothing of it. Each side
is one `marl run` of `--steps` steps at the same settings but `overlap`, measured from its own records: games per
hour between the first and the last game's end (games.jsonl), and the learner's rollout idle fraction (the
`rollout_idle_frac` of each step after the first in metrics.jsonl, weighted by the time since the step before).
`--game werewolves`: 9-player Werewolves (`--max-rounds`, 3 by default), the learner the three werewolves (batches
of 4 groups of 8), the co-player every other seat: the issue's own case of long games against a frozen model.

`--engine torch` (the default) trains SmolLM2 on this machine's CPU, where the step and the rollouts share the cores:
an overlapped step is slower, which a trainer on devices of its own does not suffer. `--engine simulated` measures
the scheduling alone: the learner and the co-player are `marl serve --engine simulated` processes (the learner
started here and reached by `swarm_url:`), whose engine answers with a GPU engine's latency and whose trainer sleeps
as long as a 7B GRPO step on 8 H100s would (`servers/engines/simulated.py`, `servers/trainers/simulated.py`;
`--speed` runs both faster). Their replies copy spans of their prompts, so some messages name the target and some
picks are right: groups' rewards vary and steps train. What is measured is how the learner's rollouts wait, not
what is learned.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn
import yaml
from fastapi import FastAPI, Request, Response

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from marl.runner.launch import ServerProcess, free_port  # noqa: E402
from servers.entrypoint import http_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-overlap"
TOKEN_ENV = "MARL_OVERLAP_BENCH_ADMIN"


def delaying_proxy(upstream: str, delay_s: float) -> FastAPI:
    """An OpenAI endpoint that forwards every call to `upstream` and answers `delay_s` later: a slow co-player."""
    app = FastAPI()
    client = httpx.AsyncClient(base_url=upstream, timeout=120)

    @app.post("/v1/{path:path}")
    async def forward(path: str, request: Request) -> Response:
        started = time.monotonic()
        answer = await client.post(f"/v1/{path}", content=await request.body(),
                                   headers={"content-type": "application/json"})
        await asyncio.sleep(max(0.0, delay_s - (time.monotonic() - started)))
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    return app


def serve_in_thread(app: FastAPI, port: int) -> uvicorn.Server:
    server = http_server(app, "127.0.0.1", port, "warning")  # configured as `marl serve`'s (its keep-alive)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server


#: The Werewolves shape of the issue: the learner plays the three werewolves; the seer, witch, hunter and villagers
#: are the slow co-player (a frozen 235B behind an API in the user's run). `--max-rounds` sets the game's length
#: (3 by default, shorter than the issue's 10 rounds) and `--valid-action-bonus` the env's shaping.
WEREWOLVES = {
    "train": {"job": "werewolves", "batch_size": 4, "num_repeat": 8},
    "roles": {"werewolf": {"server": "learner", "count": 3, "team": "werewolves"},
              "seer": {"server": "coplayer", "team": "village"}, "witch": {"server": "coplayer", "team": "village"},
              "hunter": {"server": "coplayer", "team": "village"},
              "villager": {"server": "coplayer", "count": 3, "team": "village"}},
    "env": {"class": "envs.werewolves:Werewolves"},  # its args: `--max-rounds`, `--valid-action-bonus`
    "run": {"repeats": 8, "max_tokens": 64, "temperature": 1.0, "lease_timeout_s": 600},
}


def game_settings(args: argparse.Namespace) -> dict:
    """The game's `train`, `env`, `run` and `roles`, and the learner's `device`: signalling as the shipped CPU
    topology plays it, or Werewolves (`WEREWOLVES`); `--batch-size` and `--ppo-epochs` replace the game's own."""
    shipped = yaml.safe_load((ROOT / "topologies" / "signalling-cpu.yaml").read_text())
    shipped_speaker = shipped["servers"]["speaker_model"]
    game = {"train": shipped_speaker["train"], "env": shipped["env"], "run": shipped["run"],
            "roles": {"speaker": {"server": "learner", "count": 1, "team": "speaker"},
                      "listener": {"server": "coplayer", "count": 1, "team": "listener"}}}
    if args.game == "werewolves":
        game = {**WEREWOLVES, "run": {**shipped["run"], **WEREWOLVES["run"]},
                "env": {**WEREWOLVES["env"], "args": {"max_rounds": args.max_rounds,
                                                      "valid_action_bonus": args.valid_action_bonus}}}
    if args.batch_size:
        game["train"] = {**game["train"], "batch_size": args.batch_size}
    if args.ppo_epochs:  # passes over each batch: a step that long (the simulated trainer's too)
        grpo = {**game["train"].get("grpo", {}), "ppo_epochs": args.ppo_epochs}
        game["train"] = {**game["train"], "grpo": grpo}
    return {**game, "device": shipped_speaker["device"]}


def topology(learner_at: dict, coplayer: tuple[str, str], args: argparse.Namespace, overlap: bool,
             run_dir: Path) -> dict:
    """The game of `game_settings` with the learner as its speaker or its werewolves; `learner_at`: where the
    learner lives (`model:` for a server `marl run` starts, or `swarm_url:` and its token for one of the bench's)."""
    game = game_settings(args)
    learner = {**learner_at, "trainable": True,
               "train": {**game["train"], "overlap": overlap, "max_staleness": args.max_staleness}}
    if "model" in learner_at:
        learner["device"] = game["device"]
    coplayer_url, coplayer_model = coplayer
    return {
        "name": f"overlap-{'on' if overlap else 'off'}",
        "servers": {"learner": learner, "coplayer": {"url": coplayer_url, "model": coplayer_model}},
        "roles": game["roles"], "env": game["env"],
        "run": {**game["run"], "max_steps": args.steps, "concurrency": args.concurrency, "run_dir": str(run_dir)},
    }


def measure(run_dir: Path) -> dict:
    """Games per hour and the learner's rollout idle fraction, from the run's own records."""
    ends = sorted(json.loads(line)["time"] for line in (run_dir / "games.jsonl").read_text().splitlines())
    steps = [json.loads(line) for line in (run_dir / "servers" / "learner" / "metrics.jsonl").read_text().splitlines()]
    spans = [(b["time"] - a["time"], b["rollout_idle_frac"]) for a, b in zip(steps, steps[1:], strict=False)]
    wall = sum(span for span, _ in spans)
    return {"games": len(ends), "steps": len(steps), "seconds": ends[-1] - ends[0],
            "games_per_hour": (len(ends) - 1) / (ends[-1] - ends[0]) * 3600,
            "rollout_idle_frac": sum(span * idle for span, idle in spans) / wall if wall else None,
            "step_s_mean": sum(s.get("seconds", 0.0) for s in steps) / len(steps),
            "staleness_mean": sum(s.get("staleness_mean", 0.0) for s in steps) / len(steps),
            "dropped_stale": sum(s.get("dropped_stale", 0.0) for s in steps)}


def run_side(model: str, coplayer: tuple[str, str], args: argparse.Namespace, overlap: bool, scratch: Path) -> dict:
    run_dir = scratch / f"run-{'on' if overlap else 'off'}"
    path = scratch / f"{run_dir.name}.yaml"
    learner = None
    if args.engine == "simulated":  # a server of the bench's own, its records where marl run keeps a local one's
        learner = start_server(model, run_dir / "servers" / "learner", args.speed, static=False)
        learner_at = {"swarm_url": learner.url, "admin_token_env": TOKEN_ENV}
    else:
        learner_at = {"model": model}
    try:
        path.write_text(yaml.safe_dump(topology(learner_at, coplayer, args, overlap, run_dir)))
        print(f"overlap {overlap}: marl run {path.name} ({args.steps} steps) ...", flush=True)
        subprocess.run([sys.executable, "-m", "marl.cli", "run", str(path)], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL, env={**os.environ, TOKEN_ENV: TOKEN})
    finally:
        if learner is not None:
            learner.stop()
    row, speed = measure(run_dir), args.speed if args.engine == "simulated" else 1.0
    row.update(games_per_hour=row["games_per_hour"] / speed, step_s_mean=row["step_s_mean"] * speed)  # real time
    return row


def start_server(model: str, data_dir: Path, speed: float, *, static: bool) -> ServerProcess:
    """A `marl serve` of `model` (`speed` None: the torch engine; else the simulated one at that speed)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    simulated = {} if speed is None else {"engine": "simulated", "simulated_speed": speed}
    proc = ServerProcess(model=model, admin_token=TOKEN, data_dir=data_dir, static=static, device="cpu",
                         served_name=data_dir.name, log_path=data_dir.parent / f"{data_dir.name}.log",
                         **simulated).start()  # fmt: skip
    proc.wait_healthy(timeout=300)
    return proc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay", type=float, default=1.0, help="seconds the co-player takes per call")
    parser.add_argument("--steps", type=int, default=8, help="training steps per side")
    parser.add_argument("--concurrency", type=int, default=16, help="games in flight (run.concurrency)")
    parser.add_argument("--max-staleness", type=int, default=1, help="the learner's train.max_staleness")
    parser.add_argument("--batch-size", type=int, help="the learner's train.batch_size in groups of 8 (the game's: 2"
                                                       " for signalling, 4 for werewolves)")
    parser.add_argument("--ppo-epochs", type=int, help="the learner's train.grpo.ppo_epochs (the game's: 1); each"
                                                       " pass lengthens the step")
    parser.add_argument("--game", choices=["signalling", "werewolves"], default="signalling",
                        help="signalling: the learner speaks to the co-player; werewolves: it plays the wolves")
    parser.add_argument("--max-rounds", type=int, default=3, help="with --game werewolves: rounds at most per game")
    parser.add_argument("--valid-action-bonus", type=float, default=0.0,
                        help="with --game werewolves: the env's shaping (at 10 rounds the simulated wolves nearly"
                             " always win: the bonus makes groups differ, so steps train)")
    parser.add_argument("--engine", choices=["torch", "simulated"], default="torch",
                        help="torch: SmolLM2 on this CPU; simulated: a GPU engine's latency and a 7B trainer's step")
    parser.add_argument("--speed", type=float, default=1.0, help="with --engine simulated: its delays this much faster")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model, 2 steps per side, 0.3 s co-player")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="overlap-") as tmp:
        scratch, model = Path(tmp), "smollm2-135m"
        if args.smoke:
            from tests.tiny_model import build_tiny_model

            model, args.steps, args.delay = str(build_tiny_model(scratch / "tiny")), 2, min(args.delay, 0.3)
        speed = args.speed if args.engine == "simulated" else None
        static, proxy = start_server(model, scratch / "coplayer", speed, static=True), None
        try:
            port = free_port("127.0.0.1")
            delay = args.delay / (speed or 1.0)  # a faster simulation runs the co-player's delay faster too
            proxy = serve_in_thread(delaying_proxy(static.url, delay), port)
            coplayer = (f"http://127.0.0.1:{port}/v1", "coplayer")
            train = game_settings(args)["train"]
            report = {"model": "tiny" if args.smoke else model, "engine": args.engine, "game": args.game,
                      "max_rounds": args.max_rounds if args.game == "werewolves" else None,
                      "valid_action_bonus": args.valid_action_bonus if args.game == "werewolves" else None,
                      "speed": args.speed if speed else 1.0, "delay_s": args.delay, "steps": args.steps,
                      "concurrency": args.concurrency, "max_staleness": args.max_staleness,
                      "batch_size": train["batch_size"], "ppo_epochs": train.get("grpo", {}).get("ppo_epochs", 1),
                      "off": run_side(model, coplayer, args, False, scratch),
                      "on": run_side(model, coplayer, args, True, scratch)}
        finally:
            if proxy is not None:
                proxy.should_exit = True
            static.kill()
    report["games_per_hour_ratio"] = report["on"]["games_per_hour"] / report["off"]["games_per_hour"]
    print_report(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "overlap.json").write_text(json.dumps(report, indent=2))
    return 0


def print_report(report: dict) -> None:
    rounds = f" ({report['max_rounds']} rounds at most)" if report.get("max_rounds") else ""
    print(f"{report['game']} game{rounds}, {report['engine']} engine (speed {report['speed']:g}),"
          f" learner {report['model']},"
          f" co-player {report['delay_s']:.1f} s per call,"
          f" {report['concurrency']} games in flight, batches of {report['batch_size']} groups of 8,"
          f" {report.get('ppo_epochs', 1)} PPO epoch(s) per step,"
          f" max_staleness {report['max_staleness']},"
          f" {report['steps']} steps per side:")
    print(f"{'overlap':10}{'games':>7}{'games/hour':>12}{'rollout idle':>14}{'step s':>8}{'staleness':>11}"
          f"{'dropped':>9}")
    for label, row in (("false", report["off"]), ("true", report["on"])):
        idle = "-" if row["rollout_idle_frac"] is None else f"{row['rollout_idle_frac']:.1%}"
        print(f"{label:10}{row['games']:>7}{row['games_per_hour']:>12.0f}{idle:>14}{row['step_s_mean']:>8.1f}"
              f"{row['staleness_mean']:>11.2f}{row['dropped_stale']:>9.0f}")
    print(f"overlap true / false: games per hour {report['games_per_hour_ratio']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
