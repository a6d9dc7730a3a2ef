"""Evaluation: games between fixed checkpoints, served statically, with confidence intervals.

    stats.py      Wilson intervals for win rates, Student-t intervals for mean rewards, per-role summaries
    pairings.py   which snapshot plays each role; one pairing's games on static servers (same seeds every pairing)
    matrix.py     a matrix of pairings: play them, write eval.json, eval.csv, eval.png
    command.py    `marl eval` (`add_eval_parser` adds it to the `marl` command)
    periodic.py   `run.eval_every`: `marl run` evaluates its checkpoints as training goes, into evals.jsonl

Exploitability (two-player zero-sum games a solver can check):

    info_states.py            each information state of the game, and the conversation an agent gets there
    policy_reading.py         a role's policy read off its server at every state (sampled, or exactly when held)
    exploitability.py         OpenSpiel's best response against it, bootstrap intervals, reference points
    exploit_command.py        `marl eval --exploitability`
    exploitability_curve.py   `run.eval_exploitability`: each periodic evaluation's figure, into exploitability.jsonl

Snapshots (checkpoint paths, the static server processes) are marl/league/snapshots.py; docs/eval.md is the user's
guide.
"""
