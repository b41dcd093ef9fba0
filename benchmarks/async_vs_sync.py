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

import argparse
import json
import sys
import time
from pathlib import Path

from distsync.config import RunConfig
from distsync.errors import DistsyncError
from distsync.experiments import write_report
from distsync.runtime import launch

SOLVERS = ["allreduce", "sync-easgd", "sync-ps", "ea-wild", "async-easgd", "async-measgd", "easgd",
           "async-ps", "async-msgd"]
# Server momentum (async-msgd) and local Nesterov momentum (async-measgd) multiply the step.
LR_SCALE = {"async-msgd": 0.1, "async-measgd": 0.5}
SETTINGS = [("wide", "200mbit", 150), ("cnn", "1gbit", 300)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
            try:
                s = launch(cfg, run_dir)
            except DistsyncError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            dirs.append(run_dir)
            table.setdefault(workload, {})[solver] = s
            print(f"{workload:>5} @ {link:<7} {solver:<13} time to target {s['time_to_target_s']}  "
                  f"final {s['final_metric']:.4f}  {s['throughput_samples_per_s']:,.0f} samples/s", flush=True)
        write_report(out / workload, dirs)

    def ttt(w, s):
        v = table[w].get(s, {}).get("time_to_target_s")
        return v

    print()
    print("| solver | wide @ 200 Mbit: time to target (s) | final | cnn @ 1 Gbit: time to target (s) | final |")
    print("|---|---|---|---|---|")
    for s in solvers:
        cells = []
        for w, _, _ in SETTINGS:
            r = table[w][s]
            cells += ["not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}",
                      f"{r['final_metric']:.4f}"]
        print(f"| {s} | " + " | ".join(cells) + " |")
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
    for text, ok in checks:
        print(("met:    " if ok else "missed: ") + text)
    (out / "summary.json").write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "settings": SETTINGS,
                                                  "results": table, "checks": checks}, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
