"""What `marl plan` prints: per server, a table of its devices at rollouts and at a training step, then disk.

Its console (`plan_console`) is as wide as the terminal, or $COLUMNS when it is set: the tables' cells wrap (a long
word folds) and the lines around them wrap to fit it, at spaces only, each continuation indented under its line, and
no line ends in a space (`_say`: rich pads a table's title to the table's width, and leaves the space where it wraps
a text). Piped without $COLUMNS, 200 columns keep a log's rows whole.
"""

from __future__ import annotations

import os
import sys
import textwrap
from typing import IO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .memory import GB, Parts
from .topology_plan import ServerPlan, TopologyPlan

__all__ = ["plan_console", "print_plan"]

#: Width of a piped `marl plan` without $COLUMNS.
PIPED_WIDTH = 200


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.1f}"


def _biggest(parts: Parts | None, n: int = 3) -> str:
    if parts is None:
        return ""
    items = sorted(parts.items, key=lambda item: -item[1])[:n]
    return ", ".join(f"{what} {_gb(nbytes)}" for what, nbytes in items)


def server_table(plan: ServerPlan) -> Table:
    table = Table(show_lines=False)  # its title is `_say`'s line: rich pads a title to the table's width
    for column in ("device", "GB", "rollouts", "training step", "peak", "fits", "largest parts (GB)"):
        table.add_column(column, justify="left" if column in ("device", "largest parts (GB)") else "right",
                         overflow="fold")  # a narrow terminal wraps cells, and folds a word longer than its column
    for load in plan.devices:
        fits = load.peak <= load.capacity
        busiest = load.step if load.step is not None and load.step.total >= load.rollouts.total else load.rollouts
        table.add_row(load.device, _gb(load.capacity), _gb(load.rollouts.total),
                      _gb(load.step.total) if load.step is not None else "-", _gb(load.peak),
                      "[green]yes[/]" if fits else "[red]no[/]", _biggest(busiest))  # fmt: skip
    return table


#: What the rollouts row assumes of a trainer rank's CUDA caching allocator (memory.py, "allocator residue").
RESERVED_FOOTNOTE = ("rollouts assume each trainer rank empties its CUDA cache (gc, empty_cache, synchronize) after"
                     " every command, before vLLM wakes: only live shards + allocator residue stay")


def _box_lines(server: ServerPlan) -> list[str]:
    """The footnote on reserved memory, a checkpoint's moment, the weights' way, disk and host memory."""
    lines = []
    if any(load.step is not None for load in server.devices) and server.devices[0].device != "host":
        lines.append(RESERVED_FOOTNOTE)
    for load in server.devices:
        if load.save is not None:
            lines.append(f"checkpoint (vLLM awake): {load.device} {_gb(load.save.total)} GB (rollouts +"
                         f" {_biggest(Parts(load.save.items[-1:]))})")
    if server.weights is not None:
        lines.append(f"weights: {server.weights}; disk per step: {_gb(server.disk_per_step.total)} GB"
                     + (f"; a checkpoint every {server.save_every} steps: {_gb(server.disk_per_checkpoint.total)} GB"
                        f" ({_biggest(server.disk_per_checkpoint)})" if server.disk_per_checkpoint.items else ""))
    if server.host is not None:
        lines.append(server.host.line())
    return lines


def plan_console(file: IO[str] | None = None) -> Console:
    """The console `marl plan` prints to (`file`: stdout): the terminal's width, or $COLUMNS, else `PIPED_WIDTH`."""
    out = file or sys.stdout
    columns = os.environ.get("COLUMNS", "")
    sized = columns.isdigit() or (hasattr(out, "isatty") and out.isatty())
    return Console(file=out, highlight=False, width=None if sized else PIPED_WIDTH)  # None: rich reads them


def _say(console: Console, text: str, *, indent: str = "", lead: str = "", style: str = "") -> None:
    """`lead` (in `style`) and `text` as one paragraph, wrapped at spaces to the console's width (a word wider than
    the whole line folds), continuation lines indented two more, no line ending in a space."""
    lines = textwrap.wrap(lead + text, width=console.width, initial_indent=indent, subsequent_indent=indent + "  ",
                          break_on_hyphens=False) or [""]
    paragraph = Text("\n".join(lines))
    paragraph.stylize(style, len(indent), len(indent) + len(lead))
    console.print(paragraph, soft_wrap=True)  # wrapped already: rich neither wraps nor pads it


def print_plan(plan: TopologyPlan, console: Console) -> None:
    for server in plan.servers:
        if server.devices:
            _say(console, server.summary, lead=f"{server.server}: ", style="bold")
            console.print(server_table(server))
        for note in server.notes:
            _say(console, note, indent="  ")
        for key, value in server.defaults.items():
            flag = "--" + key.replace(".", "-").replace("_", "-")
            _say(console, f"sized by the plan: servers.{server.server}.{key} = {value} (`marl run` passes it to the"
                          f" servers it starts; on a remote box give `marl serve` {flag} {value})", indent="  ")
        for line in _box_lines(server):
            _say(console, line, indent="  ")
        console.print()
    if plan.skipped:
        _say(console, f"not planned (no placement: their devices are not in the topology): {', '.join(plan.skipped)}")
    for problem in plan.problems:
        _say(console, f"{problem.key}: {problem.message}", lead="does not fit: ", style="red")
    if not plan.problems:
        _say(console, "every planned device holds its peak", lead="fits: ", style="green")
