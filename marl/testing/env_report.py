"""What `marl check-env` found per role: the games the coordinator recorded beside the samples the server's ledger
holds, each role's tallies, the problems that fail the check and the warnings that do not.

A game's `GameRecord` says which episode the server recorded it under and what the env paid each role
(`role_rewards`, from `outcome_by_role()`); the ledger's samples say what the server merged under each role's agent
tag, and with which reward. The two must agree: every role a sample in every game's episode, at the env's reward.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from marl.games.record import GameRecord

#: how far a sample's reward may be from the env's (it crossed JSON and SQLite as a float)
REWARD_TOLERANCE = 1e-6


class LedgerSample(Protocol):
    """What the check reads of a ledger sample (`servers.episodes.samples.Sample` has it)."""

    episode_id: str
    agent: str  # the role: the coordinator tags each seat's calls with the role it plays
    reward: float
    num_calls: int
    token_ids: Sequence[int]
    loss_mask: Sequence[int]


@dataclass
class RoleTally:
    role: str
    agents: int  # agents dealt the role in every game
    games: int = 0
    episodes: set[str] = field(default_factory=set)  # the server episodes holding a sample of the role
    samples: int = 0
    calls: int = 0
    tokens: int = 0
    generated: int = 0  # tokens the model wrote (loss mask 1): what training learns from
    rewards: list[float] = field(default_factory=list)  # the env's reward for the role, one per game
    replies: int = 0
    invalid: int = 0
    unrewarded: int = 0  # games whose outcome_by_role() had no reward for the role
    missing: int = 0  # games whose episode holds no sample of the role
    wrong_reward: int = 0  # samples whose reward is not the env's reward for the role in their game
    unmerged: int = 0  # games with more samples of the role than agents dealt it


def tally_roles(records: Iterable[GameRecord], samples: Iterable[LedgerSample], roles: Mapping[str, int],
                server: str) -> dict[str, RoleTally]:
    """Per role (`roles`: role -> agents dealt it), what the games of `records` played on `server` left in its
    ledger (`samples`)."""
    by_episode: dict[str, dict[str, list[LedgerSample]]] = {}
    for sample in samples:
        by_episode.setdefault(sample.episode_id, {}).setdefault(sample.agent, []).append(sample)
    tallies = {role: RoleTally(role, agents) for role, agents in roles.items()}
    for record in records:
        episode = record.episodes.get(server, "")
        for role, tally in tallies.items():
            _tally_game(tally, record, episode, by_episode.get(episode, {}).get(role, []))
    return tallies


def _tally_game(tally: RoleTally, record: GameRecord, episode: str, samples: list[LedgerSample]) -> None:
    tally.games += 1
    tally.replies += record.replies.get(tally.role, 0)
    tally.invalid += record.invalid_actions.get(tally.role, 0)
    reward = record.role_rewards.get(tally.role)
    if reward is None:
        tally.unrewarded += 1
    else:
        tally.rewards.append(reward)
    if not samples:
        tally.missing += 1
        return
    tally.episodes.add(episode)
    tally.samples += len(samples)
    tally.unmerged += len(samples) > tally.agents
    for sample in samples:
        tally.calls += sample.num_calls
        tally.tokens += len(sample.token_ids)
        tally.generated += sum(sample.loss_mask)
        if reward is not None and not math.isclose(sample.reward, reward, abs_tol=REWARD_TOLERANCE):
            tally.wrong_reward += 1


def role_line(tally: RoleTally) -> str:
    """One role's tallies on one line."""
    rewards = tally.rewards
    if not rewards:
        paid = "no reward"
    elif max(rewards) - min(rewards) <= REWARD_TOLERANCE:
        paid = f"reward {rewards[0]:g} every game"
    else:
        paid = f"reward {min(rewards):g} to {max(rewards):g} (mean {sum(rewards) / len(rewards):.3g})"
    return (f"role {tally.role}: {tally.games} games, {len(tally.episodes)} episodes, {tally.samples} samples,"
            f" {tally.calls} calls, {tally.tokens} tokens ({tally.generated} generated), {paid},"
            f" invalid replies {tally.invalid}/{tally.replies}")


def role_problems(tally: RoleTally) -> list[str]:
    """What fails the check for this role: a reward that never reached it, episodes the server did not record,
    samples at another reward than the env's."""
    role, games, found = tally.role, tally.games, []
    if tally.unrewarded:
        found.append(f"role {role}: the env's outcome_by_role() had no reward for it in {tally.unrewarded} of"
                     f" {games} games, so its samples were paid the episode's reward instead of its own")
    if tally.missing:
        found.append(f"role {role}: the server recorded no sample of it in {tally.missing} of {games} games")
    if tally.wrong_reward:
        found.append(f"role {role}: {tally.wrong_reward} of its samples carry another reward than the env paid it")
    return found


def warnings_of(tallies: Mapping[str, RoleTally]) -> list[str]:
    """What looks wrong but may be the tiny model's doing or too few games: a role that never had a turn, rewards
    that never varied, turns that did not merge into one conversation per agent."""
    found = []
    for tally in tallies.values():
        if tally.games and not tally.calls:
            found.append(f"role {tally.role}: its model was never called in {tally.games} games, so there is nothing"
                         " to train it on: do its agents get a turn? (the other side's invalid replies may have ended"
                         " every game first: play more --games)")
        if tally.unmerged:
            found.append(f"role {tally.role}: {tally.unmerged} games left more samples than its {tally.agents}"
                         " agents: their turns did not merge into one conversation per agent (`marl episode show`"
                         " shows each sample: keep --run-dir)")
    flat = {t.role: t.rewards[0] for t in tallies.values()
            if len(t.rewards) > 1 and max(t.rewards) - min(t.rewards) <= REWARD_TOLERANCE}
    if flat:
        found.append(f"the reward never varied for {', '.join(f'{role} ({r:g})' for role, r in flat.items())}: GRPO"
                     " learns nothing from a reward that never varies; with the tiny model's random replies that may"
                     " be chance (play more --games), else check that the env pays these roles")
    return found
