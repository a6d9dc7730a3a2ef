"""`WerewolvesGame`: the rules of one Werewolves game as a state machine, with no text and no PettingZoo.

It holds who is what and who lives, the stage of the round (`STAGES`, one `_start_<stage>` each), the queue of turns
to play in this stage, the werewolves' and the village's votes, the witch's potions, the seer's checks, the deaths
and the win check; `play(agent, action)` applies one parsed action and starts stages until someone has a turn or
the game is over (`winner` set). The full rules are in `envs/werewolves.py`'s docstring.

Everything that happens is logged in `events` (the game master's log) and passed to a `Narrator`, which decides who
hears about it (`envs/werewolves_text.py`: the news each player is told); the narrator also hears each stage start,
before the stage is set up. The env (`envs.werewolves.Werewolves`) turns the game into a PettingZoo AEC env: it
parses replies (`envs/werewolves_replies.py`), asks the questions and hands out the rewards.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

WEREWOLF, VILLAGER, SEER, WITCH, HUNTER = "werewolf", "villager", "seer", "witch", "hunter"
ROLES = (WEREWOLF,) * 3 + (VILLAGER,) * 3 + (SEER, WITCH, HUNTER)
NUM_PLAYERS = len(ROLES)
NOBODY = "nobody"
#: The stages of a round, in order; `_start_<stage>` sets each one up.
STAGES = ("wolf_talk", "wolf_vote", "witch", "seer", "dawn", "day_talk", "day_vote", "verdict")
NIGHT_STAGES = frozenset(STAGES[:4])
SPEECH_TURNS = frozenset({"wolf_speech", "speech", "last_words"})
#: Upper bound of the turns in one round (8 at night, at most 25 by day); `max_steps` is a safety net above it.
MAX_TURNS_PER_ROUND = 40

_SEATS = {f"player_{n}": n for n in range(1, NUM_PLAYERS + 1)}


def team(role: str) -> str:
    """The team of a role: "werewolves" or "village"."""
    return "werewolves" if role == WEREWOLF else "village"


def seat(agent: str) -> int:
    """"player_3" -> 3."""
    return _SEATS[agent]


class Narrator(Protocol):
    """Who the game tells what happened: each logged event as it is logged, and each stage as it starts."""

    def logged(self, game: WerewolvesGame, event: dict[str, Any]) -> None: ...
    def stage_started(self, game: WerewolvesGame, stage: str) -> None: ...


class WerewolvesGame:
    """One game's state and rules. `roles` maps every agent, in seat order, to its role (the env deals them)."""

    def __init__(self, roles: dict[str, str], max_rounds: int, narrator: Narrator):
        self.roles, self.max_rounds, self.narrator = roles, max_rounds, narrator
        self.alive = list(roles)  # seat order
        self.round, self.stage = 1, ""
        self.events: list[dict[str, Any]] = []
        self.winner: str | None = None
        self.save_used = self.poison_used = False
        self.victim: str | None = None  # tonight's: attacked, saved, poisoned
        self.saved: str | None = None
        self.poisoned: str | None = None
        self.checks: dict[str, bool] = {}  # the seer's results: player -> is a werewolf
        self.wolf_votes: dict[str, str] = {}
        self.votes: dict[str, str] = {}
        self.queue: list[tuple[str, str]] = []  # the turns to play in this stage: (agent, kind)

    # --- who may do what ----------------------------------------------------------------------------------------

    def wolves(self) -> list[str]:
        """The living werewolves, in seat order."""
        return [a for a in self.alive if self.roles[a] == WEREWOLF]

    def alive_with(self, role: str) -> str | None:
        return next((a for a in self.alive if self.roles[a] == role), None)

    def turn_of(self, agent: str) -> str | None:
        """The kind of turn `agent` has now (wolf_speech, wolf_vote, witch, seer, last_words, hunter, speech,
        vote), or None."""
        if self.winner is None and self.queue and self.queue[0][0] == agent:
            return self.queue[0][1]
        return None

    def targets(self, agent: str, kind: str) -> list[str]:
        """The players `agent` may pick on a choice turn (agent ids, seat order)."""
        if kind == "wolf_vote":
            return [a for a in self.alive if self.roles[a] != WEREWOLF]
        return [a for a in self.alive if a != agent]  # seer, vote, hunter

    def witch_options(self, agent: str) -> list[tuple[str, str | None]]:
        """What the witch may do now: ("save", victim), ("poison", player) for each other living player, ("pass",
        None)."""
        options: list[tuple[str, str | None]] = []
        if self.can_save(agent) is None:
            options.append(("save", self.victim))
        if not self.poison_used:
            options += [("poison", a) for a in self.alive if a != agent]
        return [*options, ("pass", None)]

    def can_save(self, agent: str) -> str | None:
        """Why the witch cannot save now, or None if she can."""
        if self.save_used:
            return "the save potion is used up"
        if self.victim is None:
            return "nobody was attacked tonight"
        if self.victim == agent:
            return "you cannot save yourself"
        return None

    def night_deaths(self) -> dict[str, str]:
        """Who dies at dawn, in seat order, and why: "werewolves" (attacked, not saved) or "poison"."""
        causes = {}
        if self.victim and self.victim != self.saved:
            causes[self.victim] = "werewolves"
        if self.poisoned:
            causes[self.poisoned] = "poison"  # poison wins: a poisoned hunter never shoots
        return {agent: causes[agent] for agent in sorted(causes, key=seat)}

    # --- playing a turn -----------------------------------------------------------------------------------------

    def play(self, agent: str, action: Any) -> None:
        """Apply `agent`'s parsed action on its turn, then start stages until someone has a turn or the game ends."""
        _, kind = self.queue.pop(0)
        getattr(self, f"_do_{kind}")(agent, action)
        self.advance()

    def _do_wolf_speech(self, agent: str, text: str) -> None:
        self._log("wolf_speech", agent, text=text)

    def _do_wolf_vote(self, agent: str, target: str) -> None:
        self.wolf_votes[agent] = target
        self._log("wolf_vote", agent, target)

    def _do_witch(self, agent: str, action: tuple[str, str | None]) -> None:
        what, target = action
        if what == "save":
            self.save_used, self.saved = True, target
        elif what == "poison":
            self.poison_used, self.poisoned = True, target
        self._log(what, agent, target)

    def _do_seer(self, agent: str, target: str) -> None:
        if target == NOBODY:
            self._log("check", agent, None)
            return
        self.checks[target] = self.roles[target] == WEREWOLF
        self._log("check", agent, target, result="werewolf" if self.checks[target] else "village")

    def _do_speech(self, agent: str, text: str) -> None:
        self._log("speech", agent, text=text)

    def _do_last_words(self, agent: str, text: str) -> None:
        self._log("last_words", agent, text=text)

    def _do_vote(self, agent: str, target: str) -> None:
        self.votes[agent] = target
        self._log("vote", agent, target)

    def _do_hunter(self, agent: str, target: str) -> None:
        self._log("shoot", agent, target)
        if target != NOBODY:
            self._kill({target: "shot"})
            self.queue.insert(0, (target, "last_words"))

    # --- stages -------------------------------------------------------------------------------------------------

    def advance(self) -> None:
        """Start stages until one has a turn to play, or the game is over."""
        while self.winner is None and not self.queue:
            if self.stage == STAGES[-1]:
                if self.round == self.max_rounds:
                    self.winner = "draw"
                    break
                self.round += 1
            self.stage = STAGES[(STAGES.index(self.stage) + 1) % len(STAGES)] if self.stage else STAGES[0]
            self.narrator.stage_started(self, self.stage)
            getattr(self, f"_start_{self.stage}")()
        if self.winner is not None:
            self.queue.clear()
            self._log("game_over", winner=self.winner)

    def _start_wolf_talk(self) -> None:
        self.victim = self.saved = self.poisoned = None
        self.wolf_votes = {}
        if len(self.wolves()) >= 2:
            self.queue = [(a, "wolf_speech") for a in self.wolves()]

    def _start_wolf_vote(self) -> None:
        self.queue = [(a, "wolf_vote") for a in self.wolves()]

    def _start_witch(self) -> None:
        votes = Counter(t for t in self.wolf_votes.values() if t != NOBODY)
        if votes:
            most = max(votes.values())
            self.victim = min((t for t, n in votes.items() if n == most), key=seat)
        self._log("attack", None, self.victim, votes=dict(self.wolf_votes))
        witch = self.alive_with(WITCH)
        if witch and not (self.save_used and self.poison_used):
            self.queue = [(witch, "witch")]

    def _start_seer(self) -> None:
        seer = self.alive_with(SEER)
        if seer:
            self.queue = [(seer, "seer")]

    def _start_dawn(self) -> None:
        causes = self.night_deaths()
        self._kill(causes)
        for agent, cause in causes.items():
            self.queue.append((agent, "last_words"))
            if self.roles[agent] == HUNTER and cause == "werewolves":
                self.queue.append((agent, "hunter"))

    def _start_day_talk(self) -> None:
        self.queue = [(a, "speech") for a in self.alive]

    def _start_day_vote(self) -> None:
        self.votes = {}
        self.queue = [(a, "vote") for a in self.alive]

    def _start_verdict(self) -> None:
        tally = Counter(self.votes.values())
        most = max(tally.values())
        leaders = [t for t, n in tally.items() if n == most]
        out = leaders[0] if len(leaders) == 1 and leaders[0] != NOBODY else None
        self._log("voted_out", None, out, tally=dict(tally))
        if out:
            self._kill({out: "vote"})
            self.queue = [(out, "last_words")] + ([(out, "hunter")] if self.roles[out] == HUNTER else [])

    def _kill(self, causes: dict[str, str]) -> None:
        """The players in `causes` die together; then the win conditions are checked."""
        for agent, cause in causes.items():
            self.alive.remove(agent)
            self._log("death", None, agent, cause=cause)
        wolves = len(self.wolves())
        if wolves == 0:
            self.winner = "village"
        elif wolves >= len(self.alive) - wolves:
            self.winner = "werewolves"

    def _log(self, kind: str, actor: str | None = None, target: str | None = None, **extra: Any) -> None:
        phase = "night" if self.stage in NIGHT_STAGES else "day"
        event = {"round": self.round, "phase": phase, "type": kind, "actor": actor,
                 "target": None if target == NOBODY else target, **extra}
        self.events.append(event)
        self.narrator.logged(self, event)
