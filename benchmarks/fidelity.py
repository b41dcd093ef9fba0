"""How far to trust the simulator, out of sample: fit once, predict the other runs.

One real run fits the simulator for a workload and link: allreduce on 4 emulated devices,
homogeneous (``simulate --calibrate RUN --fit-from FIT``: its compute per step and its
per-message cost). Then every other run (other solvers, 4, 8 and 16 workers, one worker 3x
slow) is predicted from its configuration alone and set against what it measured:
throughput, and time to target (train mode: the solver's own rule on the fitted cluster,
against the real run's evaluations). Target: within 15% on every row. Runs on emulated
devices (``--device-ms``) on loopback; a run flagged CPU-bound is marked in the table and
counted apart, since the model has no CPU-sharing term.

    python benchmarks/fidelity.py [--workers 4,8,16] [--json docs/benchmarks/fidelity.json]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from common import argument_parser, launch_or_exit, print_checks, table_header, table_row, write_results
from distsync.config import RunConfig
from distsync.sim.calibrate import calibrate

SOLVERS = [("allreduce", {}), ("sync-easgd", {}), ("ma", {}), ("ripples", {"schedule": "static"}),
           ("ripples", {"schedule": "random"}), ("ripples", {"schedule": "smart"}), ("ad-psgd", {}),
           ("async-ps", {}), ("async-easgd", {})]
DEVICE_MS, STEPS, EVAL_EVERY, WORKLOAD = 20.0, 200, 10, "digits"


def label(solver: str, opts: dict) -> str:
    return solver + "".join(f":{v}" for v in opts.values())


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--out", default="benchmarks/results/fidelity")
    p.add_argument("--workers", default="4,8,16")
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--reuse", action="store_true",
                   help="predict the runs already in --out again instead of running them (the model changed)")
    args = p.parse_args()
    out = Path(args.out)

    def run(solver, opts, workers, slow, name):
        cfg = RunConfig(workload=WORKLOAD, solver=solver, solver_options=dict(opts), workers=workers, steps=STEPS,
                        slow=dict(slow), device_ms=DEVICE_MS, eval_every=EVAL_EVERY, timeout_s=120)
        d = out / name
        if args.reuse and (d / "summary.json").exists():
            return d, json.loads((d / "summary.json").read_text())
        s = launch_or_exit(cfg, d)
        return d, s

    cores = os.cpu_count() or 1
    fit_dir, _ = run("allreduce", {}, 4, {}, "fit-allreduce-4w")
    rows = []
    for workers in [int(w) for w in args.workers.split(",")]:
        for case, slow in (("homogeneous", {}), ("one 3x slow", {1: 3.0})):
            for solver, opts in SOLVERS:
                name = f"{workers}w-{case.replace(' ', '-')}-{label(solver, opts).replace(':', '-')}"
                d, s = run(solver, opts, workers, slow, name)
                r = calibrate(d, fit_from=fit_dir)
                h = calibrate(d, fit_from=fit_dir, host_cores=cores)
                rows.append({"workers": workers, "case": case, "solver": label(solver, opts),
                             "measured": r["measured_throughput"], "predicted": r["predicted_throughput"],
                             "error": r["throughput_error"], "cpu_bound": bool((s.get("device") or {}).get("cpu_bound")),
                             "wait_share": s["phase_share"]["wait"],
                             "measured_ttt": r["measured_time_to_target_s"],
                             "predicted_ttt": r["predicted_time_to_target_s"], "ttt_error": r["time_to_target_error"],
                             "host": {"share": h["host_share"], "predicted": h["predicted_throughput"],
                                      "error": h["throughput_error"], "predicted_ttt": h["predicted_time_to_target_s"],
                                      "ttt_error": h["time_to_target_error"]}})
                print(f"{workers}w {case:<12} {label(solver, opts):<18} measured {r['measured_throughput']:>7,.0f}  "
                      f"predicted {r['predicted_throughput']:>7,.0f}  {r['throughput_error']:+.1%} "
                      f"(host term {h['throughput_error']:+.1%})  time to target "
                      f"{_s(r['measured_time_to_target_s'])} vs {_s(r['predicted_time_to_target_s'])} "
                      f"(host term {_s(h['predicted_time_to_target_s'])})", flush=True)
    print()
    print(f"{WORKLOAD}, {DEVICE_MS:g} ms emulated devices, loopback, {STEPS} steps, evaluated every {EVAL_EVERY}; "
          f"fitted once on allreduce, 4 workers, homogeneous")
    print()
    table_header(["workers", "case", "solver", "measured samples/s", "predicted", "error", "with host term",
                  "measured time to target (s)", "predicted", "error", "with host term"])
    for r in rows:
        flag = " (CPU-bound)" if r["cpu_bound"] else ""
        table_row([r["workers"], r["case"], r["solver"] + flag, f"{r['measured']:,.0f}", f"{r['predicted']:,.0f}",
                   f"{r['error']:+.1%}", f"{r['host']['error']:+.1%}", _s(r["measured_ttt"]), _s(r["predicted_ttt"]),
                   _pct(r["ttt_error"]), _pct(r["host"]["ttt_error"])])
    print()
    checks = []
    for name, rs in (("device-bound", [r for r in rows if not r["cpu_bound"]]),
                     ("CPU-bound", [r for r in rows if r["cpu_bound"]])):
        if not rs:
            continue
        for model, get in (("out of sample", lambda r: r), ("with the host term", lambda r: r["host"])):
            tp = [r for r in rs if abs(get(r)["error"]) <= 0.15]
            checks.append((f"{name}, {model}: throughput within 15% on {len(tp)} of {len(rs)} rows (target: all)",
                           len(tp) == len(rs)))
            both = [r for r in rs if r["measured_ttt"] and get(r)["predicted_ttt"]]
            tt = [r for r in both if abs(get(r)["ttt_error"]) <= 0.15]
            one = [r for r in rs if bool(r["measured_ttt"]) != bool(get(r)["predicted_ttt"])]
            checks.append((f"{name}, {model}: time to target within 15% on {len(tt)} of {len(both)} rows where both "
                           f"reached it; {len(one)} reached it on one side only (target: all)",
                           len(tt) == len(both) and not one))
    print_checks(checks)
    payload = {"workload": WORKLOAD, "device_ms": DEVICE_MS, "steps": STEPS, "eval_every": EVAL_EVERY, "rows": rows}
    write_results(out / "summary.json", payload, announce=False)
    if args.json:
        write_results(args.json, {"command": "python benchmarks/fidelity.py " + " ".join(sys.argv[1:]), **payload})
    return 0


def _pct(v) -> str:
    return "-" if v is None else f"{v:+.1%}"


def _s(v) -> str:
    return "not reached" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    sys.exit(main())
