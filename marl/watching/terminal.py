"""Text that clients sent, made safe to print on an operator's terminal.

Agent tags, task ids, client ids, replies and error messages come from whoever holds a lease or calls a server. Printed
raw, an escape sequence among them acts on the terminal: `\\x1b[2J` clears the screen, `\\x1b]0;...\\x07` sets the
window title, and worse on some terminals. `safe` shows every control character as an escape (`\\x1b`) instead.

rich is not enough on its own: `Console.print` drops only BEL, backspace, VT, FF and CR
(`rich.control.strip_control_codes`) and lets ESC through, so the table here covers every C0 and C1 control, DEL,
and the bidirectional-text controls that can make a line read differently from what it holds.

`servers/episodes/view.py` has its own copy of this (a server never imports marl/ beyond the protocol); keep the two
alike.
"""

from __future__ import annotations

__all__ = ["safe"]

_BIDI = [*range(0x200E, 0x2010), *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_CONTROLS = [*range(0x20), 0x7F, *range(0x80, 0xA0), *_BIDI]
_ESCAPES = {cp: f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}" for cp in _CONTROLS if cp != 0x09}  # tabs stay
_ESCAPES_KEEPING_NEWLINES = {cp: text for cp, text in _ESCAPES.items() if cp != 0x0A}


def safe(text: object, *, newlines: bool = False) -> str:
    """`text` with every control character written as an escape (ESC as `\\x1b`); tabs stay. `newlines=True` keeps
    line breaks (multi-line observations and replies); else they are escaped too (one-line fields: a tag, an id)."""
    return str(text).translate(_ESCAPES_KEEPING_NEWLINES if newlines else _ESCAPES)
