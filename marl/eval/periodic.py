"""`run.eval_every: K`: while `marl run` trains, greedy games between checkpoints every K steps, into evals.jsonl.

When the run starts (step 0) and each time every learner (a trainable server, or each LoRA policy of one) has a
checkpoint at or past the next multiple of K (the evaluation's step: the oldest of their newest checkpoints), a
background thread plays `run.eval_games`
greedy games (temperature 0, the run's seed: the same games every time) per pairing, on static servers of their own
(training goes on meanwhile):
- `latest`: every checkpointed role on its learner's newest checkpoint (the initial models at step 0);
- `<learner> latest` (past step 0, unless the learner plays every checkpointed role): that learner's roles on its
  newest checkpoint, every other checkpointed role on its initial model: did this policy improve, partners fixed?
  (e.g. `speaker_model latest`, or `team.speaker latest` for the policy speaker of server team)
A past_of role counts as its trainable server's: `latest` is then self-play of the newest checkpoint, and
`<server> latest` the newest against the initial model.

Each pairing is one line of evals.jsonl: {"step", "time", "pairing", "seats": role -> checkpoint label, "versions":
role -> version, "roles": role -> `RoleStats` (JSON)}; `marl plot` draws evals.png from it. With
`run.eval_exploitability`, each evaluation then measures `latest`'s exploitability into exploitability.jsonl
(marl/eval/exploitability_curve.py). A checkpoint pruned before its server loaded it (`train.keep_checkpoints`)
fails that evaluation, which is reported and skipped.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from marl.eval.exploitability_curve import EXPLOITABILITY_FILE, ExploitabilityCurve
from marl.eval.info_states import NotMeasurable, PolicySeats
from marl.eval.pairings import EvalFailed, EvalSettings, Pairing, checkpointed_roles, fleet_devices, play_pairing
from marl.eval.stats import summarize
from marl.games.record import GameRecord
from marl.league.snapshots import (
    INITIAL,
    LATEST,
    SnapshotError,
    StaticFleet,
    checkpoints_of,
    resolve_snapshot,
    role_checkpoints,
)
from marl.topology import Topology

log = logging.getLogger("marl.eval")

EVALS_FILE = "evals.jsonl"


class PeriodicEval:
    def __init__(self, topology: Topology, run_dir: Path, token: str, *, seats: PolicySeats | None = None,
                 report: Callable[[str], None] = log.info, poll_s: float = 5.0):
        """`seats`: the game's, to measure exploitability at each evaluation (`exploitability_curve.check_measurable`
        gives them for run.eval_exploitability); None: games only."""
        run = topology.spec.run
        assert run.eval_every is not None, "run.eval_every is not set"
        self.topology, self.run_dir, self.every = topology, Path(run_dir), run.eval_every
        self.report, self.poll_s = report, poll_s
        self.learners = topology.learners()  # learner -> (server, policy): whose checkpoints are evaluated
        self.settings = EvalSettings(games=run.eval_games, seed=run.seed, temperature=0.0,
                                     concurrency=min(4, run.eval_games), max_tokens=run.max_tokens,
                                     max_failures=run.max_failures, lease_timeout_s=run.lease_timeout_s)
        # One fleet for the whole run: the initial models stay up; older checkpoints make room for newer ones.
        self.fleet = StaticFleet(self.run_dir / "logs" / "eval", token=token, devices=fleet_devices(topology),
                                 max_servers=2 * len(self.learners))
        self.curve = ExploitabilityCurve(topology, seats, self.run_dir, self.fleet) if seats is not None else None
        self.evaluated: list[int] = []  # the steps evaluated, in order
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="periodic-eval", daemon=True)

    def start(self) -> PeriodicEval:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop: an evaluation in progress gives up (its servers are stopped, booting or not; its games end)."""
        self._stop.set()
        self.fleet.close()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    def reached(self) -> int:
        """The step every learner has a checkpoint of (its newest; 0 before any)."""
        return min((max(checkpoints_of(self.run_dir, server, policy), default=0)
                    for server, policy in self.learners.values()), default=0)

    def _loop(self) -> None:
        due = 0
        while not self._stop.is_set():
            reached = self.reached()
            if reached >= due:
                self._evaluate(reached)
                due = (reached // self.every + 1) * self.every
            self._stop.wait(self.poll_s)

    def pairings(self, step: int) -> dict[str, Pairing]:
        """The pairings of the evaluation at `step` (see the module docstring)."""
        topology, roles = self.topology, checkpointed_roles(self.topology)
        latest = {s: resolve_snapshot(topology, self.run_dir, s, LATEST, latest_may_be_initial=True)
                  for s in self.learners}  # at step 0, and until a learner's first checkpoint: its initial model
        initial = {s: resolve_snapshot(topology, self.run_dir, s, INITIAL) for s in self.learners}
        source = {role: role_checkpoints(topology, role) for role in roles}
        pairings = {"latest": Pairing({role: latest[source[role]] for role in roles})}
        for learner in self.learners if step > 0 else ():
            # a past_of role's learner is the past_of server: it stays on the initial model here
            if all(topology.learner_of(role) == learner for role in roles):
                continue  # it plays every checkpointed role: the same pairing as `latest`
            pairings[f"{learner} latest"] = Pairing({role: latest[learner] if topology.learner_of(role) == learner
                                                     else initial[source[role]] for role in roles})
        return pairings

    def _evaluate(self, step: int) -> None:
        try:
            for label, pairing in self.pairings(step).items():
                games = play_pairing(self.topology, pairing, self.fleet, self.settings, should_stop=self._stop.is_set)
                if self._stop.is_set():
                    return
                self._append(step, label, pairing, games)
            if self.curve is not None:
                self._append_exploitability(self.curve.measure(step))
        except (EvalFailed, RuntimeError, SnapshotError, NotMeasurable) as exc:
            if not self._stop.is_set():  # else: the run is ending, which is why
                self.report(f"evaluation at step {step} failed: {exc}")
            return
        self.evaluated.append(step)

    def _append(self, step: int, label: str, pairing: Pairing, games: list[GameRecord]) -> None:
        stats = summarize(games)
        row = {"step": step, "time": time.time(), "pairing": label, "games": len(games),
               "seats": {role: s.label for role, s in pairing.seats.items()},
               "versions": {role: s.version for role, s in pairing.seats.items()},
               "roles": {role: s.as_json() for role, s in stats.items()}}
        with open(self.run_dir / EVALS_FILE, "a") as f:
            f.write(json.dumps(row) + "\n")
        wins = ", ".join(f"{role} {s.win_rate:.2f} [{s.win_low:.2f}, {s.win_high:.2f}]" for role, s in stats.items())
        self.report(f"eval at step {step}, {label}: win rate {wins}")

    def _append_exploitability(self, row: dict) -> None:
        if self._stop.is_set():
            return  # the run is ending: its servers may have gone mid-reading
        with open(self.run_dir / EXPLOITABILITY_FILE, "a") as f:
            f.write(json.dumps(row) + "\n")
        checkpoints = " ".join(f"{role}={label}" for role, label in row["checkpoints"].items())
        self.report(f"eval at step {row['step']}, exploitability of {checkpoints}: {row['value']:.3f}"
                    f" [{row['low']:.3f}, {row['high']:.3f}]")
