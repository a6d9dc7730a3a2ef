"""Text games for LLM agents: PettingZoo AEC environments whose observations and actions are text (docs/envs.md).

This package knows observations, actions and rewards only: it never imports `servers/` or `marl/`.
"""

from envs.adapter import TextAdapter, text_tictactoe
from envs.base import InvalidAction, TextAECEnv, TextObservation, match_choice, play, printable
from envs.signalling import SignallingGame

__all__ = ["InvalidAction", "SignallingGame", "TextAECEnv", "TextAdapter", "TextObservation", "match_choice", "play",
           "printable", "text_tictactoe"]
