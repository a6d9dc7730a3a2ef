"""Does learning hold on every seed? `marl run` a topology on several seeds, one after another, `marl eval` each run's
initial and latest checkpoints, and count the seeds on which every trainable role improved.

    python bench/seed_sweep.py topologies/signalling-lora.yaml --seeds 4,5,6
    python bench/seed_sweep.py topologies/signalling-cpu.yaml --seeds 1 train.overlap=true --out runs/sweep-overlap
    python bench/seed_sweep.py topologies/textarena-kuhn-poker.yaml --seeds 1,2 --against-initial --temperature 0.8
    python bench/seed_sweep.py --smoke        # a minute: a tiny model, one step, one seed, 4 games

Each seed runs `marl run FILE run.seed=S run.run_dir=OUT/seed-S [overrides]` (its output in OUT/seed-S/run.log),
then `marl eval FILE ROLE=initial... --games N --run-dir OUT/seed-S --seed S` with every role a trainable server
plays at its initial checkpoint (OUT/seed-S/eval-initial/), and the same with every role at its latest
(eval-latest/): greedy, the same games for both. `--mixed` plays every combination instead (a trained role beside an
untrained one too; OUT/seed-S/eval/), which takes twice as long. A role *improved* on a seed when its win rate with
every role at its latest checkpoint has a 95% interval wholly above its interval with every role at the initial one
(`marl eval` says which win rule it counted by). In a zero-sum game (Kuhn Poker) both sides cannot win more at once:
`--against-initial` (with every combination) judges each role by its win rate at its latest checkpoint against every
other role at its initial one instead. `--temperature` samples the evaluation's games (greedy by default). Prints
each seed's table as it finishes, then the share of seeds on which every role improved, and writes OUT/sweep.json.
A `train.` override applies to every trainable server.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from marl.topology import Topology  # noqa: E402

MARL = [sys.executable, "-m", "marl"]


def trainable_roles(topology: Topology) -> list[str]:
    """The roles a trainable server (or a LoRA policy of one) plays: the ones a sweep judges."""
    return [role for role, learner in topology.role_learners().items() if learner is not None]


def server_overrides(topology: Topology, overrides: list[str]) -> list[str]:
    """`train.X=V` becomes `servers.S.train.X=V` for every trainable server S; other overrides pass as they are."""
    out = []
    for item in overrides:
        if item.startswith("train."):
            out += [f"servers.{name}.{item}" for name in topology.trainable_servers()]
        else:
            out.append(item)
    return out


@dataclass(frozen=True)
class Judging:
    """How each seed's checkpoints are played and judged (see the module docstring)."""

    games: int = 128
    mixed: bool = False  # every combination of initial and latest, not only all-initial and all-latest
    against_initial: bool = False  # each role at its latest against the others at their initial (implies mixed)
    temperature: float = 0.0

    def evaluations(self) -> dict[str, str]:
        """Each `marl eval` to make: its output folder, and the checkpoints every role plays there."""
        if self.mixed or self.against_initial:
            return {"eval": "initial,latest"}
        return {"eval-initial": "initial", "eval-latest": "latest"}


def _initial(seat: dict) -> bool:
    return seat["version"] in (0, None)


def verdict(pairings: list[dict], roles: list[str], against_initial: bool = False) -> dict[str, dict]:
    """Per role: its win rate and interval at all-initial and at all-latest (`against_initial`: it alone at its
    latest), and whether it improved."""
    initial = next(p for p in pairings if all(_initial(s) for s in p["seats"].values()))
    out = {}
    for role in roles:
        if against_initial:
            latest = next(p for p in pairings if not _initial(p["seats"][role])
                          and all(_initial(s) for other, s in p["seats"].items() if other != role))  # fmt: skip
        else:
            latest = next(p for p in pairings if not any(_initial(s) for s in p["seats"].values()))
        before, after = initial["roles"][role], latest["roles"][role]
        out[role] = {"initial": before, "latest": after, "latest_label": latest["label"],
                     "win_rule": after.get("win_rule", ""),
                     "improved": after["win_low"] is not None and before["win_high"] is not None
                     and after["win_low"] > before["win_high"]}
    return out


def marl_run(file: str, seed: int, run_dir: Path, overrides: list[str]) -> float:
    """`marl run FILE run.seed=S run.run_dir=RUN_DIR [overrides]`, its output in RUN_DIR/run.log; its wall seconds.
    Exits with the reason when the run fails."""
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with (run_dir / "run.log").open("w") as log:
        run = subprocess.run([*MARL, "run", file, f"run.seed={seed}", f"run.run_dir={run_dir}", *overrides],
                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if run.returncode != 0:
        raise SystemExit(f"seed {seed}: marl run exited {run.returncode}; see {run_dir / 'run.log'}")
    return time.monotonic() - started


def run_seed(file: str, seed: int, out: Path, overrides: list[str], roles: list[str], judging: Judging) -> dict:
    """One seed: the run, then its evaluation (`judging`); returns the seed's verdict with the two commands' wall
    times."""
    run_dir = out / f"seed-{seed}"
    run_s = marl_run(file, seed, run_dir, overrides)
    started = time.monotonic()
    pairings = []
    for name, checkpoints in judging.evaluations().items():  # the same --seed: every pairing plays the same games
        pairings += evaluate(file, [f"{role}={checkpoints}" for role in roles], overrides, judging, run_dir, name,
                             seed)  # fmt: skip
    return {"seed": seed, "run_s": run_s, "eval_s": time.monotonic() - started,
            "roles": verdict(pairings, roles, judging.against_initial)}


def evaluate(file: str, pairs: list[str], overrides: list[str], judging: Judging, run_dir: Path, name: str,
             seed: int) -> list[dict]:  # fmt: skip
    """`marl eval` of these checkpoints into run_dir/name; its pairings (eval.json's)."""
    evaluation = subprocess.run([*MARL, "eval", file, *pairs, *overrides, "--games", str(judging.games),
                                 "--temperature", str(judging.temperature), "--run-dir", str(run_dir),
                                 "--out", str(run_dir / name), "--seed", str(seed)],
                                capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if evaluation.returncode != 0:
        raise SystemExit(f"seed {seed}: marl eval exited {evaluation.returncode}:\n{evaluation.stderr[-3000:]}")
    return json.loads((run_dir / name / "eval.json").read_text())["pairings"]


def _interval(stats: dict) -> str:
    return f"{stats['win_rate']:.0%} [{stats['win_low']:.0%}, {stats['win_high']:.0%}]"


def print_seed(result: dict) -> None:
    print(f"seed {result['seed']}: run {result['run_s'] / 60:.1f} min, eval {result['eval_s'] / 60:.1f} min")
    for role, v in result["roles"].items():
        print(f"  {role:10} initial {_interval(v['initial']):18} {v['latest_label']}: {_interval(v['latest']):18}"
              f" mean reward {v['initial']['mean_reward']:.2f} -> {v['latest']['mean_reward']:.2f}"
              f"  {'improved' if v['improved'] else 'NOT improved'} (wins by {v['win_rule']})", flush=True)


def sweep(file: str, seeds: list[int], out: Path, overrides: list[str], judging: Judging) -> list[dict]:
    topology = Topology.load(file, [])
    roles, overrides = trainable_roles(topology), server_overrides(topology, overrides)
    against = " against the initial others" if judging.against_initial else ""
    print(f"{file}: seeds {seeds}, judging {', '.join(roles)}{against}; {judging.games} games per pairing at"
          f" temperature {judging.temperature:g}; output in {out}", flush=True)
    results = []
    for seed in seeds:
        results.append(run_seed(file, seed, out, overrides, roles, judging))
        print_seed(results[-1])
    good = sum(all(v["improved"] for v in r["roles"].values()) for r in results)
    print(f"every trainable role improved on {good} of {len(results)} seeds"
          f" ({sum(r['run_s'] + r['eval_s'] for r in results) / 60:.0f} min in all)")
    (out / "sweep.json").write_text(json.dumps({"file": file, "overrides": overrides, **asdict(judging),
                                                "seeds": results, "improved_seeds": good}, indent=1))
    return results


SMOKE_TOPOLOGY = """\
name: sweep-smoke
servers:
  model: {{model: {model}, trainable: true, device: cpu, train: {{batch_size: 1, num_repeat: 2, save_freq: 1}}}}
roles:
  speaker: {{server: model}}
  listener: {{scripted: true}}
env: {{class: "envs.signalling:SignallingGame", args: {{num_items: 3}}}}
run: {{max_steps: 1, repeats: 2, concurrency: 2, max_tokens: 6}}
"""


def smoke() -> None:
    """One seed of a one-step run of a tiny model (the listener scripted), evaluated on 4 games."""
    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        topology = Path(tmp) / "topology.yaml"
        topology.write_text(SMOKE_TOPOLOGY.format(model=build_tiny_model(Path(tmp) / "tiny")))
        (result,) = sweep(str(topology), [0], Path(tmp) / "sweep", [], Judging(games=4))
        assert set(result["roles"]) == {"speaker"}, result
        (result,) = sweep(str(topology), [0], Path(tmp) / "sweep-against", [],
                          Judging(games=4, against_initial=True, temperature=0.8))  # fmt: skip
        assert result["roles"]["speaker"]["latest_label"] not in ("speaker=v0", "speaker=initial"), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", nargs="?", help="the topology YAML")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run (train.X: every server)")
    parser.add_argument("--seeds", default="4,5,6", help="comma-separated run seeds (default 4,5,6)")
    parser.add_argument("--games", type=int, default=128, help="games per eval pairing (default 128)")
    parser.add_argument("--out", type=Path, help="where the runs go (default runs/sweep-<topology name>)")
    parser.add_argument("--mixed", action="store_true", help="evaluate every combination of initial and latest")
    parser.add_argument("--against-initial", action="store_true", help="judge each role at its latest against the"
                        " others at their initial (zero-sum games; evaluates every combination)")
    parser.add_argument("--temperature", type=float, default=0.0, help="the evaluation's sampling (default 0: greedy)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one step, one seed")
    args = parser.parse_intermixed_args()  # overrides may come before or after the options
    if args.smoke:
        return smoke()
    if args.file is None:
        parser.error("the topology file is required (or --smoke)")
    out = args.out or Path("runs") / f"sweep-{Path(args.file).stem}"
    judging = Judging(args.games, args.mixed, args.against_initial, args.temperature)
    sweep(args.file, [int(s) for s in args.seeds.split(",")], out, args.overrides, judging)


if __name__ == "__main__":
    main()
