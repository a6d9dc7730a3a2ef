"""`SignallingGame`: the first learnable game. A speaker names a target; a listener picks it out.

    speaker   sees the items and the target; says a short free-text message (at most 20 words are kept)
    listener  sees the same items in its own shuffled order and the message; replies with a number (or a name)
    reward    1.0 to both if the listener picked the target, else 0.0

With `observers=N`, agents observer_0 ... observer_{N-1} (role "observer") are extra listeners: each sees the
message and its own shuffled items, and guesses after the listener (nobody sees another's guess). Each guesser
gets 1.0 for its own right guess; the speaker gets the fraction of guessers who were right (with no observers: the
listener's reward), so it is rewarded for messages every guesser can decode.

Optional shaping (off by default): `naming_bonus=b` adds b to the speaker's reward when its message names the
target and no other item. A 135M model rarely names anything at first, and the listener can only learn to decode
messages that carry the target; the bonus gets that loop going. The game's outcome (the listener's pick) is unchanged,
and so is the team's goal (`goal_met`, what `marl eval` counts as a win): a speaker paid its bonus while the
listener picked wrong did not win.

The same seed gives the same items and target, so GRPO repeats of a task (one group) play the same task. The
guessers' shuffled orders are the task's too by default (`orders="task"`); with `orders="episode"` each episode of
a task has its own, the target moving one position on with each episode (`reset`'s `EPISODE_OPTION`, which `marl
run` numbers): then every position wins in about the same share of a group's episodes, and only following the
message earns an advantage (docs/design.md, "Why the collapse feeds itself"). The same seed and episode give the
same game either way.
Fallbacks (after `max_invalid_retries` invalid replies in a row, default 2; 0 gives one try): the speaker says
nothing; a guesser picks nothing, which loses (reward 0.0).
"""

from __future__ import annotations

import random
from typing import Any

from envs.base import InvalidAction, TextAECEnv, episode_of, match_choice, named_options, printable

#: Short, distinct items; no item's words contain another item's name.
ITEMS = (
    "red apple", "blue car", "green frog", "yellow sun", "black cat", "white cloud", "orange fish", "purple hat",
    "brown dog", "pink flower", "gray rock", "silver key", "gold ring", "small boat", "big tree", "wooden chair",
    "glass cup", "paper kite", "striped sock", "round cake", "old book", "tall tower", "soft pillow", "bright star",
)

MAX_WORDS = 20
ORDERS = ("task", "episode")  # what the guessers' shuffled orders are drawn per


class SignallingGame(TextAECEnv):
    metadata = {"name": "signalling_v0", "render_modes": ["human", "ansi"], "is_parallelizable": False}
    possible_agents = ["speaker", "listener"]
    choice_prompt = "Reply with the number or the name of your choice."

    def __init__(self, num_items: int = 3, items: tuple[str, ...] = ITEMS, observers: int = 0,
                 naming_bonus: float = 0.0, max_invalid_retries: int = 2, orders: str = "task",
                 render_mode: str | None = None):
        if not 2 <= num_items <= len(items):
            raise ValueError(f"num_items must be between 2 and {len(items)} (the number of items); got {num_items}")
        if observers < 0:
            raise ValueError(f"observers must be 0 or more; got {observers}")
        if naming_bonus < 0:
            raise ValueError(f"naming_bonus must be 0 or more; got {naming_bonus}")
        if orders not in ORDERS:
            raise ValueError(f"orders must be one of {', '.join(ORDERS)}; got {orders!r}")
        if max_invalid_retries < 0:
            raise ValueError(f"max_invalid_retries must be 0 or more; got {max_invalid_retries}")
        self.max_invalid_retries, self.orders_per = max_invalid_retries, orders
        self.naming_bonus = float(naming_bonus)
        self.guessers = ["listener"] + [f"observer_{i}" for i in range(observers)]
        self.possible_agents = ["speaker", *self.guessers]
        super().__init__(render_mode=render_mode)
        self.num_items, self.item_pool = num_items, tuple(items)
        self.items: list[str] = []
        self.target = ""
        self.orders: dict[str, list[str]] = {}  # each guesser's shuffled items
        self.message: str | None = None
        self.choices: dict[str, str] = {}  # guesser -> the item it picked ("" for none)

    @property
    def listener_items(self) -> list[str]:
        return self.orders["listener"]

    @property
    def choice(self) -> str | None:
        """The listener's pick (None before it picked, "" for none)."""
        return self.choices.get("listener")

    # --- hooks ---------------------------------------------------------------------------------------------------

    def _reset_game(self, seed: int | None, options: dict | None) -> None:
        self.items = self.rng.sample(self.item_pool, self.num_items)
        self.target = self.rng.choice(self.items)
        if self.orders_per == "episode":
            self.orders = self._episode_orders(episode_of(options))
        else:
            self.orders = {g: self.rng.sample(self.items, len(self.items)) for g in self.guessers}
        self.message, self.choices = None, {}
        self.agent_selection = "speaker"

    def _episode_orders(self, episode: int) -> dict[str, list[str]]:
        """Each guesser's order in this episode of the task: the target at the task's position for that guesser
        plus `episode` (so the episodes of a group put it at each position equally often, give or take one), the
        other items shuffled from the task's seed and the episode."""
        shuffler = random.Random(f"{self.rng.getrandbits(64)}/{episode}")
        others = [item for item in self.items if item != self.target]
        orders = {}
        for guesser in self.guessers:
            order = shuffler.sample(others, len(others))
            order.insert((self.rng.randrange(self.num_items) + episode) % self.num_items, self.target)
            orders[guesser] = order
        return orders

    def role_of(self, agent: str) -> str:
        return "observer" if agent.startswith("observer") else agent

    def system_prompt(self, agent: str) -> str:
        if agent == "speaker":
            return ("You are the speaker in a guessing game. The listener sees the same items and must pick the "
                    "target. Reply with the target item's name, nothing else.")
        return (f"You are the {self.role_of(agent)} in a guessing game. The speaker describes one item. "
                "Pick that item.")

    def _observe_text(self, agent: str) -> str:
        if agent == "speaker":
            if self.message is None:
                return (f"Items: {', '.join(self.items)}.\nTarget: {self.target}.\n"
                        "Which item is the target?")
            if len(self.choices) < len(self.guessers):
                return f"You said: {self.message or '(nothing)'}\nWaiting for the guesses."
            right = sum(c == self.target for c in self.choices.values())
            return (f"You said: {self.message or '(nothing)'}\n{right} of {len(self.guessers)} picked the target, "
                    f"{self.target}.")
        if self.message is None:
            return "Wait for the speaker."
        said = f'The speaker said: "{self.message}"' if self.message else "The speaker said nothing."
        if agent not in self.choices:
            return f"{said}\nWhich item did the speaker mean?"
        picked = f"You picked {self.choices[agent]}." if self.choices[agent] else "You picked nothing."
        won = "You win." if self.choices[agent] == self.target else "You lose."
        return f"{said}\n{picked} The target was {self.target}. {won}"

    def _legal_actions(self, agent: str) -> list[str] | None:
        return None if agent == "speaker" else list(self.orders[agent])

    def _parse(self, agent: str, text: str) -> Any:
        if agent == "speaker":
            words = printable(text).split()
            if not words:
                raise InvalidAction("say at least one word")
            return " ".join(words[:MAX_WORDS])
        return super()._parse(agent, text)

    def _fallback(self, agent: str) -> Any:
        return ""  # the speaker says nothing; the listener picks nothing (and loses)

    def _apply(self, agent: str, action: Any) -> None:
        if agent == "speaker":
            self.message = action
            self.agent_selection = self.guessers[0]
            return
        self.choices[agent] = action
        if len(self.choices) < len(self.guessers):
            self.agent_selection = self.guessers[len(self.choices)]
            return
        right = {g: 1.0 if self.choices[g] == self.target else 0.0 for g in self.guessers}
        named = self.names_target(self.message or "")
        for a in self.agents:
            self.rewards[a] = right[a] if a in right else sum(right.values()) / len(right) + self.naming_bonus * named
            self.terminations[a] = True
            self.infos[a].update(target=self.target, choices=dict(self.choices), message=self.message,
                                 names_target=named)

    def goal_met(self, agent: str) -> bool | None:
        """The team's goal is the listener picking the target: the speaker met it when the listener did, each
        observer by its own pick. The naming bonus is shaping, not the goal. None until every guesser picked."""
        if len(self.choices) < len(self.guessers):
            return None
        return self.choices[agent if agent in self.guessers else self.guessers[0]] == self.target

    def action_labels(self) -> dict[str, list[str]]:
        """What each agent did, as a category (`marl run` shows their shares, where a collapse shows first): a
        guesser the position it picked in its own order ("pick 2", "pick none"), the speaker whether its message
        names the target ("names target", "names another", "names several", "names none")."""
        labels = {}
        for guesser, choice in self.choices.items():
            order = self.orders[guesser]
            labels[guesser] = [f"pick {order.index(choice) + 1}" if choice in order else "pick none"]
        if self.message is not None:
            named = named_options(self.message, self.items)
            labels["speaker"] = ["names none" if not named else "names several" if len(named) > 1
                                 else "names target" if self.items[named[0]] == self.target else "names another"]
        return labels

    def summary(self) -> dict[str, Any]:
        """The items, the target, what the speaker said and what each guesser picked ("" for nothing)."""
        return {"items": list(self.items), "target": self.target, "message": self.message,
                "orders": {g: list(order) for g, order in self.orders.items()}, "choices": dict(self.choices),
                "names_target": self.names_target(self.message or "") if self.items else False}

    def names_target(self, message: str) -> bool:
        """Whether `message` names the target and no other item (by name: a bare number names nothing here)."""
        return named_options(message, self.items) == [self.items.index(self.target)]

    def scripted_action(self, agent: str) -> str:
        if agent == "speaker":
            return self.target
        index = match_choice(self.message or "", self.orders[agent])
        return str(1 if index is None else index + 1)
