"""`Werewolves`: 9 players; 3 werewolves hide among a village of 3 villagers, a seer, a witch and a hunter.

The rules
---------
Players.  Agents player_1 ... player_9 sit in that order; seat N is called "Player N" in every text. At reset the
roles are dealt from the reset seed (the same seed deals the same roles): 3 werewolves (team "werewolves") and
3 villagers, 1 seer, 1 witch, 1 hunter (team "village"). The werewolves know each other. Nobody else learns a role
from the game master, except what the seer checks; roles are never revealed, not at death, not at the end.

A round is a night, then a day (round 1 = night 1 and day 1).

Night
1. Werewolf talk: if two or more werewolves live, each living werewolf in seat order says one message that only the
   living werewolves hear.
2. Werewolf vote: each living werewolf in seat order votes for a living non-werewolf; the werewolves see each
   other's votes. The player with the most votes is attacked; a tie goes to the lowest seat among the tied; if no
   werewolf voted (all fell back), nobody is attacked.
3. Witch, if alive and a potion is left: she is told whom the werewolves attacked and does ONE of: save that player
   (the save potion: once per game, never herself), poison one living player other than herself (the poison: once
   per game), or pass.
4. Seer, if alive: checks one living player other than herself and privately learns whether it is a werewolf.

Day
5. Dawn: the attacked player (unless saved) and the poisoned player die together; everyone hears who died, not how
   or what role they had. The dead give last words, in seat order. A hunter killed by the werewolves (not poisoned)
   then shoots one living player or nobody; a shot is announced (so all learn who the hunter was) and the shot
   player dies at once and gives last words.
6. Discussion: every living player speaks once, in seat order; everyone hears it.
7. Vote: every living player votes for another living player or "nobody"; the votes are revealed when all have
   voted. The option with the most votes wins ("nobody" is an option like a player); on a tie for the most votes
   nobody is voted out. The voted-out player gives last words; a voted-out hunter then shoots (as at dawn).

End.  After every death (the deaths at dawn count as one, applied together) the village wins if no werewolf lives;
otherwise the werewolves win if the living werewolves are at least as many as the other living players. The game
ends at once, with no more turns. A game still undecided after `max_rounds` rounds (default 10) is a draw.

Rewards, at the end only, for every player alive or dead: 1.0 if its team won, 0.0 if it lost, `draw_reward`
(default 0.0: nobody reached its goal) on a draw. Optional shaping, off by default: `valid_action_bonus=b` adds
b * (the fraction of the agent's turns answered validly at the first try; 0 for an agent that had no turn).

Speech and choices
------------------
Speech turns (werewolf talk, discussion, last words) take free text: whitespace is collapsed to one line, double
quotes become single ones, at most 80 words are kept; an empty reply is invalid. Choice turns list their options
unnumbered ("- Player 3", `number_options = False`); a reply names a player by number in any common form ("3",
"Player 3", "player_3", "P3", "#3", "I vote for player 3"); "nobody", "no one", "none", "abstain", "skip" and "pass"
mean nobody where that is an option. A reply naming several players picks the first one that follows a verb ("vote
for", "check", "attack", "shoot", ...), else the one it starts with; otherwise it is invalid. The witch replies "save",
"poison Player N" or "pass". An invalid reply is asked again (`max_invalid_retries`), then falls back to: silence
(speech), no vote (werewolf vote), "nobody" (day vote), checking nobody (seer), pass (witch), shooting nobody
(hunter).

Observations are news: each turn an agent is told what happened since its own last turn (the news is delivered
when its action is applied, so a retry after an invalid reply shows the same news again), then the question and
its options. Werewolf-only lines start with "[werewolves only]".

`self.events` is the game master's log: dicts with round, phase ("night"/"day"), type, actor, target and extras.
Types: wolf_speech, wolf_vote, attack (the werewolves' victim), save, poison, pass (the witch), check (with the
result "werewolf"/"village"), death (with the cause "werewolves", "poison", "vote" or "shot"), last_words, shoot,
speech, vote, voted_out (with the tally), game_over (with the winner). A target of None means nobody.
`self.winner` is "werewolves", "village" or "draw" at the end (None before); `infos[agent]["winner"]` too.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from typing import Any, ClassVar

from envs.base import InvalidAction, RoleInfo, TextAECEnv, printable

WEREWOLF, VILLAGER, SEER, WITCH, HUNTER = "werewolf", "villager", "seer", "witch", "hunter"
ROLES = (WEREWOLF,) * 3 + (VILLAGER,) * 3 + (SEER, WITCH, HUNTER)
NUM_PLAYERS = len(ROLES)
MAX_SPEECH_WORDS = 80
NOBODY = "nobody"
#: The stages of a round, in order; `_start_<stage>` sets each one up.
STAGES = ("wolf_talk", "wolf_vote", "witch", "seer", "dawn", "day_talk", "day_vote", "verdict")
NIGHT_STAGES = frozenset(STAGES[:4])
SPEECH_TURNS = frozenset({"wolf_speech", "speech", "last_words"})
#: Upper bound of the turns in one round (8 at night, at most 25 by day); `max_steps` is a safety net above it.
MAX_TURNS_PER_ROUND = 40

ROLE_HELP = {
    WEREWOLF: "At night you talk privately with the other werewolves and vote whom to attack. By day, hide what you "
              "are and get village players voted out.",
    VILLAGER: "You have no special power: listen, find the werewolves and vote them out.",
    SEER: "Each night you check one player and learn whether it is a werewolf. Only you learn it.",
    WITCH: "You have two potions, each usable once: the save potion (at night you learn whom the werewolves attacked "
           "and may save that player, but not yourself) and the poison (kill one player). At most one per night.",
    HUNTER: "If you die, except by poison, you may shoot one living player, who dies too.",
}

# A seat: "3", "Player 3", "player_3", "P3", "#3", "seat 3"; or a word for nobody.
_MENTION = re.compile(r"(?<![\w#])(?:(?:player|seat)[\s_#.:-]*|p|#)?(\d{1,2})(?!\w)"
                      r"|\b(nobody|no one|noone|none|abstain|skip|pass)\b")
_VERB_BEFORE = re.compile(r"\b(?:vote|check|attack|kill|eliminate|shoot|poison|save|choose|pick|select|target)\w*"
                          r"[\s:]+(?:for\s+|on\s+|against\s+)?$")
_WITCH_WORDS = {"save": re.compile(r"\b(?:sav(?:e|es|ed|ing)|heal\w*|rescue\w*|antidote)\b"),
                "poison": re.compile(r"\bpoison\w*"),
                "pass": re.compile(r"\b(?:pass|nothing|skip|no action)\b")}
_ACCUSATION = re.compile(r"\bplayer (\d) is a werewolf\b", re.IGNORECASE)
_SEER_CLAIM = re.compile(r"\bi (?:am|was) the seer\b", re.IGNORECASE)
_LEADING = " \t\n\"'*([-:>`"


_DEATH_CAUSES = {"werewolves": "attacked by the werewolves", "poison": "poisoned", "vote": "voted out",
                 "shot": "shot by the hunter"}
_SEATS = {f"player_{n}": n for n in range(1, NUM_PLAYERS + 1)}
_LABELS = {agent: f"Player {n}" for agent, n in _SEATS.items()}


def _team(role: str) -> str:
    return "werewolves" if role == WEREWOLF else "village"


def label(agent: str) -> str:
    """"player_3" -> "Player 3"."""
    return _LABELS[agent]


def seat(agent: str) -> int:
    """"player_3" -> 3."""
    return _SEATS[agent]


def mentions(text: str, *, nobody: bool) -> list[tuple[int, str]]:
    """The players (agent ids) and, if `nobody`, the words for nobody (NOBODY) that `text` names: (position, value)."""
    found = []
    for match in _MENTION.finditer(text.lower()):
        if match.group(1) and 1 <= int(match.group(1)) <= NUM_PLAYERS:
            found.append((match.start(), f"player_{int(match.group(1))}"))
        elif match.group(2) and nobody:
            found.append((match.start(), NOBODY))
    return found


def pick(text: str, *, nobody: bool) -> str | None:
    """The one player (or NOBODY) a reply picks; None if it names none; InvalidAction if it is ambiguous.

    One value named (maybe several times): that one. Several: the first that follows a verb ("Player 5 is fine, I
    vote for Player 3"), else the one the reply starts with ("Player 3, because Player 5 trusts him").
    """
    text = printable(text).lower()
    found = mentions(text, nobody=nobody)
    if not found:
        return None
    if len({value for _, value in found}) == 1:
        return found[0][1]
    for start, value in found:
        if _VERB_BEFORE.search(text, 0, start):
            return value
    if found[0][0] == len(text) - len(text.lstrip(_LEADING)):
        return found[0][1]
    raise InvalidAction("name exactly one player" + (' or "nobody"' if nobody else ""))


class Werewolves(TextAECEnv):
    metadata: ClassVar[dict[str, Any]] = {"name": "werewolves_v0", "render_modes": ["human", "ansi"],
                                          "is_parallelizable": False}
    possible_agents: ClassVar[list[str]] = [f"player_{i}" for i in range(1, NUM_PLAYERS + 1)]
    number_options = False  # options are players: a bare number is a seat, not an option's index

    def __init__(self, max_rounds: int = 10, draw_reward: float = 0.0, valid_action_bonus: float = 0.0,
                 render_mode: str | None = None):
        if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
            raise ValueError(f"max_rounds must be an integer of 1 or more; got {max_rounds!r}")
        if not 0.0 <= draw_reward <= 1.0:
            raise ValueError(f"draw_reward must be between 0.0 (a loss) and 1.0 (a win); got {draw_reward!r}")
        if not valid_action_bonus >= 0.0:
            raise ValueError(f"valid_action_bonus must be 0.0 or more; got {valid_action_bonus!r}")
        super().__init__(render_mode=render_mode)
        self.max_rounds, self.draw_reward = max_rounds, float(draw_reward)
        self.valid_action_bonus = float(valid_action_bonus)
        self.max_steps = MAX_TURNS_PER_ROUND * max_rounds
        self.roles: dict[str, str] = {}
        self.events: list[dict[str, Any]] = []
        self.winner: str | None = None
        self._queue: list[tuple[str, str]] = []  # the turns to play in this stage: (agent, kind)

    # --- roles --------------------------------------------------------------------------------------------------

    def role_of(self, agent: str) -> str:
        if not self.roles:
            raise RuntimeError("roles are dealt at reset(): call reset() first")
        return self.roles[agent]

    def team_of(self, agent: str) -> str:
        return _team(self.role_of(agent))

    def dealt_roles(self) -> dict[str, RoleInfo]:
        """Every game deals the same roles (to seats chosen by the game's seed)."""
        return {role: RoleInfo(team=_team(role), count=ROLES.count(role)) for role in dict.fromkeys(ROLES)}

    def wolves(self) -> list[str]:
        """The living werewolves, in seat order."""
        return [a for a in self.alive if self.roles[a] == WEREWOLF]

    def _alive_with(self, role: str) -> str | None:
        return next((a for a in self.alive if self.roles[a] == role), None)

    def system_prompt(self, agent: str) -> str:
        role = self.role_of(agent)
        article = "a" if role in (WEREWOLF, VILLAGER) else "the"
        return (f"You are {label(agent)} in a game of Werewolves with 9 players (Player 1 to Player 9): 3 werewolves, "
                "3 villagers, a seer, a witch and a hunter. Each night the werewolves secretly attack a player; each "
                "day everyone talks, then votes a player out. The village wins when every werewolf is dead; the "
                "werewolves win when they are at least as many as the other living players.\n"
                f"You are {article} {role} (team: {self.team_of(agent)}). {ROLE_HELP[role]}\n"
                "Each message tells you what happened since your last turn. When asked to speak, reply with one "
                "short message. When asked to choose, reply with your choice only, e.g. a player's number.")

    # --- game state ---------------------------------------------------------------------------------------------

    def _reset_game(self, seed: int | None, options: dict | None) -> None:
        roles = list(ROLES)
        self.rng.shuffle(roles)
        self.roles = dict(zip(self.possible_agents, roles, strict=True))
        self.script_rng = random.Random(self.rng.getrandbits(64))  # the scripted players' coin, apart from the deal
        self.alive = list(self.possible_agents)  # seat order
        self.round, self.stage = 1, ""
        self.events, self.winner = [], None
        self.save_used = self.poison_used = False
        self.victim = self.saved = self.poisoned = None  # tonight's
        self.checks: dict[str, bool] = {}  # the seer's results: player -> is a werewolf
        self._wolf_votes: dict[str, str] = {}
        self._votes: dict[str, str] = {}
        self._queue = []  # the turns to play in this stage: (agent, kind)
        self._news: dict[str, list[str]] = {a: [] for a in self.possible_agents}
        self._turns = dict.fromkeys(self.possible_agents, 0)
        self._clean_turns = dict.fromkeys(self.possible_agents, 0)  # turns answered validly at the first try
        self._invalid_seen = dict.fromkeys(self.possible_agents, 0)
        self._accusations: list[tuple[str, str]] = []  # (accuser, accused) in public: for the scripted players
        self._seer_claims: list[str] = []  # players who said "I am the seer" in public: scripted players
        for agent in self.possible_agents:
            role = self.roles[agent]
            lines = [f"The game starts. You are {label(agent)}; your role: {role} (team: {self.team_of(agent)})."]
            if role == WEREWOLF:
                others = [label(a) for a in self.possible_agents if self.roles[a] == WEREWOLF and a != agent]
                lines.append(f"Your fellow werewolves are {' and '.join(others)}.")
            self._news[agent] = lines
        self._next_turn()

    @property
    def turn(self) -> str | None:
        """The kind of turn being played: wolf_speech, wolf_vote, witch, seer, last_words, hunter, speech or vote
        (None once the game is over)."""
        return self._turn(self.agent_selection) if self.agents else None

    def _turn(self, agent: str) -> str | None:
        """The kind of turn `agent` has now, or None."""
        if self.winner is None and self._queue and self._queue[0][0] == agent:
            return self._queue[0][1]
        return None

    def _log(self, kind: str, actor: str | None = None, target: str | None = None, **extra: Any) -> None:
        phase = "night" if self.stage in NIGHT_STAGES else "day"
        self.events.append({"round": self.round, "phase": phase, "type": kind, "actor": actor,
                            "target": None if target == NOBODY else target, **extra})

    def _tell(self, agents: list[str], line: str) -> None:
        for agent in agents:
            self._news[agent].append(line)

    def _tell_all(self, line: str, but: str | None = None) -> None:
        self._tell([a for a in self.possible_agents if a != but], line)

    def _tell_wolves(self, line: str, but: str | None = None) -> None:
        self._tell([a for a in self.wolves() if a != but], "[werewolves only] " + line)

    # --- observations and options -------------------------------------------------------------------------------

    def _observe_text(self, agent: str) -> str:
        lines = list(self._news[agent])
        kind = self._turn(agent)
        if kind is not None:
            lines.append(self._question(agent, kind))
        return "\n".join(lines) or "Nothing new since your last turn."

    def _question(self, agent: str, kind: str) -> str:
        living = ", ".join(label(a) for a in self.alive)
        night, day = f"Night {self.round}.", f"Day {self.round}."
        if kind == "wolf_speech":
            return f"{night} Werewolves, talk privately: whom should you attack? Say one short message."
        if kind == "wolf_vote":
            return f"{night} Vote for the player the werewolves attack tonight."
        if kind == "witch":
            attacked = label(self.victim) if self.victim else "nobody"
            left = [name for name, used in (("save", self.save_used), ("poison", self.poison_used)) if not used]
            return (f"{night} The werewolves attacked {attacked} tonight. Potions left: {' and '.join(left)}. "
                    "Choose one action.")
        if kind == "seer":
            return f"{night} Choose a player to check: you will learn whether it is a werewolf."
        if kind == "last_words":
            return "You are dead. Say your last words to everyone (one short message)."
        if kind == "hunter":
            return "You are dead. As the hunter, you may shoot one living player now, or nobody."
        if kind == "speech":
            return f"{day} Living players: {living}. Your turn to speak to everyone (one short message)."
        return f"{day} Living players: {living}. Vote for a player to eliminate, or nobody."  # vote

    def _targets(self, agent: str, kind: str) -> list[str]:
        """The players `agent` may pick on a choice turn (agent ids, seat order)."""
        if kind == "wolf_vote":
            return [a for a in self.alive if self.roles[a] != WEREWOLF]
        return [a for a in self.alive if a != agent]  # seer, vote, hunter

    def _witch_options(self, agent: str) -> list[tuple[str, str | None]]:
        options: list[tuple[str, str | None]] = []
        if self._can_save(agent) is None:
            options.append(("save", self.victim))
        if not self.poison_used:
            options += [("poison", a) for a in self.alive if a != agent]
        return [*options, ("pass", None)]

    def _witch_replies(self, agent: str) -> str:
        """What the witch may reply now, e.g. '"save" or "poison Player N" or "pass"'."""
        words = {"save": '"save"', "poison": '"poison Player N"', "pass": '"pass"'}
        return " or ".join(words[what] for what in dict.fromkeys(what for what, _ in self._witch_options(agent)))

    def _can_save(self, agent: str) -> str | None:
        """Why the witch cannot save now, or None if she can."""
        if self.save_used:
            return "the save potion is used up"
        if self.victim is None:
            return "nobody was attacked tonight"
        if self.victim == agent:
            return "you cannot save yourself"
        return None

    def _legal_actions(self, agent: str) -> list[str] | None:
        kind = self._turn(agent)
        if kind is None or kind in SPEECH_TURNS:
            return None
        if kind == "witch":
            options = self._witch_options(agent)
            return [what if target is None else f"{what} {label(target)}" for what, target in options]
        return [label(a) for a in self._targets(agent, kind)] + ([NOBODY] if kind in ("vote", "hunter") else [])

    @property
    def choice_prompt(self) -> str:  # type: ignore[override]  # the line under the options depends on the turn
        kind = self.turn
        if kind == "witch":
            return f"Reply with {self._witch_replies(self.agent_selection)}."
        nobody = ', or "nobody"' if kind in ("vote", "hunter") else ""
        return f'Reply with one player: "Player N" or just its number N{nobody}.'

    # --- parsing ------------------------------------------------------------------------------------------------

    def _parse(self, agent: str, text: str) -> Any:
        kind = self._turn(agent)
        if kind is None:
            raise InvalidAction("it is not your turn")
        if kind in SPEECH_TURNS:
            words = printable(text).replace('"', "'").split()
            if not words:
                raise InvalidAction("say something (one short message)")
            return " ".join(words[:MAX_SPEECH_WORDS])
        if kind == "witch":
            return self._parse_witch(agent, text)
        nobody = kind in ("vote", "hunter")
        target = pick(text, nobody=nobody)
        if target is None:
            raise InvalidAction('name one player, as "Player N" or just N' + (', or "nobody"' if nobody else ""))
        if target != NOBODY and target not in self._targets(agent, kind):
            raise InvalidAction(self._why_not(agent, kind, target))
        return target

    def _why_not(self, agent: str, kind: str, target: str) -> str:
        if target not in self.alive:
            return f"{label(target)} is dead"
        if target == agent:
            return "you cannot choose yourself"
        if kind == "wolf_vote":
            return f"{label(target)} is a werewolf; attack a player who is not"
        return f"{label(target)} is not an option"

    def _parse_witch(self, agent: str, text: str) -> tuple[str, str | None]:
        text = printable(text).lower()
        found = {what: m.start() for what, pattern in _WITCH_WORDS.items() if (m := pattern.search(text))}
        if not found:
            raise InvalidAction(f"reply with {self._witch_replies(agent)}")
        what = min(found, key=found.__getitem__)  # the first named; several only if the reply starts with it
        if len(found) > 1 and found[what] != len(text) - len(text.lstrip(_LEADING)):
            raise InvalidAction(f"do one thing only: reply with {self._witch_replies(agent)}")
        if what == "pass":
            return ("pass", None)
        target = pick(text[found[what]:], nobody=False)
        if what == "save":
            reason = self._can_save(agent)
            if reason:
                raise InvalidAction(reason)
            if target not in (None, self.victim):
                raise InvalidAction(f"you can only save {label(self.victim)}, the player the werewolves attacked")
            return ("save", self.victim)
        if self.poison_used:
            raise InvalidAction("the poison is used up")
        if target is None:
            raise InvalidAction('name the player to poison: "poison Player N"')
        if target not in self.alive:
            raise InvalidAction(f"{label(target)} is dead")
        if target == agent:
            raise InvalidAction("you cannot poison yourself")
        return ("poison", target)

    def _fallback(self, agent: str) -> Any:
        kind = self._turn(agent)
        if kind in SPEECH_TURNS:
            return ""  # silence
        return ("pass", None) if kind == "witch" else NOBODY  # no vote, check nobody, shoot nobody

    # --- playing a turn -----------------------------------------------------------------------------------------

    def _apply(self, agent: str, action: Any) -> None:
        self._news[agent] = []  # delivered with the observation this action answered
        self._turns[agent] += 1
        if self.invalid_actions[agent] == self._invalid_seen[agent]:
            self._clean_turns[agent] += 1
        self._invalid_seen[agent] = self.invalid_actions[agent]
        _, kind = self._queue.pop(0)
        getattr(self, f"_do_{kind}")(agent, action)
        self._next_turn()

    def _do_wolf_speech(self, agent: str, text: str) -> None:
        self._log("wolf_speech", agent, text=text)
        self._tell_wolves(f'{label(agent)} says: "{text}"' if text else f"{label(agent)} says nothing.", but=agent)

    def _do_wolf_vote(self, agent: str, target: str) -> None:
        self._wolf_votes[agent] = target
        self._log("wolf_vote", agent, target)
        vote = f"votes to attack {label(target)}" if target != NOBODY else "does not vote"
        self._tell_wolves(f"{label(agent)} {vote}.", but=agent)

    def _do_witch(self, agent: str, action: tuple[str, str | None]) -> None:
        what, target = action
        self._log(what, agent, target)
        if what == "save":
            self.save_used, self.saved = True, target
            self._tell([agent], f"You saved {label(target)}.")
        elif what == "poison":
            self.poison_used, self.poisoned = True, target
            self._tell([agent], f"You poisoned {label(target)}.")
        else:
            self._tell([agent], "You passed.")

    def _do_seer(self, agent: str, target: str) -> None:
        if target == NOBODY:
            self._log("check", agent, None)
            self._tell([agent], "You checked nobody tonight.")
            return
        self.checks[target] = self.roles[target] == WEREWOLF
        self._log("check", agent, target, result="werewolf" if self.checks[target] else "village")
        verdict = "is a werewolf" if self.checks[target] else "is not a werewolf"
        self._tell([agent], f"You checked {label(target)}: {label(target)} {verdict}.")

    def _do_speech(self, agent: str, text: str) -> None:
        self._log("speech", agent, text=text)
        self._tell_all(f'{label(agent)} says: "{text}"' if text else f"{label(agent)} says nothing.", but=agent)
        self._note_claims(agent, text)

    def _do_last_words(self, agent: str, text: str) -> None:
        self._log("last_words", agent, text=text)
        said = f'\'s last words: "{text}"' if text else " leaves without a word."
        self._tell_all(label(agent) + said, but=agent)
        self._note_claims(agent, text)

    def _do_vote(self, agent: str, target: str) -> None:
        self._votes[agent] = target
        self._log("vote", agent, target)

    def _do_hunter(self, agent: str, target: str) -> None:
        self._log("shoot", agent, target)
        if target == NOBODY:
            self._tell([agent], "You shot nobody.")
            return
        self._tell_all(f"{label(agent)} shoots {label(target)}. {label(target)} is dead.")
        self._kill({target: "shot"})
        self._queue.insert(0, (target, "last_words"))

    def _note_claims(self, speaker: str, text: str) -> None:
        """Remember public accusations and seer claims (what every player heard), for the scripted players."""
        self._accusations += [(speaker, f"player_{m}") for m in _ACCUSATION.findall(text)]
        if _SEER_CLAIM.search(text):
            self._seer_claims.append(speaker)

    # --- stages -------------------------------------------------------------------------------------------------

    def _next_turn(self) -> None:
        """Start stages until one has a turn to play, or the game is over."""
        while self.winner is None and not self._queue:
            if self.stage == STAGES[-1]:
                if self.round == self.max_rounds:
                    self.winner = "draw"
                    break
                self.round += 1
            self.stage = STAGES[(STAGES.index(self.stage) + 1) % len(STAGES)] if self.stage else STAGES[0]
            getattr(self, f"_start_{self.stage}")()
        if self.winner is not None:
            self._end_game()
        else:
            self.agent_selection = self._queue[0][0]

    def _start_wolf_talk(self) -> None:
        self._tell_all(f"--- Night {self.round} falls. ---")
        self.victim = self.saved = self.poisoned = None
        self._wolf_votes = {}
        if len(self.wolves()) >= 2:
            self._queue = [(a, "wolf_speech") for a in self.wolves()]

    def _start_wolf_vote(self) -> None:
        self._queue = [(a, "wolf_vote") for a in self.wolves()]

    def _start_witch(self) -> None:
        votes = Counter(t for t in self._wolf_votes.values() if t != NOBODY)
        if votes:
            most = max(votes.values())
            self.victim = min((t for t, n in votes.items() if n == most), key=seat)
        self._log("attack", None, self.victim, votes=dict(self._wolf_votes))
        self._tell_wolves(f"The werewolves attack {label(self.victim)}." if self.victim
                          else "The werewolves attack nobody tonight.")
        witch = self._alive_with(WITCH)
        if witch and not (self.save_used and self.poison_used):
            self._queue = [(witch, "witch")]

    def _start_seer(self) -> None:
        seer = self._alive_with(SEER)
        if seer:
            self._queue = [(seer, "seer")]

    def _start_dawn(self) -> None:
        causes = {}
        if self.victim and self.victim != self.saved:
            causes[self.victim] = "werewolves"
        if self.poisoned:
            causes[self.poisoned] = "poison"  # poison wins: a poisoned hunter never shoots
        dead = sorted(causes, key=seat)
        died = " and ".join(label(a) for a in dead) + " died in the night." if dead else "Nobody died in the night."
        self._tell_all(f"--- Day {self.round} breaks. --- {died}")
        self._kill({a: causes[a] for a in dead})
        for agent in dead:
            self._queue.append((agent, "last_words"))
            if self.roles[agent] == HUNTER and causes[agent] == "werewolves":
                self._queue.append((agent, "hunter"))

    def _start_day_talk(self) -> None:
        self._queue = [(a, "speech") for a in self.alive]

    def _start_day_vote(self) -> None:
        self._votes = {}
        self._queue = [(a, "vote") for a in self.alive]

    def _start_verdict(self) -> None:
        tally = Counter(self._votes.values())
        most = max(tally.values())
        leaders = [t for t, n in tally.items() if n == most]
        out = leaders[0] if len(leaders) == 1 and leaders[0] != NOBODY else None
        self._log("voted_out", None, out, tally=dict(tally))
        # for the scripted players: voting against a claimed seer is suspicious (everyone saw the votes)
        self._accusations += [(t, a) for a, t in self._votes.items() if t in self._seer_claims]
        votes = ", ".join(f"{label(a)} -> {label(t) if t != NOBODY else NOBODY}" for a, t in self._votes.items())
        result = f"{label(out)} is voted out." if out else "Nobody is voted out."
        self._tell_all(f"Votes: {votes}. {result}")
        if out:
            self._kill({out: "vote"})
            self._queue = [(out, "last_words")] + ([(out, "hunter")] if self.roles[out] == HUNTER else [])

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

    def _end_game(self) -> None:
        self._queue.clear()
        self._log("game_over", winner=self.winner)
        ending = {"village": "the village wins: every werewolf is dead.",
                  "werewolves": "the werewolves win: they are as many as the others.",
                  "draw": f"nobody wins after {self.max_rounds} rounds: a draw."}
        self._tell_all(f"Game over: {ending[self.winner]}")
        for agent in self.agents:
            if self.winner == "draw":
                result = self.draw_reward
            else:
                result = 1.0 if self.team_of(agent) == self.winner else 0.0
            clean = self._clean_turns[agent] / self._turns[agent] if self._turns[agent] else 0.0
            self.rewards[agent] = result + self.valid_action_bonus * clean
            self.terminations[agent] = True
            self.infos[agent].update(winner=self.winner, team=self.team_of(agent))

    def summary(self) -> dict[str, Any]:
        """Who had which role, the game master's log without the speeches (they are the transcript's actions):
        attacks, saves, poisons, checks, shots, votes out, deaths by round and phase; the survivors; the winner."""
        speech = {"wolf_speech", "speech", "last_words", "vote", "wolf_vote"}
        events = [{key: value for key, value in event.items() if value is not None}
                  for event in self.events if event["type"] not in speech]
        return {"roles": dict(self.roles), "winner": self.winner, "rounds": self.round, "alive": list(self.alive),
                "deaths": [f"round {e['round']} ({e['phase']}): {label(e['target'])} ({self.roles[e['target']]})"
                           f" {_DEATH_CAUSES[e['cause']]}" for e in self.events if e["type"] == "death"],
                "events": events}

    # --- scripted players: simple rules over what the agent knows -----------------------------------------------

    def scripted_action(self, agent: str) -> str:
        """A simple rule-based reply for `agent`'s turn, from what it may know (public speech, its own role's news).

        Seer: checks unchecked players; by day names a werewolf it found ("I am the seer: Player 4 is a werewolf."),
        and in its last words all it found. Village: votes for the latest suspect (a player publicly called a
        werewolf, or who voted against a claimed seer), else nobody. Werewolves: attack what tonight's first
        werewolf proposed; attack and vote for a claimed seer or a player who accused a werewolf, else a random
        non-werewolf. Witch: saves the attacked player while she can, else poisons a suspect. Hunter: shoots a
        suspect, else nobody.
        """
        kind = self._turn(agent)
        if kind is None:
            raise ValueError(f"{agent} has no turn now")
        return getattr(self, f"_script_{kind}")(agent)

    def _accused(self, agent: str) -> list[str]:
        """Living players other than `agent` publicly called a werewolf or who voted against a claimed seer, the
        latest first."""
        seen = []
        for _, accused in reversed(self._accusations):
            if accused in self.alive and accused != agent and accused not in seen:
                seen.append(accused)
        return seen

    def _found_wolves(self) -> list[str]:
        return [a for a in self.alive if self.checks.get(a)]

    def _wolf_target(self, agent: str) -> str:
        """Tonight's werewolf plan: the first attack proposed in tonight's talk, else a threat, else at random."""
        targets = self._targets(agent, "wolf_vote")
        for event in self.events:
            if event["type"] == "wolf_speech" and event["round"] == self.round:
                try:
                    proposal = pick(event["text"], nobody=False)
                except InvalidAction:  # a message naming several players: no clear proposal
                    proposal = None
                if proposal in targets:
                    return proposal
        return self._wolf_threat(targets) or self.script_rng.choice(targets)

    def _wolf_threat(self, targets: list[str]) -> str | None:
        """A living claimed seer, else a living player who accused a werewolf."""
        threats = self._seer_claims + [s for s, a in self._accusations if self.roles[a] == WEREWOLF]
        return next((a for a in threats if a in targets and self.roles[a] != WEREWOLF), None)

    def _script_wolf_speech(self, agent: str) -> str:
        return f"Let us attack {label(self._wolf_target(agent))}."

    def _script_wolf_vote(self, agent: str) -> str:
        return label(self._wolf_target(agent))

    def _script_witch(self, agent: str) -> str:
        if self._can_save(agent) is None:
            return f"save {label(self.victim)}"
        accused = self._accused(agent)
        if not self.poison_used and accused:
            return f"poison {label(accused[0])}"
        return "pass"

    def _script_seer(self, agent: str) -> str:
        targets = self._targets(agent, "seer")
        unchecked = [a for a in targets if a not in self.checks]
        return label(self.script_rng.choice(unchecked or targets))

    def _script_hunter(self, agent: str) -> str:
        accused = self._accused(agent)
        return label(accused[0]) if accused else NOBODY

    def _script_speech(self, agent: str) -> str:
        role = self.roles[agent]
        if role == SEER and self._found_wolves():
            return f"I am the seer: {label(self._found_wolves()[0])} is a werewolf."
        accused = self._accused(agent)
        if role != WEREWOLF and accused:
            return f"I will vote for {label(accused[0])}."
        return "I have nothing to report yet."

    def _script_last_words(self, agent: str) -> str:
        if self.roles[agent] == SEER:
            found = " ".join(f"{label(a)} is a werewolf." for a in self._found_wolves())
            return f"I was the seer. {found or 'I found no werewolf.'}"
        return "Good luck, everyone."

    def _script_vote(self, agent: str) -> str:
        role, others = self.roles[agent], self._targets(agent, "vote")
        if role == WEREWOLF:
            choice = self._wolf_threat(others) or self.script_rng.choice(
                [a for a in others if self.roles[a] != WEREWOLF])
        elif role == SEER:
            found = self._found_wolves()
            choice = found[0] if found else NOBODY
        else:
            accused = self._accused(agent)
            choice = accused[0] if accused else NOBODY
        return label(choice) if choice != NOBODY else NOBODY
