"""`marl plot RUN_DIR`: PNG curves of a run, from the records it wrote (no server needed).

    reward_curves.png             from games.jsonl: per trainable server, the mean reward of every role in the
                                  game against that server's policy version (what the other roles did matters too)
    servers/<name>/training.png   from the server's metrics.jsonl: reward mean ± std per role, loss, entropy and
                                  grad norm against the training step

`marl run` calls `plot_run` when it ends; run it again any time, also while a run goes on.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from marl.game_record import GameRecord, as_records, read_games

__all__ = ["percent", "plot_reward_curves", "plot_run", "plot_training", "summarize_games", "summarize_roles"]


def plot_run(run_dir: Path) -> list[Path]:
    """Every PNG this run's records allow; returns the paths written (empty if nothing to plot yet)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory (expected a run dir such as runs/signalling-cpu)")
    written = [plot_reward_curves(run_dir)]
    data_dirs = sorted(p.parent for p in run_dir.glob("servers/*/metrics.jsonl"))
    if (run_dir / "metrics.jsonl").exists():  # a server's own data dir works too
        data_dirs.append(run_dir)
    written += [plot_training(d) for d in data_dirs]
    return [p for p in written if p is not None]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: works over SSH and in CI
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a crash
    return rows


def plot_reward_curves(run_dir: Path) -> Path | None:
    """reward_curves.png: per trainable server, the mean reward of each role, per policy version of that server."""
    curves: dict[str, dict[str, dict[int, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for game in read_games(Path(run_dir) / "games.jsonl"):
        for server, version in game.policy_versions.items():
            for role, reward in game.role_rewards.items():
                curves[server][role][version].append(reward)
    if not curves:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.5), squeeze=False)
    for ax, (server, roles) in zip(axes[0], sorted(curves.items())):
        for role, by_version in sorted(roles.items()):
            versions = sorted(by_version)
            ax.plot(versions, [sum(by_version[v]) / len(by_version[v]) for v in versions], marker="o", label=role)
        ax.set_title(server)
        ax.set_xlabel("policy version")
        ax.set_ylabel("mean reward")
        ax.legend()
    return _save(fig, Path(run_dir) / "reward_curves.png")


def plot_training(data_dir: Path) -> Path | None:
    """training.png in a server's data dir: its training metrics per step (reward per role, loss, ...)."""
    steps = _read_jsonl(Path(data_dir) / "metrics.jsonl")
    if not steps:
        return None
    roles = sorted({k.split("/", 1)[1] for row in steps for k in row if k.startswith("reward_mean/")})
    panels = [("reward", [(f"reward_mean/{r}", f"reward_std/{r}", r) for r in roles]
               or [("reward_mean", "reward_std", "all")])]
    panels += [(key, [(key, None, key)]) for key in ("loss", "entropy", "grad_norm") if any(key in r for r in steps)]
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.3), squeeze=False)
    for ax, (title, series) in zip(axes[0], panels):
        for mean_key, std_key, label in series:
            points = [(row["step"], row[mean_key], row.get(std_key, math.nan) if std_key else math.nan)
                      for row in steps if mean_key in row]
            if not points:
                continue
            x, y, err = zip(*points)
            ax.plot(x, y, marker=".", label=label)
            if std_key and not all(math.isnan(e) for e in err):
                ax.fill_between(x, [a - b for a, b in zip(y, err)], [a + b for a, b in zip(y, err)], alpha=0.2)
        ax.set_title(f"{Path(data_dir).name}: {title}")
        ax.set_xlabel("training step")
        if len(series) > 1 or title == "reward":
            ax.legend()
    return _save(fig, Path(data_dir) / "training.png")


def summarize_games(run_dir: Path) -> dict[str, dict[str, float]]:
    """Per role over games.jsonl: games, mean reward, valid-reply rate (1 - invalid / replies), win rate (games its
    team won, of those with a recorded winner; NaN for games without winners), and games/hour over all games."""
    games = read_games(Path(run_dir) / "games.jsonl")
    return {**summarize_roles(games), **_pace(games)}


def summarize_roles(games: Iterable[GameRecord | Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """`summarize_games` for a list of games (records, or games.jsonl rows as dicts), without the pace."""
    records = as_records(games)
    out: dict[str, dict[str, float]] = {}
    for role in sorted({r for g in records for r in g.role_rewards}):
        played = [g for g in records if role in g.role_rewards]
        replies = sum(g.replies.get(role, 0) for g in played)
        invalid = sum(g.invalid_actions.get(role, 0) for g in played)
        decided = [g for g in played if g.winner is not None and role in g.teams]
        won = sum(g.teams[role] == g.winner for g in decided)
        out[role] = {
            "games": len(played),
            "mean_reward": sum(g.role_rewards[role] for g in played) / len(played),
            "valid_reply_rate": 1 - invalid / replies if replies else math.nan,
            "win_rate": won / len(decided) if decided else math.nan,
        }
    return out


def percent(rate: float) -> str:
    """A rate for a table: "-" for NaN (nothing counted: no replies, no recorded winner)."""
    return "-" if rate != rate else f"{100 * rate:.0f}%"


def _pace(games: list[GameRecord]) -> dict[str, dict[str, float]]:
    times = [g.time for g in games if g.time is not None]
    out: dict[str, dict[str, float]] = {}
    if len(times) > 1:
        hours = (times[-1] - times[0]) / 3600
        out["all"] = {"games": len(games), "games_per_hour": (len(times) - 1) / hours if hours > 0 else math.nan}
    return out
