"""Reading Werewolves replies: a player's reply text -> the action `WerewolvesGame.play` takes, or `InvalidAction`.

- Speech turns (werewolf talk, discussion, last words): the text on one line, double quotes made single, at most
  `MAX_SPEECH_WORDS` words; empty is invalid.
- Choices: `pick` finds the one player a reply names, in any common form ("3", "Player 3", "player_3", "P3", "#3",
  "I vote for player 3"), or nobody ("nobody", "no one", "none", "abstain", "skip", "pass") where that is an option;
  a dead or illegal target is invalid, with the reason.
- The witch: "save", "poison Player N" or "pass" -> ("save", victim), ("poison", player) or ("pass", None).
- `fallback(kind)`: the action played after too many invalid replies: silence, no vote, nobody, pass.
"""

from __future__ import annotations

import re

from envs.base import InvalidAction, printable
from envs.werewolves_rules import NOBODY, NUM_PLAYERS, SPEECH_TURNS, WerewolvesGame
from envs.werewolves_text import label, witch_replies

MAX_SPEECH_WORDS = 80

# A seat: "3", "Player 3", "player_3", "P3", "#3", "seat 3"; or a word for nobody.
_MENTION = re.compile(r"(?<![\w#])(?:(?:player|seat)[\s_#.:-]*|p|#)?(\d{1,2})(?!\w)"
                      r"|\b(nobody|no one|noone|none|abstain|skip|pass)\b")
_VERB_BEFORE = re.compile(r"\b(?:vote|check|attack|kill|eliminate|shoot|poison|save|choose|pick|select|target)\w*"
                          r"[\s:]+(?:for\s+|on\s+|against\s+)?$")
_WITCH_WORDS = {"save": re.compile(r"\b(?:sav(?:e|es|ed|ing)|heal\w*|rescue\w*|antidote)\b"),
                "poison": re.compile(r"\bpoison\w*"),
                "pass": re.compile(r"\b(?:pass|nothing|skip|no action)\b")}
_LEADING = " \t\n\"'*([-:>`"


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


def parse(game: WerewolvesGame, agent: str, kind: str | None, text: str) -> object:
    """The action `agent`'s reply `text` means on its turn of this kind; InvalidAction (with the reason) if none."""
    if kind is None:
        raise InvalidAction("it is not your turn")
    if kind in SPEECH_TURNS:
        words = printable(text).replace('"', "'").split()
        if not words:
            raise InvalidAction("say something (one short message)")
        return " ".join(words[:MAX_SPEECH_WORDS])
    if kind == "witch":
        return _parse_witch(game, agent, text)
    nobody = kind in ("vote", "hunter")
    target = pick(text, nobody=nobody)
    if target is None:
        raise InvalidAction('name one player, as "Player N" or just N' + (', or "nobody"' if nobody else ""))
    if target != NOBODY and target not in game.targets(agent, kind):
        raise InvalidAction(_why_not(game, agent, kind, target))
    return target


def fallback(kind: str | None) -> object:
    """The action played after too many invalid replies on a turn of this kind."""
    if kind in SPEECH_TURNS:
        return ""  # silence
    return ("pass", None) if kind == "witch" else NOBODY  # no vote, check nobody, shoot nobody


def _why_not(game: WerewolvesGame, agent: str, kind: str, target: str) -> str:
    if target not in game.alive:
        return f"{label(target)} is dead"
    if target == agent:
        return "you cannot choose yourself"
    if kind == "wolf_vote":
        return f"{label(target)} is a werewolf; attack a player who is not"
    return f"{label(target)} is not an option"


def _parse_witch(game: WerewolvesGame, agent: str, text: str) -> tuple[str, str | None]:
    text = printable(text).lower()
    found = {what: m.start() for what, pattern in _WITCH_WORDS.items() if (m := pattern.search(text))}
    if not found:
        raise InvalidAction(f"reply with {witch_replies(game, agent)}")
    what = min(found, key=found.__getitem__)  # the first named; several only if the reply starts with it
    if len(found) > 1 and found[what] != len(text) - len(text.lstrip(_LEADING)):
        raise InvalidAction(f"do one thing only: reply with {witch_replies(game, agent)}")
    if what == "pass":
        return ("pass", None)
    target = pick(text[found[what]:], nobody=False)
    if what == "save":
        reason = game.can_save(agent)
        if reason:
            raise InvalidAction(reason)
        if target not in (None, game.victim):
            raise InvalidAction(f"you can only save {label(game.victim)}, the player the werewolves attacked")
        return ("save", game.victim)
    if game.poison_used:
        raise InvalidAction("the poison is used up")
    if target is None:
        raise InvalidAction('name the player to poison: "poison Player N"')
    if target not in game.alive:
        raise InvalidAction(f"{label(target)} is dead")
    if target == agent:
        raise InvalidAction("you cannot poison yourself")
    return ("poison", target)
