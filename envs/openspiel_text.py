"""What an LLM playing an OpenSpiel game is told: the rules once, its private information, what happened since its
last turn, and names for its moves (envs/openspiel_env.py plays the game; this module only words it).

A `GameText` per game family: `KuhnText`, `LeducText`, `LiarsDiceText` and `TicTacToeText` word their games as a
person would explain them (cards by name, bets as bets); `GenericText` serves any other game from what OpenSpiel
itself says (its long name, `observation_string`, `action_to_string`). Every method takes OpenSpiel states and
returns plain text; none changes a state.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GameText", "GenericText", "KuhnText", "LeducText", "LiarsDiceText", "TicTacToeText", "game_text"]


class GameText:
    """How one game is worded. Subclasses override what their game says differently from the generic wording."""

    #: Other spellings a person uses for a move, per OpenSpiel move name (lower case): "check" for kuhn's "Pass".
    aliases: dict[str, tuple[str, ...]] = {}

    def __init__(self, game: Any):
        self.game = game
        self.type = game.get_type()

    def rules(self, player: int) -> str:
        """The rules, told once, at a player's first turn."""
        params = {k: v for k, v in self.game.get_parameters().items() if k != "players"}
        setting = f" Parameters: {', '.join(f'{k}={v}' for k, v in sorted(params.items()))}." if params else ""
        return (f"You are playing {self.type.long_name} (OpenSpiel's {self.type.short_name}) with"
                f" {self.game.num_players()} players. You are Player {player}.{setting} Each turn you are told what"
                " happened since your last turn, what you see of the game, and your legal moves; reply with one of"
                " them.")

    def private(self, state: Any, player: int) -> str:
        """What `player` sees of the game now (its cards, the board)."""
        if self.type.provides_observation_string:
            view = state.observation_string(player)
        else:
            view = state.information_state_string(player)
        return f"What you see of the game:\n{view}" if view.strip() else ""

    def move(self, state: Any, player: int, action: int) -> str:
        """A move of `player`, as others are told it (`state` is the state before the move)."""
        return f"Player {player} played {state.action_to_string(player, action)}."

    def chance(self, state: Any, action: int, viewer: int) -> str | None:
        """What `viewer` learns of a chance outcome (`state` before it): None when it learns nothing here (a deal
        is told as each player's private information instead)."""
        if self.type.information.name == "PERFECT_INFORMATION":
            return f"Chance: {state.action_to_string(state.current_player(), action)}."
        return None

    def public_moves(self) -> bool:
        """Whether every player sees every move (then moves are told to the others by name)."""
        return self.type.information.name == "PERFECT_INFORMATION"

    def move_name(self, state: Any, player: int, action: int) -> str:
        """The move as the player's list shows it."""
        return state.action_to_string(player, action)


class GenericText(GameText):
    """Any game, worded from what OpenSpiel says of it."""

    def move(self, state: Any, player: int, action: int) -> str:
        if self.public_moves():
            return super().move(state, player, action)
        return f"Player {player} moved."


_KUHN_CARDS = ("Jack", "Queen", "King")


class KuhnText(GameText):
    aliases = {"pass": ("check", "fold"), "bet": ("call",)}

    def rules(self, player: int) -> str:
        return ("Kuhn Poker: the deck is Jack, Queen, King (King highest). Each player antes 1 chip and gets one"
                " card, which only they see. Player 0 acts first. Pass is a check, or a fold when facing a bet."
                " Bet puts in 1 chip: a bet, or a call when facing one. After two checks or a call, the higher card"
                f" takes the pot; a fold gives it to the bettor. You are Player {player}.")

    def private(self, state: Any, player: int) -> str:
        card = state.history()[player]
        return f"Your card: {_KUHN_CARDS[card]}."

    def move(self, state: Any, player: int, action: int) -> str:
        return f"Player {player} {self._verb(state, action)}."

    def move_name(self, state: Any, player: int, action: int) -> str:
        return state.action_to_string(player, action)

    @staticmethod
    def _verb(state: Any, action: int) -> str:
        facing_bet = 1 in state.history()[2:]  # a bet so far: pass folds and bet calls
        if action == 0:
            return "folds" if facing_bet else "checks"
        return "calls" if facing_bet else "bets"


_LEDUC_RANKS = ("Jack", "Queen", "King")


class LeducText(GameText):
    aliases = {"call": ("check",), "raise": ("bet",)}

    def rules(self, player: int) -> str:
        return ("You are playing Leduc Poker against one opponent. The deck has six cards: two Jacks, two Queens"
                " and two Kings. Each player puts 1 chip in the pot and is dealt one private card. There are two"
                " betting rounds; after the first, one public card is turned face up. In each round a player may"
                " Raise (2 chips in the first round, 4 in the second; at most two raises a round), Call (match the"
                " bet; with nothing to match it is a check) or Fold (give up the pot). At the showdown a player"
                " whose card pairs the public card wins; otherwise the higher card wins; equal cards split the pot."
                f" You are Player {player}.")

    def private(self, state: Any, player: int) -> str:
        card = state.history()[player]
        public = _leduc_public_card(state)
        board = f" Public card: {_LEDUC_RANKS[public // 2]}." if public is not None else ""
        return f"Your card: {_LEDUC_RANKS[card // 2]}.{board} Chips in the pot: {_leduc_pot(state)}."

    def move(self, state: Any, player: int, action: int) -> str:
        return f"Player {player}: {state.action_to_string(player, action)}."

    def chance(self, state: Any, action: int, viewer: int) -> str | None:
        if len(state.history()) < 2:  # the private deal: told as the viewer's own card only
            return None
        return f"The public card is turned: {_LEDUC_RANKS[action // 2]}."


def _leduc_public_card(state: Any) -> int | None:
    info = state.information_state_string(0)
    marker = "[Public: "
    if marker not in info:
        return None
    return int(info.split(marker, 1)[1].split("]", 1)[0])


def _leduc_pot(state: Any) -> int:
    info = state.information_state_string(0)
    return int(info.split("[Pot: ", 1)[1].split("]", 1)[0])


class LiarsDiceText(GameText):
    aliases = {"liar": ("call liar", "challenge")}

    def rules(self, player: int) -> str:
        params = self.game.get_parameters()
        dice, sides = params.get("numdice", 1), params.get("dice_sides", 6)
        rolls = "one die" if dice == 1 else f"{dice} dice"
        return (f"You are playing Liar's Dice against one opponent. Each player rolls {rolls} of {sides} faces in"
                " secret. Players take turns to bid: the bid 'Q-F' claims that at least Q of all the dice"
                f" show face F, and a face of {sides} is wild (it counts as every face). Each bid must be higher than"
                " the last (more dice, or as many dice of a higher face). Instead of bidding you may call Liar: if"
                " the last bid was true its bidder wins, otherwise you win. Bids are listed as 'Q-F', for example"
                f" '2-3' (two 3s). You are Player {player}.")

    def private(self, state: Any, player: int) -> str:
        dice = state.information_state_string(player).split(" ")[0]
        return f"Your dice: {' '.join(dice)}."

    def move(self, state: Any, player: int, action: int) -> str:
        name = state.action_to_string(player, action)
        return f"Player {player} calls Liar." if name == "Liar" else f"Player {player} bids {name}."


class TicTacToeText(GameText):
    def rules(self, player: int) -> str:
        mark = "x" if player == 0 else "o"
        return ("You are playing tic-tac-toe. Players take turns to mark an empty cell of a 3x3 board: Player 0"
                " plays x, Player 1 plays o. Three marks in a row, column or diagonal win; a full board without one"
                f" is a draw. A move 'x(r,c)' marks row r, column c (each 0 to 2). You are Player {player} ({mark}).")

    def private(self, state: Any, player: int) -> str:
        return f"The board ('.' is empty):\n{state.observation_string(player)}"


_TEXTS: dict[str, type[GameText]] = {"kuhn_poker": KuhnText, "leduc_poker": LeducText, "liars_dice": LiarsDiceText,
                                     "tic_tac_toe": TicTacToeText}


def game_text(game: Any) -> GameText:
    """The wording of `game`: its own where this module has one (with its default parameters' shape), else generic."""
    cls = _TEXTS.get(game.get_type().short_name, GenericText)
    if cls in (KuhnText, LeducText) and game.num_players() != 2:
        cls = GenericText  # the poker texts word the two-player games
    return cls(game)
