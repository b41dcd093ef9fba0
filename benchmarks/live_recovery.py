"""Going on without a dead worker (``--on-failure continue``), for every solver whose workers
re-form their groups.

For each solver: one run without a fault, then ``--runs`` runs each killing one worker
(SIGKILL, ``--fault kill:RANK@STEP``; the rank and step drawn at random, rank 0 included) of
``digits`` on 3 workers, 120 steps each. Per solver: how long the survivors took from the
kill to a re-formed group (``went_on_s``: the kill's time to the first member's new view;
median and max), steps the survivors lost (target 0), runs that ended without a summary or
hung (120 s), restarts (target 0), and the final accuracy against the run without a fault.
Real processes on this machine's cores (not emulated devices): the figures are the
re-forming's, not a cluster's.

Then healing, for every solver whose dead workers can be replaced (``--max-restarts 1``;
the replacement copies a live peer's state, or is let in by the servers or AD-PSGD's passive
workers and goes on from the dead worker's next step):
the same kills on emulated devices (``--device-ms 30``: 120 steps last 3.6 s, time for a
replacement to start), and per solver how long from the kill until the replacement trained
(``healed_s``), the steps the replaced rank missed meanwhile, the survivors' steps lost and
the accuracy.

    python benchmarks/live_recovery.py [--runs 5] [--parts re-form,healing] [--out docs/benchmarks/live_recovery.json]

(``--parts healing`` keeps the re-forming table of the file at ``--out``.)
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from common import argument_parser, table_header, table_row
from distsync.runtime.recovery import read_jsonl
from distsync.solvers import Capability, solver_class, solver_names

DISTSYNC = [sys.executable, "-m", "distsync.cli"]
WORKERS, STEPS = 3, 120


def kill_runs(tmp: str, solver: str, runs: int, rng: random.Random, *extra: str, ranks: list[int] | None = None
              ) -> list[dict]:
    out_runs = []
    for i in range(runs):
        rank, step = rng.choice(ranks or range(WORKERS)), rng.randint(10, 60)
        out = Path(tmp) / f"{solver}-{'heal-' if extra else ''}{i}"
        s = train(out, "--solver", solver, "--fault", f"kill:{rank}@{step}", *extra)
        run = {"fault": f"kill:{rank}@{step}", "finished": bool(s and "final_metric" in s),
               "hung": bool(s and s.get("hung"))}
        if run["finished"]:
            [f] = s["recovery"]["faults"]
            run.update(went_on_s=f.get("went_on_s"), restarts=s["recovery"]["restarts"],
                       steps_lost=STEPS * (WORKERS - 1) - sum(survivors_steps(out, rank)),
                       final_metric=s["final_metric"], healed_s=f.get("healed_s"),
                       replaced_rank_steps_lost=f.get("replaced_rank_steps_lost"))
        out_runs.append(run)
    return out_runs


def train(out: Path, *args: str) -> dict | None:
    cmd = [*DISTSYNC, "train", "--overwrite", "--workload", "digits", "--workers", str(WORKERS), "--steps", str(STEPS),
           "--eval-every", "60", "--seed", "1", "--out", str(out), *args]
    try:
        subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return {"hung": True}
    path = out / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def survivors_steps(out: Path, dead: int) -> list[int]:
    steps = Counter(e["rank"] for e in read_jsonl(out / "events.jsonl") if e["kind"] == "step")
    return [steps[r] for r in range(WORKERS) if r != dead]


def main() -> None:
    p = argument_parser(__doc__)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/benchmarks/live_recovery.json")
    p.add_argument("--parts", default="re-form,healing", help="which tables (default: both)")
    p.add_argument("--solvers", help="only these (comma-separated); the others' rows of --out are kept")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    rng = random.Random(args.seed)
    solvers = [s for s in solver_names() if Capability.REFORMS_WITHOUT_DEAD in solver_class(s).capabilities] \
        if "re-form" in parts else []
    healers = [s for s in solver_names() if Capability.HEALS_FROM_PEER in solver_class(s).capabilities
               and solver_class(s).Plan.training_threads(solver_class(s).Options()) == 1]  # (Hogwild threads: never)
    only = set(args.solvers.split(",")) if args.solvers else None
    if only:
        solvers, healers = [s for s in solvers if s in only], [s for s in healers if s in only]
    rows, healed = [], []
    kept = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {"solvers": [], "healing": []}
    table_header(["solver", "kills", "finished", "went on (ms, median / max)", "survivors' steps lost",
                  "restarts", "accuracy (clean → killed, mean)"])
    with tempfile.TemporaryDirectory() as tmp:
        for solver in solvers:
            clean = train(Path(tmp) / f"{solver}-clean", "--solver", solver)
            runs = kill_runs(tmp, solver, args.runs, rng)
            done = [r for r in runs if r["finished"]]
            went = [r["went_on_s"] * 1000 for r in done if r.get("went_on_s") is not None]
            row = {"solver": solver, "clean_metric": clean.get("final_metric") if clean else None, "runs": runs}
            rows.append(row)
            table_row([solver, len(runs), len(done),
                       f"{statistics.median(went):.0f} / {max(went):.0f}" if went else "n/a (nothing to re-form)",
                       sum(r["steps_lost"] for r in done), sum(r["restarts"] for r in done),
                       f"{row['clean_metric']:.3f} → {statistics.mean(r['final_metric'] for r in done):.3f}"
                       if done and row["clean_metric"] is not None else "n/a"], flush=True)
        print()
        table_header(["solver (healing)", "kills", "finished", "replaced", "healed after (s, median / max)",
                      "replaced rank's steps missed (median)", "survivors' steps lost",
                      "accuracy (clean → healed, mean)"])
        for solver in healers if "healing" in parts else []:
            # (AD-PSGD's dead passive is not replaced: kills of its actives, ranks 0 and 2)
            clean = train(Path(tmp) / f"{solver}-heal-clean", "--solver", solver, "--device-ms", "30")
            clean_metric = clean.get("final_metric") if clean else None
            runs = kill_runs(tmp, solver, args.runs, rng, "--max-restarts", "1", "--device-ms", "30",
                             ranks=[0, 2] if solver == "ad-psgd" else None)
            done = [r for r in runs if r["finished"]]
            heal = [r for r in done if r.get("healed_s") is not None]
            healed.append({"solver": solver, "clean_metric": clean_metric, "runs": runs})
            table_row([solver, len(runs), len(done), len(heal),
                       f"{statistics.median(r['healed_s'] for r in heal):.2f} / {max(r['healed_s'] for r in heal):.2f}"
                       if heal else "n/a",
                       f"{statistics.median(r['replaced_rank_steps_lost'] for r in heal):.0f}" if heal else "n/a",
                       sum(r["steps_lost"] for r in done),
                       f"{clean_metric:.3f} → {statistics.mean(r['final_metric'] for r in done):.3f}"
                       if done and clean_metric is not None else "n/a"], flush=True)
    # (rows of solvers not run this time are kept from --out)
    rows += [r for r in kept["solvers"] if r["solver"] not in {x["solver"] for x in rows}]
    healed += [r for r in kept["healing"] if r["solver"] not in {x["solver"] for x in healed}]
    Path(args.out).write_text(json.dumps({"workers": WORKERS, "steps": STEPS, "runs": args.runs,
                                          "solvers": sorted(rows, key=lambda r: r["solver"]),
                                          "healing": sorted(healed, key=lambda r: r["solver"])}, indent=1) + "\n")


if __name__ == "__main__":
    main()
