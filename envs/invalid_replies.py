"""`InvalidReplies`: how a `TextAECEnv` treats replies it cannot parse (docs/envs.md "Invalid replies").

An invalid reply does not advance the game: the agent is asked again, and its next observation ends with the retry
line (`Your reply "..." was not valid: <reason>. Try again (N tries left).`). After `max_invalid_retries` retries
in a row the env applies its fallback instead. Every reply, every invalid one and every fallback is counted per
agent (`TextAECEnv.replies`, `invalid_actions`, `fallbacks`; per role in the `*_by_role` properties). One
`InvalidReplies` lasts one game; the env supplies the reasons (its `InvalidAction`s, else `default_reason`).
"""

from __future__ import annotations

from collections.abc import Iterable


class InvalidReplies:
    """One game's reply counts per agent, the retry streaks, and the retry line each agent is shown now."""

    def __init__(self, agents: Iterable[str] = ()):
        agents = list(agents)
        self.replies = dict.fromkeys(agents, 0)  # every reply of a live agent, valid or not
        self.invalid = dict.fromkeys(agents, 0)
        self.fallbacks = dict.fromkeys(agents, 0)
        self.retry_lines: dict[str, str] = {}  # agent -> the line its observation ends with until it replies validly
        self._streak = dict.fromkeys(agents, 0)

    def rejected(self, agent: str, snippet: str, reason: str, max_retries: int) -> bool:
        """Count an invalid reply (`snippet`: its start, as the retry line quotes it). True: ask `agent` again, with
        the retry line; False: too many in a row, so the env applies its fallback (counted)."""
        self.invalid[agent] += 1
        self._streak[agent] += 1
        if self._streak[agent] <= max_retries:
            left = max_retries - self._streak[agent] + 1
            self.retry_lines[agent] = (f'Your reply "{snippet}" was not valid: {reason}.'
                                       f" Try again ({left} {'try' if left == 1 else 'tries'} left).")
            return True
        self.fallbacks[agent] += 1
        return False

    def accepted(self, agent: str) -> None:
        """`agent`'s action (its reply or the fallback) is played: its streak and retry line end."""
        self._streak[agent] = 0
        self.retry_lines.pop(agent, None)


def default_reason(legal: list[str] | None, numbered: bool) -> str:
    """Why a reply was invalid, when `_parse` did not say: what a valid one looks like."""
    if legal is None:
        return "say something"
    if not legal:
        return "there is nothing to choose"
    return f"reply with one number from 1 to {len(legal)}" if numbered else "reply with one option"


