"""Scripted Werewolves players: simple rules over what each player may know (`Werewolves.scripted_action`).

Seer: checks unchecked players; by day names a werewolf it found ("I am the seer: Player 4 is a werewolf."), and in
its last words all it found. Village: votes for the latest suspect (a player publicly called a werewolf, or who
voted against a claimed seer), else nobody. Werewolves: attack what tonight's first werewolf proposed; attack and
vote for a claimed seer or a player who accused a werewolf, else a random non-werewolf. Witch: saves the attacked
player while she can, else poisons a suspect. Hunter: shoots a suspect, else nobody.

What every player heard (accusations, seer claims, the revealed day votes) is read from the game master's log, so a
scripted player uses only public speech, its own role's knowledge and the game's own coin (`rng`).
"""

from __future__ import annotations

import random
import re

from envs.base import InvalidAction
from envs.werewolves_replies import pick
from envs.werewolves_rules import NOBODY, SEER, WEREWOLF, WerewolvesGame
from envs.werewolves_text import label

_ACCUSATION = re.compile(r"\bplayer (\d) is a werewolf\b", re.IGNORECASE)
_SEER_CLAIM = re.compile(r"\bi (?:am|was) the seer\b", re.IGNORECASE)


class ScriptedPlayers:
    """The scripted replies of one game: `action(agent, kind)` is `agent`'s reply on its turn of this kind."""

    def __init__(self, game: WerewolvesGame, rng: random.Random):
        self.game, self.rng = game, rng

    def action(self, agent: str, kind: str) -> str:
        return getattr(self, f"_{kind}")(agent)

    # --- what everyone heard ------------------------------------------------------------------------------------

    def _public_claims(self) -> tuple[list[tuple[str, str]], list[str]]:
        """(accuser, accused) pairs in the order they were made public, and the players who claimed to be the seer.

        An accusation is "Player N is a werewolf" in a speech or last words, or a vote against a claimed seer (known
        once the day's votes are revealed), which counts as the claimed seer accusing the voter."""
        accusations: list[tuple[str, str]] = []
        claims: list[str] = []
        votes: list[tuple[str, str | None]] = []  # today's, revealed at the verdict
        for event in self.game.events:
            if event["type"] in ("speech", "last_words"):
                accusations += [(event["actor"], f"player_{n}") for n in _ACCUSATION.findall(event["text"])]
                if _SEER_CLAIM.search(event["text"]):
                    claims.append(event["actor"])
            elif event["type"] == "vote":
                votes.append((event["actor"], event["target"]))
            elif event["type"] == "voted_out":
                accusations += [(target, voter) for voter, target in votes if target in claims]  # seer's word
                votes = []
        return accusations, claims

    def _accused(self, agent: str) -> list[str]:
        """Living players other than `agent` publicly called a werewolf or who voted against a claimed seer, the
        latest first."""
        seen = []
        for _, accused in reversed(self._public_claims()[0]):
            if accused in self.game.alive and accused != agent and accused not in seen:
                seen.append(accused)
        return seen

    def _found_wolves(self) -> list[str]:
        return [a for a in self.game.alive if self.game.checks.get(a)]

    def _wolf_target(self, agent: str) -> str:
        """Tonight's werewolf plan: the first attack proposed in tonight's talk, else a threat, else at random."""
        targets = self.game.targets(agent, "wolf_vote")
        for event in self.game.events:
            if event["type"] == "wolf_speech" and event["round"] == self.game.round:
                try:
                    proposal = pick(event["text"], nobody=False)
                except InvalidAction:  # a message naming several players: no clear proposal
                    proposal = None
                if proposal in targets:
                    return proposal
        return self._wolf_threat(targets) or self.rng.choice(targets)

    def _wolf_threat(self, targets: list[str]) -> str | None:
        """A living claimed seer, else a living player who accused a werewolf."""
        accusations, claims = self._public_claims()
        threats = claims + [s for s, a in accusations if self.game.roles[a] == WEREWOLF]
        return next((a for a in threats if a in targets and self.game.roles[a] != WEREWOLF), None)

    # --- one method a kind of turn ------------------------------------------------------------------------------

    def _wolf_speech(self, agent: str) -> str:
        return f"Let us attack {label(self._wolf_target(agent))}."

    def _wolf_vote(self, agent: str) -> str:
        return label(self._wolf_target(agent))

    def _witch(self, agent: str) -> str:
        if self.game.can_save(agent) is None:
            return f"save {label(self.game.victim)}"
        accused = self._accused(agent)
        if not self.game.poison_used and accused:
            return f"poison {label(accused[0])}"
        return "pass"

    def _seer(self, agent: str) -> str:
        targets = self.game.targets(agent, "seer")
        unchecked = [a for a in targets if a not in self.game.checks]
        return label(self.rng.choice(unchecked or targets))

    def _hunter(self, agent: str) -> str:
        accused = self._accused(agent)
        return label(accused[0]) if accused else NOBODY

    def _speech(self, agent: str) -> str:
        role = self.game.roles[agent]
        if role == SEER and self._found_wolves():
            return f"I am the seer: {label(self._found_wolves()[0])} is a werewolf."
        accused = self._accused(agent)
        if role != WEREWOLF and accused:
            return f"I will vote for {label(accused[0])}."
        return "I have nothing to report yet."

    def _last_words(self, agent: str) -> str:
        if self.game.roles[agent] == SEER:
            found = " ".join(f"{label(a)} is a werewolf." for a in self._found_wolves())
            return f"I was the seer. {found or 'I found no werewolf.'}"
        return "Good luck, everyone."

    def _vote(self, agent: str) -> str:
        role, others = self.game.roles[agent], self.game.targets(agent, "vote")
        if role == WEREWOLF:
            choice = self._wolf_threat(others) or self.rng.choice(
                [a for a in others if self.game.roles[a] != WEREWOLF])
        elif role == SEER:
            found = self._found_wolves()
            choice = found[0] if found else NOBODY
        else:
            accused = self._accused(agent)
            choice = accused[0] if accused else NOBODY
        return label(choice) if choice != NOBODY else NOBODY
