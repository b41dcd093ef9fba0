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

    python benchmarks/live_recovery.py [--runs 5] [--parts re-form,healing] [--solvers S,...] [--seed 0]
                                       [--json benchmarks/results/live_recovery.json]

The published tables: ``python benchmarks/figures.py run live_recovery`` (``--runs 5``, raw
results in docs/benchmarks/raw/live_recovery.json); a run of some parts or solvers writes only
those, so that every row of a raw file comes from the command and commit it records.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import argument_parser, provenance, write_record
from kill_campaign import DISTSYNC, accuracy, has_passives, run_events, run_job, steps_done

from distsync.experiments.report import markdown_table
from distsync.metrics.repeats import median, spread
from distsync.solvers import Capability, solver_class, solver_names
from distsync.solvers.schedules import bipartite_roles

WORKERS, STEPS = 3, 120
REGIME = {"re-form": "CPU-bound real run (the 3 workers share this machine's cores, loopback)",
          "healing": "emulated devices (--device-ms 30, so that training outlasts a replacement's start-up), "
                     "loopback, on this machine's cores"}


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
        load = os.getloadavg()[0]  # (what else the machine ran: the kill-to-recovery times are wall time)
        rec, s = train(out, "--solver", solver, "--fault", f"kill:{rank}@{step}", *extra)
        run = {"fault": f"kill:{rank}@{step}", "finished": rec["finished"], "hung": rec["hang"], "load_before": load}
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


def _head(raw: dict[str, Any]) -> str:
    """Which run a block shows: command, commit, machine, seed, date, and how loaded the machine was."""
    machine = raw.get("machine") or {}
    loads = spread(r.get("load_before") for row in raw.get("solvers", []) + raw.get("healing", []) for r in row["runs"])
    return (f"`{raw.get('command', '?')}` at commit {str(raw.get('commit'))[:10]}"
            + (" (the working tree differed)" if raw.get("dirty") else "")
            + f", {machine.get('cpu_count')} cores, torch {machine.get('torch')}, seed {raw.get('seed')}, "
            f"{raw.get('date', '')}; 1-minute load average {machine.get('load_average_at_start', 0):.1f} at the start, "
            f"{machine.get('load_average_at_end', 0):.1f} at the end"
            + (f", {loads[1]:.1f}-{loads[2]:.1f} before the runs" if loads else "") + ".")


def _regime(raw: dict[str, Any], part: str) -> str:
    return (f"Regime: {(raw.get('regimes') or REGIME)[part]}. {raw.get('runs')} kills per solver, the killed rank "
            f"and step drawn with seed {raw.get('seed')}; digits, {raw.get('workers')} workers, {raw.get('steps')} "
            "steps.")


def _met(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def _accuracy_gap(rows: list[dict[str, Any]]) -> str:
    """The largest gap between a solver's mean final accuracy after a kill and its run's
    without one, and whose it is."""
    gaps = []
    for row in rows:
        metrics = [r["final_metric"] for r in row["runs"] if r["finished"] and r.get("final_metric") is not None]
        if metrics and row.get("clean_metric") is not None:
            gaps.append((abs(sum(metrics) / len(metrics) - row["clean_metric"]), row["solver"]))
    if not gaps:
        return "The accuracy after a kill: n/a (no run finished beside a run without one)."
    gap, solver = max(gaps)
    return (f"The accuracy after a kill is within {gap:.3f} of the run without one (the largest gap of a solver's "
            f"mean: `{solver}`).")


def render(raw: dict[str, Any]) -> dict[str, str]:
    """The blocks of docs/reliability.md, each for a part the raw file holds: ``live_recovery``
    (going on without the dead worker) and ``live_recovery_healing`` (its replacement), each
    with the line of targets its table decides."""
    blocks = {}
    if raw.get("solvers"):
        rows, medians, worst, runs = [], [], [], []
        for row in raw["solvers"]:
            done = [r for r in row["runs"] if r["finished"]]
            runs += row["runs"]
            went = spread(r.get("went_on_s") for r in done)
            if went:
                medians.append(went[0])
                worst.append(went[2])
            rows.append([row["solver"], len(row["runs"]), len(done),
                         f"{went[0] * 1000:.0f} / {went[2] * 1000:.0f}" if went else "n/a (nothing to re-form)",
                         sum(r["steps_lost"] for r in done), sum(r["restarts"] for r in done),
                         accuracy([row["clean_metric"]], [r["final_metric"] for r in done]) or "n/a"])
        done = [r for r in runs if r["finished"]]
        lost, restarts, gap = sum(r["steps_lost"] for r in done), sum(r["restarts"] for r in done), _accuracy_gap(
            raw["solvers"])
        went_on = (f"{min(medians) * 1000:.0f}-{max(medians) * 1000:.0f} ms median per solver, "
                   f"{max(worst) * 1000:.0f} ms the worst" if medians else "none timed")
        lines = [_head(raw), "", _regime(raw, "re-form"), ""]
        lines += markdown_table(["solver", "kills", "finished", "went on (ms, median / max)", "survivors' steps lost",
                                 "restarts", "accuracy (clean → killed, mean)"], rows)
        lines += ["", f"Targets: every run finishes: {_met(len(done) == len(runs))} ({len(done)} of {len(runs)}); "
                      f"the others go on in under 1 s: {_met(bool(medians) and max(worst) < 1.0)} ({went_on}); "
                      f"no step lost for the survivors: {_met(lost == 0)} ({lost} in all); no restart: "
                      f"{_met(restarts == 0)} ({restarts}). " + gap]
        blocks["live_recovery"] = "\n".join(lines)
    if raw.get("healing"):
        healing, runs, heals, medians = [], [], [], []
        for row in raw["healing"]:
            done = [r for r in row["runs"] if r["finished"]]
            runs += row["runs"]
            heal = [r for r in done if r.get("healed_s") is not None]
            heals += heal
            healed = spread(r["healed_s"] for r in heal)
            if healed:
                medians.append(healed[0])
            missed = median(r["replaced_rank_steps_lost"] for r in heal)
            healing.append([row["solver"], len(row["runs"]), len(done), len(heal),
                            f"{healed[0]:.2f} / {healed[2]:.2f}" if healed else "n/a",
                            "n/a" if missed is None else f"{missed:.0f}", sum(r["steps_lost"] for r in done),
                            accuracy([row["clean_metric"]], [r["final_metric"] for r in done]) or "n/a"])
        done = [r for r in runs if r["finished"]]
        lost, gap = sum(r["steps_lost"] for r in done), _accuracy_gap(raw["healing"])
        after = spread(r["healed_s"] for r in heals)
        lines = [_head(raw), "", _regime(raw, "healing") + " Each run with `--max-restarts 1`.", ""]
        lines += markdown_table(["solver (healing)", "kills", "finished", "replaced", "healed after (s, median / max)",
                                 "replaced rank's steps missed (median)", "survivors' steps lost",
                                 "accuracy (clean → healed, mean)"], healing)
        lines += ["", f"Healed: {len(heals)} of {len(runs)} kills ({len(done)} runs finished); a replacement trained "
                      "again " + (f"{after[1]:.2f}-{after[2]:.2f} s after the kill ({min(medians):.2f}-"
                                  f"{max(medians):.2f} s median per solver)" if after else "after none")
                  + f"; survivors' steps lost: {lost}. " + gap]
        blocks["live_recovery_healing"] = "\n".join(lines)
    return blocks


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--runs", type=int, default=5, help="kills per solver (default 5)")
    p.add_argument("--seed", type=int, default=0, help="draws each kill's rank and step (default 0)")
    p.add_argument("--parts", default="re-form,healing", help="which tables (default: both)")
    p.add_argument("--solvers", help="comma-separated (default: every solver each part applies to)")
    p.add_argument("--json", default="benchmarks/results/live_recovery.json",
                   help="the raw results (written after each part; default: benchmarks/results/live_recovery.json)")
    args = p.parse_args()
    parts = args.parts.split(",")
    unknown = [x for x in parts if x not in REGIME]
    if unknown:
        raise SystemExit(f"error: unknown part(s) {', '.join(unknown)}; parts: {', '.join(REGIME)}")
    wanted = args.solvers.split(",") if args.solvers else solver_names()
    unknown = [x for x in wanted if x not in solver_names()]
    if unknown:
        raise SystemExit(f"error: unknown solver(s) {', '.join(unknown)}; solvers: {', '.join(solver_names())}")
    started = provenance("benchmarks/live_recovery.py")
    rng = random.Random(args.seed)
    payload: dict[str, Any] = {"workers": WORKERS, "steps": STEPS, "runs": args.runs, "seed": args.seed,
                               "parts": parts, "regimes": {k: REGIME[k] for k in parts}, "repeats": args.runs}
    regime = "; ".join(f"{k}: {REGIME[k]}" for k in parts)

    def save(announce: bool = False) -> None:  # (after each part: a later part's failure keeps what was measured)
        write_record(args.json, started, regime=regime, seeds=[args.seed], payload=payload, announce=announce)
    with tempfile.TemporaryDirectory(prefix="live_recovery-") as tmp:
        if "re-form" in parts:
            payload["solvers"] = [solver_runs(Path(tmp), s, args.runs, rng) for s in wanted
                                  if Capability.REFORMS_WITHOUT_DEAD in solver_class(s).capabilities]
            save()
        if "healing" in parts:  # (Hogwild's threads: never healed)
            payload["healing"] = [solver_runs(Path(tmp), s, args.runs, rng, "--max-restarts", "1", "--device-ms", "30")
                                  for s in wanted if Capability.HEALS_FROM_PEER in solver_class(s).capabilities
                                  and solver_class(s).Plan.training_threads(solver_class(s).Options()) == 1]
    save(announce=True)
    for text in render(json.loads(Path(args.json).read_text())).values():
        print()
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
