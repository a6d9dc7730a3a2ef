"""What Werewolves says to its players: the system prompt, the news, the questions and the options.

- `system_prompt(agent, role)`: the rules in short and the agent's role (`ROLE_HELP`).
- `News`: the game's `Narrator` (`envs/werewolves_rules.py`). It turns each event of the game master's log and each
  stage start into lines for the players who may know them (werewolf-only lines start with "[werewolves only]"),
  and keeps each player's lines until its next action is applied: an observation is the news since the agent's last
  turn, so a retry after an invalid reply shows the same news again.
- `question`, `options` and `choice_prompt`: what a turn asks, the options listed unnumbered ("Player 3", "save",
  "poison Player 2", "nobody") and the line under them.

Players are "Player N" in every text (`label`); the replies are read by `envs/werewolves_replies.py`.
"""

from __future__ import annotations

from typing import Any

from envs.werewolves_rules import (
    HUNTER,
    NOBODY,
    NUM_PLAYERS,
    SEER,
    SPEECH_TURNS,
    VILLAGER,
    WEREWOLF,
    WITCH,
    WerewolvesGame,
    team,
)

ROLE_HELP = {
    WEREWOLF: "At night you talk privately with the other werewolves and vote whom to attack. By day, hide what you "
              "are and get village players voted out.",
    VILLAGER: "You have no special power: listen, find the werewolves and vote them out.",
    SEER: "Each night you check one player and learn whether it is a werewolf. Only you learn it.",
    WITCH: "You have two potions, each usable once: the save potion (at night you learn whom the werewolves attacked "
           "and may save that player, but not yourself) and the poison (kill one player). At most one per night.",
    HUNTER: "If you die, except by poison, you may shoot one living player, who dies too.",
}
_LABELS = {f"player_{n}": f"Player {n}" for n in range(1, NUM_PLAYERS + 1)}
_ENDINGS = {"village": "the village wins: every werewolf is dead.",
            "werewolves": "the werewolves win: they are as many as the others."}
_WITCH_DID = {"save": "saved", "poison": "poisoned"}


def label(agent: str) -> str:
    """"player_3" -> "Player 3"."""
    return _LABELS[agent]


def system_prompt(agent: str, role: str) -> str:
    """The system message of the LLM playing `agent` with `role`."""
    article = "a" if role in (WEREWOLF, VILLAGER) else "the"
    return (f"You are {label(agent)} in a game of Werewolves with 9 players (Player 1 to Player 9): 3 werewolves, "
            "3 villagers, a seer, a witch and a hunter. Each night the werewolves secretly attack a player; each "
            "day everyone talks, then votes a player out. The village wins when every werewolf is dead; the "
            "werewolves win when they are at least as many as the other living players.\n"
            f"You are {article} {role} (team: {team(role)}). {ROLE_HELP[role]}\n"
            "Each message tells you what happened since your last turn. When asked to speak, reply with one "
            "short message. When asked to choose, reply with your choice only, e.g. a player's number.")


class News:
    """What each player has been told since its last turn. It starts with the deal (each role; the werewolves learn
    each other), then hears the game (`Narrator`): `logged` and `stage_started` add the lines."""

    def __init__(self, roles: dict[str, str]):
        self.agents = list(roles)  # seat order
        self.lines: dict[str, list[str]] = {}
        for agent, role in roles.items():
            lines = [f"The game starts. You are {label(agent)}; your role: {role} (team: {team(role)})."]
            if role == WEREWOLF:
                others = [label(a) for a in self.agents if roles[a] == WEREWOLF and a != agent]
                lines.append(f"Your fellow werewolves are {' and '.join(others)}.")
            self.lines[agent] = lines

    def delivered(self, agent: str) -> None:
        """`agent` acted on its news: it starts over."""
        self.lines[agent] = []

    def stage_started(self, game: WerewolvesGame, stage: str) -> None:
        if stage == "wolf_talk":
            self._tell_all(f"--- Night {game.round} falls. ---")
        elif stage == "dawn":
            dead = list(game.night_deaths())
            died = " and ".join(label(a) for a in dead) + " died in the night." if dead else "Nobody died in the night."
            self._tell_all(f"--- Day {game.round} breaks. --- {died}")

    def logged(self, game: WerewolvesGame, event: dict[str, Any]) -> None:
        kind, actor, target = event["type"], event["actor"], event["target"]
        if kind == "wolf_speech":
            self._tell_wolves(game, _says(actor, event["text"]), but=actor)
        elif kind == "wolf_vote":
            vote = f"votes to attack {label(target)}" if target else "does not vote"
            self._tell_wolves(game, f"{label(actor)} {vote}.", but=actor)
        elif kind == "attack":
            self._tell_wolves(game, f"The werewolves attack {label(target)}." if target
                              else "The werewolves attack nobody tonight.")
        elif kind in ("save", "poison", "pass"):
            self._tell([actor], f"You {_WITCH_DID[kind]} {label(target)}." if target else "You passed.")
        elif kind == "check":
            verdict = "is a werewolf" if event.get("result") == "werewolf" else "is not a werewolf"
            self._tell([actor], f"You checked {label(target)}: {label(target)} {verdict}." if target
                       else "You checked nobody tonight.")
        elif kind == "speech":
            self._tell_all(_says(actor, event["text"]), but=actor)
        elif kind == "last_words":
            text = event["text"]
            self._tell_all(label(actor) + (f'\'s last words: "{text}"' if text else " leaves without a word."),
                           but=actor)
        elif kind == "shoot":
            if target:
                self._tell_all(f"{label(actor)} shoots {label(target)}. {label(target)} is dead.")
            else:
                self._tell([actor], "You shot nobody.")
        elif kind == "voted_out":
            votes = ", ".join(f"{label(a)} -> {label(t) if t != NOBODY else NOBODY}" for a, t in game.votes.items())
            self._tell_all(f"Votes: {votes}. {f'{label(target)} is voted out.' if target else 'Nobody is voted out.'}")
        elif kind == "game_over":
            ending = _ENDINGS.get(game.winner, f"nobody wins after {game.max_rounds} rounds: a draw.")
            self._tell_all(f"Game over: {ending}")

    def _tell(self, agents: list[str], line: str) -> None:
        for agent in agents:
            self.lines[agent].append(line)

    def _tell_all(self, line: str, but: str | None = None) -> None:
        self._tell([a for a in self.agents if a != but], line)

    def _tell_wolves(self, game: WerewolvesGame, line: str, but: str | None = None) -> None:
        self._tell([a for a in game.wolves() if a != but], "[werewolves only] " + line)


def _says(agent: str, text: str) -> str:
    return f'{label(agent)} says: "{text}"' if text else f"{label(agent)} says nothing."


def question(game: WerewolvesGame, agent: str, kind: str) -> str:
    """What `agent` is asked on a turn of this kind."""
    living = ", ".join(label(a) for a in game.alive)
    night, day = f"Night {game.round}.", f"Day {game.round}."
    if kind == "wolf_speech":
        return f"{night} Werewolves, talk privately: whom should you attack? Say one short message."
    if kind == "wolf_vote":
        return f"{night} Vote for the player the werewolves attack tonight."
    if kind == "witch":
        attacked = label(game.victim) if game.victim else "nobody"
        left = [name for name, used in (("save", game.save_used), ("poison", game.poison_used)) if not used]
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


def options(game: WerewolvesGame, agent: str, kind: str | None) -> list[str] | None:
    """The options listed on `agent`'s turn of this kind; None on speech turns (free text) or without a turn."""
    if kind is None or kind in SPEECH_TURNS:
        return None
    if kind == "witch":
        return [what if target is None else f"{what} {label(target)}" for what, target in game.witch_options(agent)]
    return [label(a) for a in game.targets(agent, kind)] + ([NOBODY] if kind in ("vote", "hunter") else [])


def choice_prompt(game: WerewolvesGame, agent: str, kind: str | None) -> str:
    """The line under the options: how to reply on this turn."""
    if kind == "witch":
        return f"Reply with {witch_replies(game, agent)}."
    nobody = ', or "nobody"' if kind in ("vote", "hunter") else ""
    return f'Reply with one player: "Player N" or just its number N{nobody}.'


def witch_replies(game: WerewolvesGame, agent: str) -> str:
    """What the witch may reply now, e.g. '"save" or "poison Player N" or "pass"'."""
    words = {"save": '"save"', "poison": '"poison Player N"', "pass": '"pass"'}
    return " or ".join(words[what] for what in dict.fromkeys(what for what, _ in game.witch_options(agent)))
