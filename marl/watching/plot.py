"""`marl plot RUN_DIR`: PNG curves of a run, from the records it wrote (no server needed).

    reward_curves.png             from games.jsonl: per trainable server (or LoRA policy), the mean reward of each
                                  role it played against its policy version (rows older than `co_players`: every
                                  role of the game)
    servers/<name>/training.png   from the server's metrics.jsonl: reward mean ± std per role, loss, entropy and
                                  grad norm against the training step (servers/<name>/policies/<policy>/ for
                                  each LoRA policy of a server)
    evals.png                     from evals.jsonl (`run.eval_every`): per role, the greedy win rate and mean
                                  reward of each evaluated pairing, with 95% intervals, against the training step
    exploitability.png            from exploitability.jsonl (`run.eval_exploitability`): the exploitability of
                                  each evaluation's `latest`, with its 95% interval, against the reference points

`marl eval` writes eval.png (`plot_eval_matrix`): each role's win rate over a matrix of pairings; `marl plot RUN_DIR`
draws it again from RUN_DIR/eval/eval.json (`replot_eval_matrix`).

`marl run` calls `plot_run` when it ends; run it again any time, also while a run goes on.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from marl.games.record import GameRecord, as_records, read_games

__all__ = ["percent", "plot_eval_matrix", "plot_evals", "plot_exploitability", "plot_exploitability_curve",
           "plot_reward_curves", "plot_run", "plot_training", "replot_eval_matrix", "reward_figure", "summarize_games",
           "summarize_roles"]


def plot_run(run_dir: Path) -> list[Path]:
    """Every PNG this run's records allow; returns the paths written (empty if nothing to plot yet)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory (expected a run dir such as runs/signalling-cpu)")
    written = [plot_reward_curves(run_dir)]
    data_dirs = sorted(p.parent for pattern in ("servers/*/metrics.jsonl", "servers/*/policies/*/metrics.jsonl")
                       for p in run_dir.glob(pattern))  # a server of LoRA policies: one learner each
    if (run_dir / "metrics.jsonl").exists():  # a server's own data dir works too
        data_dirs.append(run_dir)
    written += [plot_training(d) for d in data_dirs]
    written.append(plot_evals(run_dir))
    written.append(plot_exploitability_curve(run_dir))
    written.append(replot_eval_matrix(run_dir / "eval"))
    return [p for p in written if p is not None]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: works over SSH and in CI
    import matplotlib.pyplot as plt

    return plt


def _whole_numbers(ax) -> None:
    """Ticks at whole numbers only (versions and steps have no 0.5): at each x of the drawn lines when they are few,
    else where matplotlib puts them, rounded to integers (it draws fractions around a single point)."""
    from matplotlib.ticker import MaxNLocator

    xs = sorted({float(x) for line in ax.get_lines() for x in line.get_xdata()})
    if 0 < len(xs) <= 12:
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


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
    """reward_curves.png (`reward_figure`); None when there is no game yet."""
    fig = reward_figure(run_dir)
    return None if fig is None else _save(fig, Path(run_dir) / "reward_curves.png")


def reward_figure(run_dir: Path):
    """The figure of reward_curves.png: per trainable server, the mean reward of each role it played, per policy
    version of that server (whole versions on the x axis); None when there is no game yet."""
    curves: dict[str, dict[str, dict[int, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for game in read_games(Path(run_dir) / "games.jsonl"):
        for server, version in game.policy_versions.items():
            for role, reward in game.role_rewards.items():
                player = game.co_players.get(role)
                if player is None or player.server == server:  # no co_players: a row of an older version
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
        _whole_numbers(ax)
        ax.set_ylabel("mean reward")
        ax.legend()
    return fig


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
        _whole_numbers(ax)
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


def plot_evals(run_dir: Path) -> Path | None:
    """evals.png: per role (columns), the win rate and mean reward (rows) of each pairing against the step."""
    rows = _read_jsonl(Path(run_dir) / "evals.jsonl") if (Path(run_dir) / "evals.jsonl").exists() else []
    if not rows:
        return None
    roles = sorted({role for row in rows for role in row["roles"]})
    pairings = list(dict.fromkeys(row["pairing"] for row in rows))
    plt = _pyplot()
    fig, axes = plt.subplots(2, len(roles), figsize=(4.5 * len(roles), 6), squeeze=False)
    for column, role in enumerate(roles):
        for pairing in pairings:
            points = sorted((row["step"], row["roles"][role]) for row in rows
                            if row["pairing"] == pairing and role in row["roles"])
            for ax, (mean, low, high) in zip(axes[:, column], (("win_rate", "win_low", "win_high"),
                                                               ("mean_reward", "reward_low", "reward_high"))):
                x = [step for step, _ in points]
                ax.plot(x, [_nan(stats[mean]) for _, stats in points], marker="o", label=pairing)
                ax.fill_between(x, [_nan(stats[low]) for _, stats in points],
                                [_nan(stats[high]) for _, stats in points], alpha=0.15)
        axes[0, column].set_title(f"{role}: greedy win rate")
        axes[1, column].set_title(f"{role}: mean reward")
        for ax in axes[:, column]:
            ax.set_xlabel("training step")
            _whole_numbers(ax)
            ax.legend(fontsize="small")
    return _save(fig, Path(run_dir) / "evals.png")


def plot_eval_matrix(cells: list[tuple[dict[str, str], Mapping[str, Any]]], roles: Sequence[str],
                     path: Path) -> Path:
    """Heatmaps of each of `roles`' win rate over pairings, side by side: `cells` are (role -> checkpoint label,
    role -> its stats with `win_rate`, `win_low`, `win_high`) per pairing. Two roles that vary: rows × columns;
    otherwise one row."""
    row_names, column_names, ylabel, xlabel, place = _matrix_layout([labels for labels, _ in cells])
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(roles), squeeze=False,
                             figsize=(len(roles) * (1.6 * len(column_names) + 2), 1.1 * len(row_names) + 1.8))
    for ax, role in zip(axes[0], roles):
        grid = [[cells[place[(r, c)]][1].get(role) if (r, c) in place else None for c in column_names]
                for r in row_names]
        image = ax.imshow([[_nan(getattr(stats, "win_rate", math.nan)) for stats in row] for row in grid],
                          vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for i, row in enumerate(grid):
            for j, stats in enumerate(row):
                if stats is not None:
                    ax.text(j, i, f"{stats.win_rate:.2f}\n[{stats.win_low:.2f}, {stats.win_high:.2f}]",
                            ha="center", va="center", fontsize=8, color="white" if stats.win_rate < 0.6 else "black")
        ax.set_xticks(range(len(column_names)), column_names)
        ax.set_yticks(range(len(row_names)), row_names)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{role}: win rate (95% interval)")
        fig.colorbar(image, ax=ax)
    return _save(fig, Path(path))


def replot_eval_matrix(eval_dir: Path) -> Path | None:
    """Draw `eval_dir`/eval.png again from the eval.json `marl eval` wrote there (every evaluated role); None when
    there is no eval.json or it has fewer than two pairings."""
    path = Path(eval_dir) / "eval.json"
    if not path.exists():
        return None
    pairings = json.loads(path.read_text())["pairings"]
    if len(pairings) < 2:
        return None
    cells = [({role: seat["label"] for role, seat in p["seats"].items()},
              {role: SimpleNamespace(**{k: _nan(v) for k, v in stats.items()}) for role, stats in p["roles"].items()})
             for p in pairings]
    return plot_eval_matrix(cells, list(pairings[0]["seats"]), path.with_name("eval.png"))


def _matrix_layout(labels: list[dict[str, str]]):
    """Rows, columns, axis labels and (row, column) -> pairing index for pairings' checkpoint labels: the two roles
    whose checkpoint varies span rows × columns; otherwise the pairings form one row."""
    varying = [r for r in dict.fromkeys(r for pairing in labels for r in pairing)
               if len({pairing.get(r) for pairing in labels}) > 1]
    if len(varying) == 2:
        row_role, column_role = varying
        rows = list(dict.fromkeys(pairing[row_role] for pairing in labels))
        columns = list(dict.fromkeys(pairing[column_role] for pairing in labels))
        place = {(pairing[row_role], pairing[column_role]): i for i, pairing in enumerate(labels)}
        return rows, columns, row_role, column_role, place
    columns = [" ".join(pairing[r] for r in varying) or str(i) for i, pairing in enumerate(labels)]
    return [""], columns, "", " ".join(varying) or "pairing", {("", c): i for i, c in enumerate(columns)}


def _nan(value: float | None) -> float:
    """JSON's null (a NaN written by `marl eval`) back to NaN, which matplotlib leaves out."""
    return math.nan if value is None else value


def plot_exploitability_curve(run_dir: Path) -> Path | None:
    """exploitability.png from exploitability.jsonl (`run.eval_exploitability`): one point per evaluation."""
    from marl.eval.exploitability_curve import EXPLOITABILITY_FILE, curve_report
    path = Path(run_dir) / EXPLOITABILITY_FILE
    rows = _read_jsonl(path) if path.exists() else []
    return plot_exploitability(curve_report(rows), Path(run_dir) / "exploitability.png") if rows else None


def plot_exploitability(report: Mapping[str, Any], path: Path) -> Path:
    """The exploitability of each profile of a `marl eval --exploitability` report (its JSON document), in order,
    with its 95% interval, against the reference points (dashed): a curve over versions with `--diagonal`."""
    profiles = report["profiles"]
    # one label per distinct checkpoint of a profile: "10", not "10 10"
    labels = [" ".join(dict.fromkeys(str(ref) for ref in p["checkpoints"].values())) for p in profiles]
    x = list(range(len(profiles)))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(profiles) + 3), 4))
    ax.plot(x, [p["value"] for p in profiles], marker="o", label="measured (95% interval)")
    ax.fill_between(x, [p["low"] for p in profiles], [p["high"] for p in profiles], alpha=0.2)
    ax.plot(x, [p["valid_only"] for p in profiles], marker=".", linestyle=":", label="valid moves only")
    for name, value in report["references"].items():
        if value is not None and name != "Nash equilibrium":
            ax.axhline(value, linestyle="--", linewidth=0.8, color="gray")
            ax.annotate(f"{name} {value:.3f}", (0, value), fontsize=7, color="gray", va="bottom")
    ax.set_xticks(x, labels, rotation=30 if len(profiles) > 6 else 0, fontsize=8)
    ax.set_xlabel("checkpoints (" + ", ".join(profiles[0]["checkpoints"]) + ")" if profiles else "profile")
    ax.set_ylabel("exploitability (NashConv / 2)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{report['game']}: how much a best response wins a game")
    ax.legend(fontsize="small")
    return _save(fig, Path(path))
