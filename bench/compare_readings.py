"""Do two readings of the same policy agree, state by state? Two `exploitability.json` reports of `marl eval
--exploitability` (say one sampled, one `--exact`) of one checkpoint: at every information state both read, the
difference of each move's probability in standard errors of the sampled one, and Pearson's χ² over the states.

    python bench/compare_readings.py SAMPLED.json EXACT.json --checkpoint 0
    python bench/compare_readings.py --smoke        # seconds: two readings of a made-up policy

A state's standard error is the binomial one of its sampled reading, sqrt(p (1 - p) / n), with p the other reading's
probability (the exact one, where one is exact); a state with p of 0 or 1 is left out. Pearson's χ² over the k
states left has k degrees of freedom if the two agree, and its p-value says how often agreeing readings would
differ as much. Two-move games (Kuhn Poker): one z per state, on the second move.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

from scipy.stats import chi2


def states_of(doc: dict, checkpoint: str) -> dict[tuple[str, str], dict]:
    """(role, information state) -> the state's reading, for the policies of `checkpoint` ("0" and "initial" alike)."""
    same = {checkpoint} | ({"0", "initial"} if checkpoint in ("0", "initial") else set())
    return {(p["role"], s["info_state"]): s for p in doc["policies"] if p["checkpoint"] in same for s in p["states"]}


def compare(sampled: dict, other: dict, checkpoint: str) -> tuple[list[tuple[str, str, float, float, float]], float]:
    """Per shared state (role, state, sampled, other, z) on the last move, and χ²."""
    a, b = states_of(sampled, checkpoint), states_of(other, checkpoint)
    rows = []
    for key in sorted(set(a) & set(b)):
        p, q, n = a[key]["probabilities"][-1], b[key]["probabilities"][-1], a[key]["samples"]
        if 0 < q < 1 and n:
            rows.append((*key, p, q, (p - q) / math.sqrt(q * (1 - q) / n)))
    return rows, sum(z * z for *_, z in rows)


def report(rows: list, chi_square: float) -> str:
    lines = [f"{role:>10} {state:>8}  sampled {p:.3f}  other {q:.3f}  z {z:+.2f}" for role, state, p, q, z in rows]
    lines.append(f"χ² = {chi_square:.1f} on {len(rows)} degrees of freedom, p = {chi2.sf(chi_square, len(rows)):.2f}")
    return "\n".join(lines)


def smoke() -> None:
    """A policy that bets a third of the time, read exactly and as 90 replies of 30 bets a state."""
    def doc(probability: list[float], samples: int) -> dict:
        states = [{"info_state": key, "samples": samples, "probabilities": probability} for key in ("0", "1", "2")]
        return {"policies": [{"role": "player_0", "checkpoint": "0", "states": states}]}
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / "sampled.json", Path(tmp) / "exact.json"]
        paths[0].write_text(json.dumps(doc([2 / 3, 1 / 3], 90)))
        paths[1].write_text(json.dumps(doc([2 / 3, 1 / 3], 0)))
        rows, chi_square = compare(*(json.loads(p.read_text()) for p in paths), "initial")
    print(report(rows, chi_square))
    assert len(rows) == 3 and chi_square < 1e-9, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sampled", nargs="?", type=Path, help="the sampled reading's exploitability.json")
    parser.add_argument("other", nargs="?", type=Path, help="the other reading's exploitability.json (say --exact)")
    parser.add_argument("--checkpoint", default="0", help="the checkpoint both read (default 0: the initial model)")
    parser.add_argument("--smoke", action="store_true", help="two readings of a made-up policy")
    args = parser.parse_args()
    if args.smoke:
        return smoke()
    if args.sampled is None or args.other is None:
        parser.error("two exploitability.json files are required (or --smoke)")
    rows, chi_square = compare(json.loads(args.sampled.read_text()), json.loads(args.other.read_text()),
                               args.checkpoint)
    if not rows:
        sys.exit(f"no information state of checkpoint {args.checkpoint} is in both reports")
    print(report(rows, chi_square))


if __name__ == "__main__":
    main()
