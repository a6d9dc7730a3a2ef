"""`marl eval TOPOLOGY [ROLE=CHECKPOINTS ...] [key=value ...]`: games between fixed checkpoints, with intervals.

    marl eval topologies/signalling-cpu.yaml                                  # latest against latest, greedy
    marl eval topologies/signalling-cpu.yaml listener=initial                 # the trained speaker, a fresh listener
    marl eval topologies/signalling-cpu.yaml listener=0,5,10,20 speaker=0,5,10,20 --games 32   # a 4 × 4 matrix

A `ROLE=...` argument names a role (no dot) and one checkpoint or a comma-separated list: `initial` (the server's
`model:`), `latest` (its newest checkpoint; the default), a step (`5`, `v5`) or a checkpoint directory. A role of a
LoRA policy (`roles.R.policy`) plays that policy's checkpoints: its adapter on the server's model (`initial`: the
model alone). Every combination is a pairing. Checkpoints are read from the run directory (`run.run_dir`, or
`--run-dir`). A dotted `key=value` is a topology override, as for `marl run`. Every pairing plays the same `--games`
seeds.

Prints per pairing and role: win rate and mean reward with 95% intervals, and the valid-reply rate; writes
eval.json, eval.csv and (for a matrix) eval.png into `--out` (default `<run dir>/eval`). Exits 2 on a bad topology
or checkpoint, 1 when a pairing's games keep failing.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path


def _count(text: str) -> int:
    """A number of games, games in flight or servers: 0 would print an empty table as if measured."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """`marl eval`: add to `marl.cli.build_parser`'s subcommands (cheap: the command imports what it runs)."""
    parser = sub.add_parser("eval", help="play fixed checkpoints against each other; win rates with 95%% intervals",
                            description=__doc__.split("\n\n", 1)[1],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", help="topology YAML of the run, e.g. topologies/signalling-cpu.yaml")
    parser.add_argument("pairs", nargs="*", metavar="ROLE=CHECKPOINTS|key=value",
                        help="checkpoints of a role (initial, latest, a step, a directory; comma-separated for a"
                             " matrix), or a topology override with a dotted key")
    parser.add_argument("--games", type=_count, default=16, help="games per pairing (default 16)")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default 0, greedy; with"
                                                          " --exploitability run.temperature)")
    parser.add_argument("--seed", type=int, help="seed of the games (default: run.seed)")
    parser.add_argument("--concurrency", type=_count, default=4, help="games in flight (default 4)")
    parser.add_argument("--run-dir", help="the run whose checkpoints to play (default: run.run_dir)")
    parser.add_argument("--out", help="where eval.json, eval.csv and eval.png go (default: <run dir>/eval)")
    parser.add_argument("--role", help="the one role whose win rate eval.png shows (default: every evaluated role,"
                                       " side by side)")
    parser.add_argument("--max-servers", type=_count, default=4,
                        help="static servers running at once (default 4); a matrix restarts the others as needed")
    solver = parser.add_argument_group("exploitability (docs/eval.md): two-player zero-sum OpenSpiel games, and"
                                       " TextArena's KuhnPoker-v0")
    solver.add_argument("--exploitability", action="store_true",
                        help="measure each role's policy against OpenSpiel's exact best response instead of playing")
    solver.add_argument("--samples", type=int, default=64,
                        help="replies per information state (default 64: a move's share within about ±0.12)")
    solver.add_argument("--exact", action="store_true",
                        help="read roles held to the moves (roles.R.sampling.choice) exactly from their token logprobs,"
                             " one call a move, instead of --samples replies: no sampling noise, tens of times faster")
    solver.add_argument("--bootstrap", type=int, default=1000, help="bootstrap replicates of the interval (1000)")
    solver.add_argument("--diagonal", action="store_true",
                        help="profiles pair the i-th checkpoint of every role (a curve), not every combination")
    solver.add_argument("--average", action="store_true",
                        help="also the profile in which each role plays the mixture of its checkpoints (one drawn per"
                             " game: the average strategy), read as one policy by reach-weighting them")
    solver.add_argument("--table", action="store_true", help="print every information state's probabilities")
    solver.add_argument("--json", action="store_true", help="print the report as one JSON document")
    solver.add_argument("--plot", help="draw the profiles' exploitability to this PNG (with --diagonal: a curve)")
    parser.set_defaults(func=run_eval_command, trailing="pairs")


def split_arguments(pairs: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """(role -> its checkpoints, topology overrides): a key with a dot is an override, one without names a role."""
    choices: dict[str, list[str]] = {}
    overrides = []
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"{pair!r}: expected ROLE=CHECKPOINTS (e.g. listener=0,5,10) or key=value")
        if "." in key:
            overrides.append(pair)
        else:
            choices[key] = [ref.strip() for ref in value.split(",") if ref.strip()] or ["latest"]
    return choices, overrides


def run_eval_command(args: argparse.Namespace) -> None:
    if args.exploitability:
        from marl.eval.exploit_command import run_exploitability_command
        run_exploitability_command(args, split_arguments)
        return
    from rich.console import Console

    from marl.eval.matrix import evaluate, results_table, write_outputs
    from marl.eval.pairings import EvalFailed, EvalSettings, fleet_devices, plan_pairings, run_dir_of
    from marl.league.snapshots import StaticFleet
    from marl.topology import Topology

    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
    try:
        choices, overrides = split_arguments(args.pairs)
        topology = Topology.load(args.file, overrides)
        run_dir = run_dir_of(topology, args.run_dir)
        pairings = plan_pairings(topology, run_dir, choices)
    except ValueError as exc:  # a TopologyError, a SnapshotError, a malformed ROLE=CHECKPOINTS
        print(f"marl eval: error: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.role is not None and args.role not in topology.spec.roles:
        print(f"marl eval: error: --role {args.role}: no such role ({', '.join(topology.spec.roles)})",
              file=sys.stderr)
        sys.exit(2)
    run = topology.spec.run
    settings = EvalSettings(games=args.games, seed=run.seed if args.seed is None else args.seed,
                            temperature=0.0 if args.temperature is None else args.temperature,
                            concurrency=args.concurrency, max_tokens=run.max_tokens,
                            max_failures=run.max_failures, lease_timeout_s=run.lease_timeout_s)
    out = Path(args.out or run_dir / "eval")
    console.print(f"{len(pairings)} pairings × {settings.games} games (seed {settings.seed}, temperature"
                  f" {settings.temperature:g}); checkpoints from {run_dir}")
    fleet = StaticFleet(out / "logs", token=secrets.token_urlsafe(24), devices=fleet_devices(topology),
                        max_servers=args.max_servers)
    try:
        results = evaluate(topology, pairings, fleet, settings,
                           on_result=lambda r: console.print(f"played {r.pairing.label}"))
    except (EvalFailed, RuntimeError) as exc:
        print(f"marl eval: error: {exc}", file=sys.stderr)
        sys.exit(1)
    finally:
        fleet.close()
    console.print(results_table(results, settings.games))
    for path in write_outputs(out, topology, settings, results, args.role):
        console.print(str(path))


def main(argv: list[str] | None = None) -> None:
    """`python -m marl.eval.command ...`: `marl eval` on its own."""
    parser = argparse.ArgumentParser(prog="marl")
    add_eval_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["eval", *(sys.argv[1:] if argv is None else argv)])
    args.func(args)


if __name__ == "__main__":
    main()
