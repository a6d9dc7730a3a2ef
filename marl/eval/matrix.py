"""A matrix of pairings: play each, summarise each role with intervals, and write eval.json, eval.csv, eval.png.

    eval.json   the settings, and per pairing: who sat where (server, version, model), per-role statistics, and
                every game with its seed (a `GameRecord`, as in games.jsonl)
    eval.csv    one row per pairing and role: the checkpoint of every role, then the role's statistics
    eval.png    a heatmap per evaluated role (or `--role`'s only) of its win rate with its 95% interval over the
                pairings (two or more pairings)
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from marl.eval.pairings import EvalSettings, Pairing, play_pairing
from marl.eval.stats import CONFIDENCE, WIN_RULES, RoleStats, summarize
from marl.games.record import GameRecord
from marl.league.snapshots import StaticFleet
from marl.topology import Topology
from marl.watching.plot import percent, plot_eval_matrix

STAT_COLUMNS = ("games", "wins", "win_rate", "win_low", "win_high", "mean_reward", "reward_low", "reward_high",
                "valid_reply_rate")


@dataclass
class PairingResult:
    pairing: Pairing
    games: list[GameRecord]
    roles: dict[str, RoleStats]

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.pairing.label, "seats": self.pairing.describe(),
                "roles": {role: stats.as_json() for role, stats in self.roles.items()},
                "seeds": [game.seed for game in self.games],
                "games": [game.model_dump(mode="json") for game in self.games]}


def evaluate(topology: Topology, pairings: Sequence[Pairing], fleet: StaticFleet, settings: EvalSettings, *,
             on_result: Callable[[PairingResult], None] = lambda result: None,
             should_stop: Callable[[], bool] = lambda: False) -> list[PairingResult]:
    """Play every pairing in turn (the fleet keeps serving the snapshots the next one shares)."""
    results = []
    for pairing in pairings:
        if should_stop():
            break
        games = play_pairing(topology, pairing, fleet, settings, should_stop=should_stop)
        results.append(PairingResult(pairing, games, summarize(games)))
        on_result(results[-1])
    return results


def write_outputs(out_dir: Path, topology: Topology, settings: EvalSettings, results: Sequence[PairingResult],
                  heatmap_role: str | None = None) -> list[Path]:
    """eval.json and eval.csv, and eval.png for two or more pairings; returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"topology": topology.name, "settings": asdict(settings), "confidence": CONFIDENCE,
              "pairings": [result.as_dict() for result in results]}
    written = [out_dir / "eval.json", out_dir / "eval.csv"]
    written[0].write_text(json.dumps(report, indent=1))
    _write_csv(written[1], results)
    roles = [heatmap_role] if heatmap_role else list(results[0].pairing.seats) if results else []
    if len(results) > 1 and roles:
        cells = [({r: s.label for r, s in result.pairing.seats.items()}, result.roles) for result in results]
        written.append(plot_eval_matrix(cells, roles, out_dir / "eval.png"))
    return written


def _write_csv(path: Path, results: Sequence[PairingResult]) -> None:
    seat_roles = list(dict.fromkeys(role for result in results for role in result.pairing.seats))
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["pairing", *(f"{role}_checkpoint" for role in seat_roles), "role", *STAT_COLUMNS])
        for result in results:
            seats = [result.pairing.seats[r].label if r in result.pairing.seats else "" for r in seat_roles]
            for role, stats in result.roles.items():
                values = stats.as_dict()
                writer.writerow([result.pairing.label, *seats, role, *(_cell(values[c]) for c in STAT_COLUMNS)])


def results_table(results: Sequence[PairingResult], games: int) -> Table:
    """The console summary: one row per pairing and role."""
    table = Table(title=f"marl eval: {games} games per pairing, {CONFIDENCE:.0%} intervals", title_justify="left")
    for column in ("pairing", "role", "games", "win rate", "mean reward", "valid replies"):
        table.add_column(column, justify="left" if column in ("pairing", "role") else "right")
    for result in results:
        for i, (role, s) in enumerate(result.roles.items()):
            table.add_row(result.pairing.label if i == 0 else "", role, str(s.games),
                          f"{percent(s.win_rate)} [{percent(s.win_low)}, {percent(s.win_high)}]",
                          f"{s.mean_reward:.3f} [{_number(s.reward_low)}, {_number(s.reward_high)}]",
                          percent(s.valid_reply_rate))
    table.caption = win_rules_caption(results)
    return table


def win_rules_caption(results: Sequence[PairingResult]) -> str:
    """Which rule counted each role's wins (marl.eval.stats.WIN_RULES), one line per rule."""
    roles_by_rule: dict[str, list[str]] = {}
    for result in results:
        for role, stats in result.roles.items():
            if role not in roles_by_rule.setdefault(stats.win_rule, []):
                roles_by_rule[stats.win_rule].append(role)
    return "\n".join(f"a win of {', '.join(roles)}: {WIN_RULES.get(rule, 'by different rules in different games')}"
                     for rule, roles in roles_by_rule.items() if rule)


def _number(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


def _cell(value: float) -> str:
    return "" if isinstance(value, float) and math.isnan(value) else str(value)
