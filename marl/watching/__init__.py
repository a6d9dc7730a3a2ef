"""Watching a run: `marl overwatch` (overwatch.py), curves (plot.py), the collapse warning (collapse.py), the
topology's picture (topology_view.py), and text made safe for a terminal (terminal.py)."""
