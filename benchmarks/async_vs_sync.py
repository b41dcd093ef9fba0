"""The seed's comparison: asynchronous against synchronous solvers, on two kinds of model.

- `wide` (a 1.1M-parameter MLP on digits: little compute per byte) at 200 Mbit links;
- `cnn` (57k parameters, compute-heavy) at 1 Gbit links;
4 workers each, same seed, data and step budget. Prints time to target and final metric for
every solver on both workloads, and the targets: on `wide`, ea-wild at least 1.5x faster to
target than allreduce and sync-easgd; on `cnn`, the synchronous solvers at least as fast as
ea-wild. Writes a report with plots per workload. Needs root (emulated links).

    python benchmarks/async_vs_sync.py [--out benchmarks/results/async_vs_sync]
"""

from __future__ import annotations

import sys
from pathlib import Path

from common import argument_parser, launch_or_exit, print_checks, print_table, write_results
from distsync.config import RunConfig
from distsync.experiments import write_report

SOLVERS = ["allreduce", "sync-easgd", "sync-ps", "ea-wild", "async-easgd", "async-measgd", "easgd",
           "async-ps", "async-msgd"]
# Server momentum (async-msgd) and local Nesterov momentum (async-measgd) multiply the step.
LR_SCALE = {"async-msgd": 0.1, "async-measgd": 0.5}
SETTINGS = [("wide", "200mbit", 150), ("cnn", "1gbit", 300)]


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--out", default="benchmarks/results/async_vs_sync")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--solvers", default=",".join(SOLVERS))
    args = p.parse_args()
    solvers = args.solvers.split(",")
    out = Path(args.out)
    table: dict[str, dict[str, dict]] = {}
    for workload, link, steps in SETTINGS:
        from distsync.workloads import load_workload

        base_lr = load_workload(workload).lr
        dirs = []
        for solver in solvers:
            cfg = RunConfig(workload=workload, solver=solver, workers=args.workers, steps=steps, link=link,
                            eval_every=10, lr=base_lr * LR_SCALE.get(solver, 1.0), timeout_s=120)
            run_dir = out / workload / solver
            s = launch_or_exit(cfg, run_dir)
            dirs.append(run_dir)
            table.setdefault(workload, {})[solver] = s
            print(f"{workload:>5} @ {link:<7} {solver:<13} time to target {s['time_to_target_s']}  "
                  f"final {s['final_metric']:.4f}  {s['throughput_samples_per_s']:,.0f} samples/s", flush=True)
        write_report(out / workload, dirs)

    def ttt(w, s):
        v = table[w].get(s, {}).get("time_to_target_s")
        return v

    def cells(s):
        out = [s]
        for w, _, _ in SETTINGS:
            r = table[w][s]
            out += ["not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}",
                    f"{r['final_metric']:.4f}"]
        return out

    print()
    print_table(["solver", "wide @ 200 Mbit: time to target (s)", "final", "cnn @ 1 Gbit: time to target (s)", "final"],
                [cells(s) for s in solvers])
    print()
    checks = []
    ew = ttt("wide", "ea-wild")
    for rival in ("allreduce", "sync-easgd"):
        rv = ttt("wide", rival)
        if ew is not None and rv is not None:
            checks.append((f"wide: {rival} / ea-wild time to target = {rv / ew:.2f}x (target >= 1.5x)", rv / ew >= 1.5))
    ec = ttt("cnn", "ea-wild")
    for sync in ("allreduce", "sync-easgd", "sync-ps"):
        sv = ttt("cnn", sync)
        if ec is not None and sv is not None:
            checks.append((f"cnn: ea-wild / {sync} time to target = {ec / sv:.2f}x (target >= 1.0x)", ec / sv >= 1.0))
    print_checks(checks, met="met:   ", missed="missed:")
    write_results(out / "summary.json", {"settings": SETTINGS, "results": table, "checks": checks}, announce=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
