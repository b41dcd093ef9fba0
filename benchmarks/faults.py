"""Fault injection across every solver, and a soak for leaks.

(1) For every registered solver, ``--runs`` runs of ``digits`` (2 workers, 120 steps, a
checkpoint every 20 steps, up to 2 restarts, 10 s timeout), each with one random fault: a
worker killed at a random step, the first server or coordinator killed (solvers that have
one), or a worker stalled for up to 2 s. Solvers that survive a worker's death drop a killed
worker other than rank 0 and train on; the others restart from the last checkpoint. Each run
is a `distsync train` process; one that
has not ended after 120 s counts as a hang and is killed. Per solver: faults injected, runs
finished, median steps lost (the fault's step minus the step the job resumed from), the
longest recovery (kill to training again), hangs, and lost updates: for solvers with
servers, the updates each server counts against the updates the workers' history asks for
(steps for sync-ps; a push per worker step for the asynchronous parameter servers; an
exchange per worker every tau steps for the elastic ones; none for shadow-ea, whose exchanges
follow time).

(2) Soak: ``async-ps`` and ``ripples`` with 4 workers, ``--soak`` seconds each; the job's
processes' resident memory, threads and open files are sampled every 5 s. Growth is the last
sample against the first one taken after a warm-up minute (or a fifth of the soak).

    python benchmarks/faults.py [--runs 20] [--soak 1200] [--out benchmarks/results/faults]
"""

from __future__ import annotations

import json
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import argument_parser, table_header, table_row
from distsync.metrics.processes import tree_usage
from distsync.solvers import make_solver, solver_names

REPO = Path(__file__).resolve().parents[1]
DISTSYNC = [sys.executable, "-m", "distsync.cli"]
STEPS, EVERY = 120, 20


def random_fault(solver: str, rng: random.Random) -> str:
    roles = make_solver(solver).roles
    step = rng.randint(EVERY + 5, STEPS - 10)
    kinds = ["kill-worker", "stall"] + (["kill-role"] if roles else [])
    kind = rng.choice(kinds)
    if kind == "kill-worker":
        return f"kill:{rng.randint(0, 1)}@{step}"
    if kind == "stall":
        return f"stall:{rng.randint(0, 1)}@{step}:{rng.uniform(0.2, 2.0):.2f}"
    return f"kill:{'server' if 'server' in roles else 'coordinator'}@{step}"


def expected_updates(solver: str, steps_done: list[int]) -> int | None:
    """What the servers' update counts should be, given each worker's steps (None: no servers)."""
    s = make_solver(solver)
    if "server" not in s.roles or solver.startswith("shadow-"):
        return None  # (a shadow thread's exchanges follow time, not steps)
    if solver == "sync-ps":
        return STEPS  # one update per round
    tau = getattr(s.options, "tau", 1)  # an exchange every tau steps, else a push every step (n_push 1)
    return sum(n // tau for n in steps_done)


def one_run(solver: str, fault: str, out: Path) -> dict:
    args = DISTSYNC + ["train", "--solver", solver, "--workers", "2", "--steps", str(STEPS), "--eval-every", "40",
                       "--checkpoint-every", str(EVERY), "--max-restarts", "2", "--timeout", "10",
                       "--fault", fault, "--out", str(out)]
    if solver in ("hogwild",):
        args += ["--threads", "2"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return {"fault": fault, "finished": False, "hang": True}
    row = {"fault": fault, "finished": proc.returncode == 0, "hang": False, "seconds": time.monotonic() - t0}
    if proc.returncode != 0:
        row["error"] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        return row
    summary = json.loads((out / "summary.json").read_text())
    fired = summary["recovery"]["faults"]
    row["steps_lost"] = [f["steps_lost"] for f in fired if "steps_lost" in f]
    # (a restart's time to train again, or the time the others took to go on without the dead one)
    row["recovery_s"] = [f.get("recovery_s", f.get("went_on_s")) for f in fired
                         if "recovery_s" in f or "went_on_s" in f]
    dropped = summary["recovery"]["dropped"]
    row["dropped"] = len(dropped)
    gone = {d["rank"]: (d["last_step"] + 1 if d["last_step"] is not None else 0) for d in dropped}
    want = expected_updates(solver, [gone.get(rank, STEPS) for rank in range(2)])
    if want is not None:
        counted = [st["updates"] for st in summary["solver_stats"].values() if "updates" in st]
        row["lost_updates"] = max(abs(want - c) for c in counted) if counted else None
    return row


def sample(pid: int) -> dict:
    return {"t": time.monotonic(), **tree_usage(pid)}


def soak(solver: list[str], seconds: float, out: Path) -> dict:
    proc = subprocess.Popen(DISTSYNC + ["train", *solver, "--workers", "4", "--steps", "100000000",
                                        "--eval-every", "2000", "--out", str(out)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples, start = [], time.monotonic()
    warm = min(60.0, seconds / 5)
    try:
        while time.monotonic() - start < seconds and proc.poll() is None:
            time.sleep(5)
            samples.append(sample(proc.pid))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    steady = [s for s in samples if s["t"] - start >= warm] or samples
    first, last = steady[0], steady[-1]
    return {"solver": " ".join(solver), "seconds": seconds, "samples": len(samples),
            "rss_first_mb": first["rss"] / 2**20, "rss_last_mb": last["rss"] / 2**20,
            "rss_growth": last["rss"] / first["rss"] - 1, "threads": (first["threads"], last["threads"]),
            "fds": (first["fds"], last["fds"]), "ended_early": proc.returncode not in (130, -2, 0) and
            time.monotonic() - start < seconds}


def fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--runs", type=int, default=3, help="faulted runs per solver (the issue's figure: 20)")
    p.add_argument("--soak", type=float, default=120.0, help="seconds of each soak (the issue's figure: 1200)")
    p.add_argument("--solvers", help="comma-separated (default: every registered solver)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/faults")
    args = p.parse_args()
    out = Path(args.out)
    rng = random.Random(args.seed)
    solvers = args.solvers.split(",") if args.solvers else solver_names()
    table = []
    table_header(["solver", "faults injected", "runs finished", "workers dropped", "median steps lost",
                  "max recovery (s)", "hangs", "lost updates", "faults"])
    for solver in solvers:
        rows = [one_run(solver, random_fault(solver, rng), out / solver / f"run{i}") for i in range(args.runs)]
        lost = [x for r in rows for x in r.get("steps_lost", [])]
        recovery = [x for r in rows for x in r.get("recovery_s", [])]
        updates = [r["lost_updates"] for r in rows if r.get("lost_updates") is not None]
        line = {"solver": solver, "runs": rows, "finished": sum(r["finished"] for r in rows),
                "hangs": sum(r["hang"] for r in rows), "median_steps_lost": statistics.median(lost) if lost else None,
                "max_recovery_s": max(recovery) if recovery else None, "lost_updates": max(updates) if updates else None}
        table.append(line)
        line["dropped"] = sum(r.get("dropped", 0) for r in rows)
        cells = [solver, len(rows), line["finished"], line["dropped"], fmt(line["median_steps_lost"], "{:g}"),
                 fmt(line["max_recovery_s"], "{:.1f}"), line["hangs"], fmt(line["lost_updates"], "{}"),
                 ", ".join(r["fault"] for r in rows)]
        table_row(cells, flush=True)
        for r in rows:
            if not r["finished"]:
                print(f"  {solver} {r['fault']}: {r.get('error', 'hang')}", flush=True)
    soaks = []
    if args.soak > 0:
        print()
        table_header(["soak", "seconds", "RSS first -> last (MiB)", "growth", "threads", "open files"])
        for solver in (["--solver", "async-ps"], ["--solver", "ripples"]):
            s = soak(solver, args.soak, out / "soak" / solver[1])
            soaks.append(s)
            table_row([s["solver"], f"{s['seconds']:.0f}", f"{s['rss_first_mb']:.0f} -> {s['rss_last_mb']:.0f}",
                       f"{s['rss_growth']:+.1%}", f"{s['threads'][0]} -> {s['threads'][1]}",
                       f"{s['fds'][0]} -> {s['fds'][1]}"], flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_text(json.dumps({"solvers": table, "soak": soaks}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
