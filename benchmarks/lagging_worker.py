"""A lagging worker must not be taken for a dead one; a stopped one must be dropped after
``--timeout``, a killed one at once.

    python benchmarks/lagging_worker.py [--runs 50] [--families a,b] [--repeats 3] [--parts lagging,stop] [--seed 0]
                                        [--json PATH]

Method, raw results and figures: docs/benchmarks/kill_campaign.md.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from common import argument_parser, provenance, write_record
from kill_campaign import (DEVICE_MS, DISTSYNC, analyze, no_tmp, outcome, provenance_line, recorded, run_job,
                           train_command)

from distsync import marks
from distsync.experiments.report import markdown_table
from distsync.metrics.repeats import shown
from distsync.solvers import solver_names

LAGGING = ["train", "--workload", "digits", "--solver", "ripples", "--schedule", "smart", "--workers", "3",
           "--slow", "1:60", "--steps", "120", "--timeout", "4"]
WORKERS, STEPS, STOP_TIMEOUT = 3, 200, 4
REGIME = {"lagging": "CPU-bound real run (digits, 3 workers, one of them 60x slow) on this machine's cores, "
                     "half of the runs beside a process burning a core",
          "stop": "emulated devices (--device-ms 20: each step lasts 20 ms of device time, the real math inside it), "
                  "loopback, on this machine's cores"}


def lagging_run(i: int, burner: bool, tmp: Path) -> dict[str, Any]:
    """Part (1): the lagging command, beside a process burning a core or alone."""
    out = tmp / f"lagging-{i:03d}"
    burn = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if burner else None
    try:
        rec, _ = run_job([*DISTSYNC, *LAGGING, "--out", str(out)], out, WORKERS)
    finally:
        if burn is not None:
            burn.kill()
            burn.wait()
    return {"i": i, "burner": burner, **rec, "passed": rec["rc"] == 0, "dropped": marks.read_marks(out, marks.DROPPED)}


def stop_run(solver: str, how: str, rank: int, at_fraction: float, tmp: Path, repeat: int) -> dict[str, Any]:
    """Part (2): worker ``rank`` stopped (``how``: ``stop``) or killed (``kill``) from outside,
    ``at_fraction`` of the training time after every worker's first step."""
    out = tmp / f"{how}-{solver}-{repeat}"
    rec, summary = run_job(train_command(solver, WORKERS, STEPS, out, timeout_s=STOP_TIMEOUT), out, WORKERS,
                           want=[f"ds-worker-{rank}"], sig=signal.SIGSTOP if how == "stop" else signal.SIGKILL,
                           delay_s=at_fraction * STEPS * DEVICE_MS / 1000)
    rec = {"solver": solver, "how": how, "rank": rank, "repeat": repeat, "timeout_s": STOP_TIMEOUT, **rec}
    analyze(rec, out, summary, solver, WORKERS, STEPS)
    return rec


def render(raw: dict[str, Any]) -> dict[str, str]:
    """The page's blocks: ``lagging_worker`` (part 1) and ``stopped_worker`` (part 2), each
    when its part was run."""
    head = provenance_line(raw) + f"; {raw.get('seconds', 0) / 60:.1f} min" + (
        "; **partial: the run did not end**" if raw.get("partial") else "") + "."
    blocks = {}
    lag = raw.get("lagging") or []
    if lag:
        rows = []
        for label, sel in (("alone", False), ("beside a core-burning process", True)):
            runs = [r for r in lag if r["burner"] == sel]
            if runs:
                rows.append([label, len(runs), sum(r["passed"] for r in runs), sum(not r["passed"] for r in runs),
                             sum(r["hang"] for r in runs), sum(bool(r["dropped"]) for r in runs),
                             shown([r["seconds"] for r in runs if not r["hang"]], "{:.1f}")])
        lines = [head, "", f"Regime: {REGIME['lagging']}.", "",
                 f"`{raw.get('lagging_command') or 'distsync ' + ' '.join(LAGGING) + ' --out TMP'}`", ""]
        lines += markdown_table(["runs", "n", "passed (exit 0)", "failed", "hangs", "runs that dropped a worker",
                                 "seconds: median (min-max)"], rows)
        failed = [(no_tmp(r.get("error") or ("hang" if r["hang"] else f"exit {r['rc']}")),
                   r["burner"]) for r in lag if not r["passed"]]
        if failed:  # (one line per distinct message)
            lines += ["", "Failures, by their last stderr line:", ""]
            lines += [f"- {n}× ({sum(b for k, b in failed if k == key)} beside the burner): `{key[:300]}`"
                      for key, n in Counter(k for k, _ in failed).most_common()]
        dropped = [r for r in lag if r["dropped"]]
        if dropped:
            lines += ["", "Runs that dropped a worker: " + "; ".join(
                f"run {r['i']}{' (burner)' if r['burner'] else ''}: rank "
                + ", ".join(f"{d['rank']} ({d.get('reason') or d.get('signal')})" for d in r["dropped"]) for r in dropped)]
        blocks["lagging_worker"] = "\n".join(lines)
    stops = raw.get("stops") or []
    if stops:
        rows = []
        for solver in sorted({r["solver"] for r in stops}):
            row = [f"`{solver}`"]
            for rs in ([r for r in stops if (r["solver"], r["how"]) == (solver, how)] for how in ("stop", "kill")):
                row += [f"{sum(bool(r.get('finished')) for r in rs)} of {len(rs)}"
                        + (f", {sum(bool(r.get('hang')) for r in rs)} hung" if any(r.get("hang") for r in rs) else ""),
                        f"{sum(bool(r.get('dropped')) for r in rs)} of {len(rs)}",
                        shown([r.get("dropped_after_s") for r in rs]),
                        f"{shown([r.get('survivors_went_on_s') for r in rs])} / "
                        f"{shown([r.get('view_after_s') for r in rs])}"] if rs else ["-"] * 4
            rows.append(row)
        n = min(Counter((r["solver"], r["how"]) for r in stops).values())
        lines = [head, "", f"Regime: {REGIME['stop']}. Each solver: `digits`, {WORKERS} workers, {STEPS} steps, "
                 f"`--timeout {stops[0].get('timeout_s')}`; a random worker stopped (SIGSTOP) or killed (SIGKILL) "
                 f"from outside, at least {n} runs of each: median (min-max) over the runs (a time a run did not have "
                 f"is left out, and the count of those that had it is given).", ""]
        lines += markdown_table(["solver", "SIGSTOP: finished", "dropped", "dropped after (s)",
                                 "survivors went on after (s): first step / new view", "SIGKILL: finished", "dropped",
                                 "dropped after (s)", "survivors went on after (s): first step / new view"], rows)
        bad = [r for r in stops if not r.get("finished")]
        if bad:
            lines += ["", "Runs that did not finish:", ""]
            lines += [f"- {r['solver']} {r['how']} rank {r['rank']}: "
                      f"{'hang' if r.get('hang') else 'exit ' + str(r.get('rc'))}; "
                      f"`{no_tmp(r.get('error') or r.get('harness_error') or r.get('not_killed'))[:300]}`" for r in bad]
        blocks["stopped_worker"] = "\n".join(lines)
    return blocks


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--runs", type=int, default=50, help="(1): runs of the lagging command (default 50; half beside a burner)")
    p.add_argument("--families", help="(2): comma-separated solvers (default: every registered solver)")
    p.add_argument("--repeats", type=int, default=1, help="(2): runs of each solver and signal (default 1)")
    p.add_argument("--parts", default="lagging,stop", help="which parts (default: both)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="benchmarks/results/lagging_worker.json",
                   help="the raw results (written after every run; default: benchmarks/results/lagging_worker.json)")
    args = p.parse_args()
    started = provenance("benchmarks/lagging_worker.py")
    parts = set(args.parts.split(","))
    rng = random.Random(args.seed)
    payload: dict[str, Any] = {"seed": args.seed, "parts": sorted(parts),
                               "lagging_command": "distsync " + " ".join(LAGGING) + " --out TMP",
                               "lagging": [], "stops": []}
    regime = "; ".join(f"({i}) {REGIME[k]}" for i, k in ((1, "lagging"), (2, "stop")) if k in parts)
    t0 = time.monotonic()

    def save(partial: bool = True) -> None:
        # runs per cell: part (1) by burner, part (2) by solver and signal
        per_cell = Counter([f"lagging, {'burner' if r['burner'] else 'alone'}" for r in payload["lagging"]]
                           + [f"{r['solver']} {r['how']}" for r in payload["stops"]])
        payload.update(seconds=time.monotonic() - t0, partial=partial, runs_per_cell=per_cell,
                       repeats=min(per_cell.values(), default=0))
        write_record(args.json, started, regime=regime, seeds=[args.seed], payload=payload, announce=not partial)
    with tempfile.TemporaryDirectory(prefix="lagging_worker-") as tmp:
        if "lagging" in parts:
            burners = [True] * (args.runs // 2) + [False] * (args.runs - args.runs // 2)
            rng.shuffle(burners)
            for i, burner in enumerate(burners):
                r = lagging_run(i, burner, Path(tmp))
                payload["lagging"].append(r)
                print(f"[lagging {i + 1}/{args.runs} {time.monotonic() - t0:.0f} s]{' burner' if burner else ''}: "
                      f"{outcome(r)} in {r['seconds']:.1f} s{'; dropped a worker' if r['dropped'] else ''}", flush=True)
                save()
        for repeat in range(args.repeats) if "stop" in parts else []:
            for solver in args.families.split(",") if args.families else solver_names():
                for how in ("stop", "kill"):
                    rank, frac = rng.randrange(WORKERS), rng.uniform(0.1, 0.3)
                    about = {"solver": solver, "how": how, "rank": rank, "repeat": repeat}
                    r = recorded(lambda: stop_run(solver, how, rank, frac, Path(tmp), repeat), about)
                    payload["stops"].append(r)
                    dropped = f"after {r['dropped_after_s']:.2f} s" if r.get("dropped") else "no"
                    print(f"[{how} {solver} {repeat + 1}/{args.repeats} {time.monotonic() - t0:.0f} s] rank {rank}: "
                          f"{outcome(r)}; dropped {dropped}", flush=True)
                    save()
    save(partial=False)
    for text in render(json.loads(Path(args.json).read_text())).values():
        print()
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
