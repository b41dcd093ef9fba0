"""ShadowSync's scaling table on this machine: background against foreground synchronization.

`ctr` (DLRM on generated click logs, tables on one embedding server) at 1 Gbit links, with
1, 2 and 4 trainers: throughput (examples/s, total and per trainer) and final NE / AUC of
`shadow-ea`, `shadow-ma`, `shadow-bmuf`, their foreground twins `fr-easgd`, `ma`, `bmuf`,
`allreduce`, and `local` (no synchronization at all: what a trainer does alone). Every
trainer takes the same number of steps (600 of 256 examples), so more trainers see more of
the logs (one pass; the logs are made long enough for the most trainers).
Shadow solvers run three times: syncing continuously (`min_interval_ms=0`, the default) and
at most every 10 and 40 ms (`--min-interval-ms`). Targets: a shadow solver's per-trainer throughput
>= 0.9x `local`'s with as many trainers; its NE within 1% of its foreground twin's, or
better. Needs root (emulated links).

``--devices``: each trainer is an emulated device whose steps last 20 ms (``--device-ms``;
the real math, ~4 ms alone, inside it), so a shadow thread's syncing competes with the
device as it would on a dedicated trainer, not with the other trainers for this machine's
cores; shadow solvers sync continuously only (the target's setting), 400 steps.

    python benchmarks/shadowsync.py [--out benchmarks/results/shadowsync] [--link 1gbit]
    python benchmarks/shadowsync.py --devices [--json docs/benchmarks/shadowsync_devices.json]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from common import argument_parser, launch_or_exit, print_checks, table_header, table_row, write_results
from distsync.config import RunConfig
from distsync.experiments import write_report

TWINS = {"shadow-ea": "fr-easgd", "shadow-ma": "ma", "shadow-bmuf": "bmuf"}
THREADED = {"local", "shadow-ea", "fr-easgd", "shadow-ma", "ma", "shadow-bmuf", "bmuf"}
DEVICE_MS = 20.0


def runs(intervals: list[float]) -> list[tuple[str, str, dict]]:
    """(label, solver, options) of every run, in table order."""
    out = [("local", "local", {})]
    for shadow, twin in TWINS.items():
        for ms in intervals:
            out.append((f"{shadow}" + (f" >={ms:g}ms" if ms else ""), shadow, {"min_interval_ms": ms} if ms else {}))
        out.append((twin, twin, {}))
    out.append(("allreduce", "allreduce", {}))
    return out


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--out", default="benchmarks/results/shadowsync")
    p.add_argument("--link", default="1gbit")
    p.add_argument("--trainers", default="1,2,4")
    p.add_argument("--steps", type=int, default=None, help="steps per trainer (default: 600; --devices: 400)")
    p.add_argument("--threads", type=int, default=1, help="Hogwild threads per trainer (allreduce: always 1)")
    p.add_argument("--min-interval-ms", default=None,
                   help="shadow solvers' min_interval_ms values to run (default: 0,10,40; --devices: 0)")
    p.add_argument("--devices", action="store_true", help=f"emulated devices of {DEVICE_MS:g} ms per step")
    p.add_argument("--json", default=None, help="also write the raw results here")
    args = p.parse_args()
    args.steps = args.steps or (400 if args.devices else 600)
    device_ms = DEVICE_MS if args.devices else None
    plan = runs([float(v) for v in (args.min_interval_ms or ("0" if args.devices else "0,10,40")).split(",")])
    if args.out == p.get_default("out") and args.devices:
        args.out += "_devices"
    out = Path(args.out)
    trainers = [int(t) for t in args.trainers.split(",")]
    # one pass: enough generated logs for the most trainers
    logs = {"train": max(trainers) * args.steps * 256}
    results: dict[int, dict[str, dict]] = {}
    for n in trainers:
        dirs = []
        for name, solver, opts in plan:
            opts = dict(opts, **({"threads": args.threads} if solver in THREADED and args.threads > 1 else {}))
            cfg = RunConfig(workload="ctr", workload_options=logs, solver=solver, solver_options=opts, workers=n, steps=args.steps,
                            link=args.link, eval_every=args.steps // 3, timeout_s=120, device_ms=device_ms)
            run_dir = out / f"{n}-trainers" / name.replace(" >=", "-")
            s = launch_or_exit(cfg, run_dir)
            dirs.append(run_dir)
            results.setdefault(n, {})[name] = s
            over = f"  {s['device']['share_over']:.0%} steps over" if device_ms else ""
            print(f"{n} trainers {name:<20} {s['throughput_samples_per_s']:>9,.0f} ex/s  NE {s['final_metric']:.4f}"
                  f"  AUC {s['final_auc']:.4f}{over}", flush=True)
        write_report(out / f"{n}-trainers", dirs)

    cores = os.cpu_count() or 1
    print()
    regime = (f"emulated devices of {DEVICE_MS:g} ms per step (embedding server and sync threads not emulated)"
              if device_ms else "CPU-bound trainers")
    print(f"ctr, {args.steps} steps of 256 per trainer, {args.threads} thread(s) per trainer, {args.link} links, "
          f"1 embedding server; {cores} CPU cores shared by all processes; {regime}")
    print()
    table_header(["trainers", "solver", "examples/s (total)", "per trainer", "vs local", "NE", "AUC", "syncs/step"])
    for n in trainers:
        base = results[n]["local"]["throughput_samples_per_s"] / n
        for name, _, _ in plan:
            s = results[n][name]
            per = s["throughput_samples_per_s"] / n
            syncs = [v["syncs_per_step"] for v in s["solver_stats"].values() if "syncs_per_step" in v]
            sps = f"{sum(syncs) / len(syncs):.2f}" if syncs else "-"
            shared = " (shares CPUs)" if n + 1 > cores and not device_ms else ""
            flag = " [CPU-bound]" if device_ms and s["device"]["cpu_bound"] else ""
            table_row([f"{n}{shared}", name + flag, f"{s['throughput_samples_per_s']:,.0f}", f"{per:,.0f}", f"{per / base:.2f}x",
                       f"{s['final_metric']:.4f}", f"{s['final_auc']:.4f}", sps])
    print()
    checks = []
    for n in trainers:
        base = results[n]["local"]["throughput_samples_per_s"]
        for name, shadow, _ in plan:
            if shadow not in TWINS:
                continue
            twin = TWINS[shadow]
            s, f = results[n][name], results[n][twin]
            ratio = s["throughput_samples_per_s"] / base
            checks.append((f"{n} trainers: {name} per-trainer throughput {ratio:.2f}x local (>= 0.9)", ratio >= 0.9))
            rel = s["final_metric"] / f["final_metric"] - 1
            checks.append((f"{n} trainers: {name} NE {s['final_metric']:.4f} vs {twin} {f['final_metric']:.4f} "
                           f"({rel:+.1%}, <= +1%)", rel <= 0.01))
    print_checks(checks)
    keep = ("throughput_samples_per_s", "final_metric", "final_auc", "device", "phase_share", "solver_stats")
    payload = {"device_ms": device_ms, "link": args.link, "steps": args.steps, "threads": args.threads,
               "results": {n: {name: {k: s.get(k) for k in keep} for name, s in by.items()} for n, by in results.items()},
               "checks": checks}
    write_results(out / "summary.json", payload, announce=False)
    if args.json:
        write_results(args.json, {"command": "python benchmarks/shadowsync.py" + (" --devices" if args.devices else ""),
                                  **payload})
    return 0


if __name__ == "__main__":
    sys.exit(main())
