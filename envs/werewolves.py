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

The code, by concern: `envs/werewolves_rules.py` (`WerewolvesGame`: the rules above as a state machine, the log),
`envs/werewolves_text.py` (the system prompt, the news, the questions and options), `envs/werewolves_replies.py`
(reply text -> action, the fallbacks) and `envs/werewolves_scripted.py` (the scripted players). This module is the
PettingZoo env that joins them (`Werewolves`: dealing, turns, rewards, the summary); the names the other modules
define for players of the game (roles, `label`, `pick`, ...) are importable from here too.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from envs import werewolves_text
from envs.base import RoleInfo, TextAECEnv
from envs.werewolves_replies import MAX_SPEECH_WORDS, fallback, mentions, parse, pick
from envs.werewolves_rules import (
    HUNTER,
    MAX_TURNS_PER_ROUND,
    NIGHT_STAGES,
    NOBODY,
    NUM_PLAYERS,
    ROLES,
    SEER,
    SPEECH_TURNS,
    STAGES,
    VILLAGER,
    WEREWOLF,
    WITCH,
    WerewolvesGame,
    seat,
    team,
)
from envs.werewolves_scripted import ScriptedPlayers
from envs.werewolves_text import ROLE_HELP, News, label

__all__ = ["HUNTER", "MAX_SPEECH_WORDS", "MAX_TURNS_PER_ROUND", "NIGHT_STAGES", "NOBODY", "NUM_PLAYERS", "ROLES",
           "ROLE_HELP", "SEER", "SPEECH_TURNS", "STAGES", "VILLAGER", "WEREWOLF", "WITCH", "Werewolves", "label",
           "mentions", "pick", "seat"]

_DEATH_CAUSES = {"werewolves": "attacked by the werewolves", "poison": "poisoned", "vote": "voted out",
                 "shot": "shot by the hunter"}


class _FromGame:
    """An env attribute that reads the same attribute of the game being played (`env.game`); `default` before the
    first reset."""

    def __init__(self, default: Any = None):
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, env: Werewolves | None, owner: type | None = None) -> Any:
        if env is None:
            return self
        return self.default if env.game is None else getattr(env.game, self.name)


class Werewolves(TextAECEnv):
    """The game as a PettingZoo AEC env of text. Each reset deals the roles from the seed and starts the game's rules
    (`WerewolvesGame`), what its players are told (`News`) and its scripted players; each step's reply is parsed
    (`envs.werewolves_replies.parse`) and played. At the end every player, dead or alive, gets its team's result."""

    metadata: ClassVar[dict[str, Any]] = {"name": "werewolves_v0", "render_modes": ["human", "ansi"],
                                          "is_parallelizable": False}
    possible_agents: ClassVar[list[str]] = [f"player_{i}" for i in range(1, NUM_PLAYERS + 1)]
    number_options = False  # options are players: a bare number is a seat, not an option's index

    # The game's state, for audits and tests (docs/envs.md): read from the game being played.
    roles = _FromGame({})
    events = _FromGame([])
    winner = _FromGame(None)
    alive = _FromGame()
    round = _FromGame()
    stage = _FromGame()
    checks = _FromGame()
    victim = _FromGame()
    saved = _FromGame()
    poisoned = _FromGame()
    save_used = _FromGame()
    poison_used = _FromGame()

    def __init__(self, max_rounds: int = 10, draw_reward: float = 0.0, valid_action_bonus: float = 0.0,
                 render_mode: str | None = None):
        if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
            raise ValueError(f"max_rounds must be an integer of 1 or more; got {max_rounds!r}")
        if not 0.0 <= draw_reward <= 1.0:
            raise ValueError(f"draw_reward must be between 0.0 (a loss) and 1.0 (a win); got {draw_reward!r}")
        if not valid_action_bonus >= 0.0:
            raise ValueError(f"valid_action_bonus must be 0.0 or more; got {valid_action_bonus!r}")
        self.game: WerewolvesGame | None = None  # a new one at every reset
        super().__init__(render_mode=render_mode)
        self.max_rounds, self.draw_reward = max_rounds, float(draw_reward)
        self.valid_action_bonus = float(valid_action_bonus)
        self.max_steps = MAX_TURNS_PER_ROUND * max_rounds

    # --- roles --------------------------------------------------------------------------------------------------

    def role_of(self, agent: str) -> str:
        if not self.roles:
            raise RuntimeError("roles are dealt at reset(): call reset() first")
        return self.roles[agent]

    def team_of(self, agent: str) -> str:
        return team(self.role_of(agent))

    def dealt_roles(self) -> dict[str, RoleInfo]:
        """Every game deals the same roles (to seats chosen by the game's seed)."""
        return {role: RoleInfo(team=team(role), count=ROLES.count(role)) for role in dict.fromkeys(ROLES)}

    def wolves(self) -> list[str]:
        """The living werewolves, in seat order."""
        return self.game.wolves()

    def system_prompt(self, agent: str) -> str:
        return werewolves_text.system_prompt(agent, self.role_of(agent))

    # --- a game -------------------------------------------------------------------------------------------------

    def _reset_game(self, seed: int | None, options: dict | None) -> None:
        roles = list(ROLES)
        self.rng.shuffle(roles)
        dealt = dict(zip(self.possible_agents, roles, strict=True))
        self.script_rng = random.Random(self.rng.getrandbits(64))  # the scripted players' coin, apart from the deal
        self.news = News(dealt)
        self.game = WerewolvesGame(dealt, self.max_rounds, narrator=self.news)
        self.scripted = ScriptedPlayers(self.game, self.script_rng)
        self._turns = dict.fromkeys(self.possible_agents, 0)
        self._clean_turns = dict.fromkeys(self.possible_agents, 0)  # turns answered validly at the first try
        self._invalid_seen = dict.fromkeys(self.possible_agents, 0)
        self.game.advance()
        self._next_turn()

    @property
    def turn(self) -> str | None:
        """The kind of turn being played: wolf_speech, wolf_vote, witch, seer, last_words, hunter, speech or vote
        (None once the game is over)."""
        return self._turn(self.agent_selection) if self.agents else None

    def _turn(self, agent: str) -> str | None:
        """The kind of turn `agent` has now, or None (also before the first reset)."""
        return self.game.turn_of(agent) if self.game else None

    def _observe_text(self, agent: str) -> str:
        lines = list(self.news.lines[agent])
        kind = self._turn(agent)
        if kind is not None:
            lines.append(werewolves_text.question(self.game, agent, kind))
        return "\n".join(lines) or "Nothing new since your last turn."

    def _legal_actions(self, agent: str) -> list[str] | None:
        return werewolves_text.options(self.game, agent, self._turn(agent))

    @property
    def choice_prompt(self) -> str:  # type: ignore[override]  # the line under the options depends on the turn
        agent = self.agent_selection if self.agents else None
        return werewolves_text.choice_prompt(self.game, agent, self.turn)

    def _parse(self, agent: str, text: str) -> Any:
        return parse(self.game, agent, self._turn(agent), text)

    def _fallback(self, agent: str) -> Any:
        return fallback(self._turn(agent))

    def _apply(self, agent: str, action: Any) -> None:
        self.news.delivered(agent)  # with the observation this action answered
        self._turns[agent] += 1
        if self.invalid_actions[agent] == self._invalid_seen[agent]:
            self._clean_turns[agent] += 1
        self._invalid_seen[agent] = self.invalid_actions[agent]
        self.game.play(agent, action)
        self._next_turn()

    def _next_turn(self) -> None:
        """Hand the turn to the game's next player or, once the game is over, reward every player."""
        if self.game.winner is None:
            self.agent_selection = self.game.queue[0][0]
            return
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

    def scripted_action(self, agent: str) -> str:
        """A simple rule-based reply for `agent`'s turn, from what it may know (public speech, its own role's news):
        the rules are in `envs/werewolves_scripted.py`."""
        kind = self._turn(agent)
        if kind is None:
            raise ValueError(f"{agent} has no turn now")
        return self.scripted.action(agent, kind)
