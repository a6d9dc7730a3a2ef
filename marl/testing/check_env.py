"""`marl check-env TARGET [--args ...] [--games N] [--model DIR]`: a new env played end to end through a real
swarm server, before anyone trains on it.

1. The env: TARGET is `module:Class` (or `module:factory`), `textarena:GAME-ID` or `openspiel:GAME`, constructed with
   `--args` (a JSON object, or `key=value` words whose values read as YAML); it is asked which roles it deals.
2. PettingZoo's `api_test` on it.
3. A trainable swarm server on 127.0.0.1 (`marl serve`, as `marl run` starts one) on a tiny random model built on the
   spot (or `--model`), playing every role: a topology of one server. `--games` games through the coordinator, as
   `marl run` plays them (`marl.testing.env_games`), and a GRPO step on their episodes.
4. What the server recorded (its ledger) against what the env paid: every role's episodes, samples and rewards
   (`marl.testing.env_report`).

It prints a line per stage, one per role, any warnings and problems, and the verdict: `check-env: OK` (exit 0) or
`check-env: FAILED: <reason>` (exit 1). A usage error (a target that does not import, an argument the env does not
take, --args that do not parse) is one line on stderr and exit 2. The ledger is read by `read_samples` (data dir ->
samples), which `marl/cli.py` hands in: marl/ reads a server's files only there.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from marl.testing.env_games import play_on_tiny_server
from marl.testing.env_report import LedgerSample, role_line, role_problems, tally_roles, warnings_of
from marl.testing.env_target import (
    CheckFailed,
    CheckOptions,
    UsageError,
    env_section,
    load_env,
    parse_env_args,
    run_api_test,
)

#: exit codes
OK, FAILED, USAGE = 0, 1, 2

ReadSamples = Callable[[Path], Sequence[LedgerSample]]


@contextlib.contextmanager
def work_dir(run_dir: Path | None) -> Iterator[Path]:
    """`run_dir` (kept), or a temporary directory removed afterwards."""
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        yield run_dir
        return
    with tempfile.TemporaryDirectory(prefix="marl-check-env-") as scratch:
        yield Path(scratch)


def check_env(options: CheckOptions, read_samples: ReadSamples, say: Callable[[str], None] = print) -> int:
    """Run the check (module docstring), telling `say` each line; returns the exit code. UsageError escapes."""
    started = time.monotonic()
    try:
        factory, args, roles = load_env(env_section(options.target, options.args))
        say(f"check-env {options.target}: roles {', '.join(f'{r} x{n}' for r, n in roles.items())}")
        run_api_test(factory, args)
        say("api_test: passed")
        with work_dir(options.run_dir) as work:
            played = play_on_tiny_server(options, roles, work, say)
            tallies = tally_roles(played.records, read_samples(played.data_dir), roles, played.server)
    except CheckFailed as exc:
        say(f"check-env: FAILED: {exc}")
        return FAILED
    problems = played.problems + [p for t in tallies.values() for p in role_problems(t)]
    for tally in tallies.values() if played.records else ():  # no game: nothing to say per role
        say(role_line(tally))
    for warning in warnings_of(tallies):
        say(f"warning: {warning}")
    for problem in problems[1:]:
        say(f"problem: {problem}")
    if options.run_dir is not None:
        say(f"kept in {options.run_dir}: `marl games show {options.run_dir}`, `marl episode list"
            f" {played.data_dir}`, the server's log {played.log_path}")
    say(f"done in {time.monotonic() - started:.0f}s")
    if problems:
        _keep_hint(options, say)
        more = f" (and {len(problems) - 1} more, above)" if len(problems) > 1 else ""
        say(f"check-env: FAILED: {problems[0]}{more}")
        return FAILED
    say("check-env: OK")
    return OK


def _keep_hint(options: CheckOptions, say: Callable[[str], None]) -> None:
    if options.run_dir is None:
        say("(--run-dir DIR keeps the server's log and ledger, the games and the topology, to look into)")


def main(args: Any, read_samples: ReadSamples) -> int:
    """`marl check-env` from its parsed arguments (marl/cli.py); returns the exit code."""
    try:
        if args.games < 1 or args.max_tokens < 1:
            raise UsageError(f"--games and --max-tokens must be at least 1 (got {args.games}, {args.max_tokens})")
        options = CheckOptions(target=args.target, args=parse_env_args(args.args or []), games=args.games,
                               model=args.model, run_dir=Path(args.run_dir) if args.run_dir else None,
                               max_tokens=args.max_tokens)
        return check_env(options, read_samples)
    except UsageError as exc:
        print(f"marl check-env: error: {exc}", file=sys.stderr)
        return USAGE
