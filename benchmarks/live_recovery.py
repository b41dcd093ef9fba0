"""Going on without a dead worker (``--on-failure continue``), and replacing it
(``--max-restarts 1``): the live-recovery tables of docs/reliability.md.

Per solver whose workers re-form their groups (real processes on this machine's cores), then
per solver whose dead workers can be replaced (emulated devices, ``--device-ms 30``: time for
a replacement to start): a run without a fault, and ``--runs`` runs of ``digits`` on 3
workers, 120 steps each, killing one worker (``--fault kill:RANK@STEP``, the rank and step
drawn). Per solver: how long from the kill until the survivors' re-formed group
(``went_on_s``) or the replacement's training (``healed_s``), the steps the replaced rank
missed, the survivors' steps lost and restarts (target 0 each), runs that did not finish or
hung (120 s), and the accuracy against the run without a fault.

    python benchmarks/live_recovery.py [--runs 5] [--parts re-form,healing] [--out docs/benchmarks/live_recovery.json]

(``--parts healing`` keeps the re-forming table of the file at ``--out``.)
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

from common import argument_parser
from kill_campaign import DISTSYNC, accuracy, has_passives, run_events, run_job, steps_done

from distsync.experiments.report import markdown_table
from distsync.metrics.repeats import median, spread
from distsync.solvers import Capability, solver_class, solver_names
from distsync.solvers.schedules import bipartite_roles

WORKERS, STEPS = 3, 120


def train(out: Path, *args: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A run of ``digits`` (its record, and its summary), a hang after 120 s."""
    return run_job([*DISTSYNC, "train", "--workload", "digits", "--workers", str(WORKERS), "--steps", str(STEPS),
                    "--eval-every", "60", "--seed", "1", "--out", str(out), *args], out, WORKERS, hang_s=120)


def solver_runs(tmp: Path, solver: str, runs: int, rng: random.Random, *extra: str) -> dict[str, Any]:
    """A clean run of ``solver`` and ``runs`` runs each killing a worker (with ``extra``
    arguments; a solver whose passive workers let replacements in: one of its active ones)."""
    _, clean = train(tmp / f"{solver}-{'heal-' if extra else ''}clean", "--solver", solver, *extra)
    ranks = bipartite_roles(WORKERS)[0] if extra and has_passives(solver) else range(WORKERS)
    out_runs = []
    for i in range(runs):
        rank, step = rng.choice(ranks), rng.randint(10, 60)
        out = tmp / f"{solver}-{'heal-' if extra else ''}{i}"
        rec, s = train(out, "--solver", solver, "--fault", f"kill:{rank}@{step}", *extra)
        run = {"fault": f"kill:{rank}@{step}", "finished": rec["finished"], "hung": rec["hang"]}
        if run["finished"]:
            [f] = s["recovery"]["faults"]
            done = steps_done(run_events(out), WORKERS)
            run.update(went_on_s=f.get("went_on_s"), restarts=s["recovery"]["restarts"],
                       steps_lost=sum(STEPS - n for r, n in done.items() if r != rank), final_metric=s["final_metric"],
                       healed_s=f.get("healed_s"), replaced_rank_steps_lost=f.get("replaced_rank_steps_lost"))
        out_runs.append(run)
    print(f"{solver}{' (healing)' if extra else ''}: {sum(r['finished'] for r in out_runs)} of {runs} finished",
          flush=True)
    return {"solver": solver, "clean_metric": (clean or {}).get("final_metric"), "runs": out_runs}


def render(raw: dict[str, Any]) -> dict[str, str]:
    """The tables of docs/reliability.md: ``live_recovery`` (going on without the dead worker)
    and ``live_recovery_healing`` (its replacement)."""
    rows, healing = [], []
    for row in raw["solvers"]:
        done = [r for r in row["runs"] if r["finished"]]
        went = spread(r.get("went_on_s") for r in done)
        rows.append([row["solver"], len(row["runs"]), len(done),
                     f"{went[0] * 1000:.0f} / {went[2] * 1000:.0f}" if went else "n/a (nothing to re-form)",
                     sum(r["steps_lost"] for r in done), sum(r["restarts"] for r in done),
                     accuracy([row["clean_metric"]], [r["final_metric"] for r in done]) or "n/a"])
    for row in raw["healing"]:
        done = [r for r in row["runs"] if r["finished"]]
        heal = [r for r in done if r.get("healed_s") is not None]
        healed = spread(r["healed_s"] for r in heal)
        missed = median(r["replaced_rank_steps_lost"] for r in heal)
        healing.append([row["solver"], len(row["runs"]), len(done), len(heal),
                        f"{healed[0]:.2f} / {healed[2]:.2f}" if healed else "n/a",
                        "n/a" if missed is None else f"{missed:.0f}", sum(r["steps_lost"] for r in done),
                        accuracy([row["clean_metric"]], [r["final_metric"] for r in done]) or "n/a"])
    return {"live_recovery": "\n".join(markdown_table(
                ["solver", "kills", "finished", "went on (ms, median / max)", "survivors' steps lost", "restarts",
                 "accuracy (clean → killed, mean)"], rows)),
            "live_recovery_healing": "\n".join(markdown_table(
                ["solver (healing)", "kills", "finished", "replaced", "healed after (s, median / max)",
                 "replaced rank's steps missed (median)", "survivors' steps lost", "accuracy (clean → healed, mean)"],
                healing))}


def main() -> None:
    p = argument_parser(__doc__)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/benchmarks/live_recovery.json")
    p.add_argument("--parts", default="re-form,healing", help="which tables (default: both)")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    rng = random.Random(args.seed)
    kept = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {"solvers": [], "healing": []}
    raw = {"workers": WORKERS, "steps": STEPS, "runs": args.runs, **{k: kept[k] for k in ("solvers", "healing")}}
    with tempfile.TemporaryDirectory() as tmp:
        if "re-form" in parts:
            raw["solvers"] = [solver_runs(Path(tmp), s, args.runs, rng) for s in solver_names()
                              if Capability.REFORMS_WITHOUT_DEAD in solver_class(s).capabilities]
        if "healing" in parts:  # (Hogwild's threads: never healed)
            raw["healing"] = [solver_runs(Path(tmp), s, args.runs, rng, "--max-restarts", "1", "--device-ms", "30")
                              for s in solver_names() if Capability.HEALS_FROM_PEER in solver_class(s).capabilities
                              and solver_class(s).Plan.training_threads(solver_class(s).Options()) == 1]
    Path(args.out).write_text(json.dumps(raw, indent=1) + "\n")
    for text in render(raw).values():
        print()
        print(text)


if __name__ == "__main__":
    main()
