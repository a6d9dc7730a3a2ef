"""Evaluation: games between fixed checkpoints, served statically, with confidence intervals.

    stats.py      Wilson intervals for win rates, Student-t intervals for mean rewards, per-role summaries
    pairings.py   which snapshot plays each role; one pairing's games on static servers (same seeds every pairing)
    matrix.py     a matrix of pairings: play them, write eval.json, eval.csv, eval.png
    command.py    `marl eval` (`add_eval_parser` adds it to the `marl` command)
    periodic.py   `run.eval_every`: `marl run` evaluates its checkpoints as training goes, into evals.jsonl

Snapshots (checkpoint paths, the static server processes) are marl/league/snapshots.py; docs/eval.md is the user's
guide.
"""
