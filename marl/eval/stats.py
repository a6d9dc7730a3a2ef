"""Evaluation statistics: win rates with Wilson score intervals, mean rewards with Student-t intervals.

A role *wins* a game by the first rule the game's record allows (`win_rule`; the table says which it used):
1. `winner`: its team is the game's recorded winner (Werewolves: "village", "werewolves" or "draw");
2. `goal`: the env said whether the role's goal was met (`TextAECEnv.goal_met`; the signalling game: the team's
   goal is the listener picking the target, so a speaker does not "win" on a shaping bonus alone);
3. `reward`: neither (an older row, or an env that says nothing): its reward was positive.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist

from marl.games.record import GameRecord

CONFIDENCE = 0.95
_LARGE_DF = 1000  # beyond this many degrees of freedom the t quantile is the normal one to 3 decimals


def z_value(confidence: float = CONFIDENCE) -> float:
    """The two-sided normal quantile: 1.96 for 95%."""
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: int, trials: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (NaN, NaN without trials). Unlike p ± z·sqrt(p(1-p)/n) it
    stays inside [0, 1] and does not collapse to a point at 0/n or n/n: the honest interval for 8 or 16 games."""
    if trials <= 0:
        return math.nan, math.nan
    z, p = z_value(confidence), successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return max(0.0, centre - half), min(1.0, centre + half)


def t_within(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with `df` (a positive integer) degrees of freedom, in closed form (Abramowitz
    and Stegun 26.7.3 and 26.7.4): a finite series in cos(theta), theta = atan(t / sqrt(df))."""
    theta = math.atan(t / math.sqrt(df))
    cos2, sin = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 0:  # sin(theta) * (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), df / 2 terms
        term = total = 1.0
        for k in range(2, df, 2):
            term *= cos2 * (k - 1) / k
            total += term
        return sin * total
    if df == 1:
        return 2 * theta / math.pi
    term = total = 1.0  # 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)), (df - 1) / 2 terms
    for k in range(3, df - 1, 2):
        term *= cos2 * (k - 1) / k
        total += term
    return 2 / math.pi * (theta + sin * math.cos(theta) * total)


def t_value(df: int, confidence: float = CONFIDENCE) -> float:
    """The two-sided Student-t quantile: 12.706 for df=1, 2.262 for df=9 at 95% (bisection on `t_within`)."""
    if df >= _LARGE_DF:
        return z_value(confidence)
    low, high = 0.0, 1e6
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if t_within(middle, df) < confidence else (low, middle)
    return (low + high) / 2


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(mean, low, high): the mean ± t·s/sqrt(n) (NaN bounds for fewer than 2 values; NaNs for none)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_value(n - 1, confidence) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


#: what each rule counts as a win, as the table prints it
WIN_RULES = {
    "winner": "its team is the game's recorded winner",
    "goal": "its goal was met, as the env defines it (a shaping bonus is no win)",
    "reward": "its reward was positive (the env records no winner and no goals)",
}


def win_rule(game: GameRecord, role: str) -> str:
    """Which rule decides whether `role` won `game` (a key of `WIN_RULES`; see the module docstring)."""
    if game.winner is not None and role in game.teams:
        return "winner"
    return "goal" if role in game.goals else "reward"


def role_won(game: GameRecord, role: str) -> bool:
    """Whether `role` won `game`, by `win_rule`."""
    rule = win_rule(game, role)
    if rule == "winner":
        return game.teams[role] == game.winner
    return game.goals[role] if rule == "goal" else game.role_rewards.get(role, 0.0) > 0


@dataclass(frozen=True)
class RoleStats:
    """One role over a set of games; intervals at `CONFIDENCE`."""

    games: int
    wins: int
    win_rate: float
    win_low: float
    win_high: float
    mean_reward: float
    reward_low: float
    reward_high: float
    valid_reply_rate: float  # 1 - invalid replies / replies (NaN: no replies)
    win_rule: str = ""  # the `WIN_RULES` key of its games ("mixed" when they differ)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def as_json(self) -> dict[str, float | None]:
        """`as_dict` with NaN as None: strict JSON."""
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(self).items()}


def role_stats(games: Iterable[GameRecord], role: str) -> RoleStats:
    played = [g for g in games if role in g.role_rewards]
    wins = sum(role_won(g, role) for g in played)
    replies = sum(g.replies.get(role, 0) for g in played)
    invalid = sum(g.invalid_actions.get(role, 0) for g in played)
    win_low, win_high = wilson_interval(wins, len(played))
    mean, low, high = mean_interval([g.role_rewards[role] for g in played])
    rules = {win_rule(g, role) for g in played}
    return RoleStats(games=len(played), wins=wins, win_rate=wins / len(played) if played else math.nan,
                     win_low=win_low, win_high=win_high, mean_reward=mean, reward_low=low, reward_high=high,
                     valid_reply_rate=1 - invalid / replies if replies else math.nan,
                     win_rule=rules.pop() if len(rules) == 1 else "mixed" if rules else "")


def summarize(games: Sequence[GameRecord]) -> dict[str, RoleStats]:
    """Every role's `RoleStats`, roles in name order."""
    return {role: role_stats(games, role) for role in sorted({r for g in games for r in g.role_rewards})}
