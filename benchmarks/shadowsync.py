"""ShadowSync's scaling table on this machine: background against foreground synchronization.

    python benchmarks/shadowsync.py [--out benchmarks/results/shadowsync] [--link 1gbit]
    python benchmarks/shadowsync.py --devices [--trainers 4] [--seeds 1,2,3] [--json PATH]

Method, raw results and figures: docs/benchmarks/shadowsync.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from common import argument_parser, checks_markdown, compare_runs, finish, kept, per_seed, provenance, seed_list
from distsync.config import RunConfig
from distsync.metrics.repeats import ratios, shown, spread, verdict

TWINS = {"shadow-ea": "fr-easgd", "shadow-ma": "ma", "shadow-bmuf": "bmuf"}
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


def regime(device_ms: float | None, link: str) -> str:
    return (f"emulated devices of {device_ms:g} ms per step behind emulated {link} links (embedding server and sync "
            f"threads not emulated: they share this machine's cores)" if device_ms
            else f"emulated cluster: CPU-bound trainers behind emulated {link} links")


def render(raw: dict) -> dict[str, str]:
    """The page's table: per trainers and solver, throughput per trainer against local's and
    the foreground twin's, and NE (median and range over seeds)."""
    lines = [f"ctr, {raw['steps']} steps of 256 per trainer. {raw['repeats']} seeds "
             f"({', '.join(map(str, raw['seeds']))}) per cell: median (min-max); ratios per seed. "
             f"Regime: {raw['regime']}.", "",
             "| trainers | solver | examples/s per trainer | vs local | vs foreground twin | vs 1.0 (twin) | NE | "
             "NE vs twin |", "|---|---|---|---|---|---|---|---|"]
    for n, by_name in raw["results"].items():
        per = {name: {k: v / int(n) for k, v in per_seed(by_seed, "throughput_samples_per_s").items()}
               for name, by_seed in by_name.items()}
        ne = {name: per_seed(by_seed, "final_metric") for name, by_seed in by_name.items()}
        for name in by_name:
            twin = TWINS.get(name.split(" ")[0])
            vs_twin = ratios(per[name], per[twin]) if twin in per else None
            ne_rel = [None if x is None else x - 1 for x in ratios(ne[name], ne[twin])] if twin in ne else None
            lines.append(f"| {n} | `{name}` | {shown(per[name].values(), '{:,.0f}')} | "
                         f"{shown(ratios(per[name], per['local']), unit='x')} | "
                         f"{shown(vs_twin, unit='x') if vs_twin else '-'} | {verdict(vs_twin) if vs_twin else '-'} | "
                         f"{shown(ne[name].values(), '{:.4f}')} | "
                         f"{shown([100 * x for x in ne_rel], '{:+.2f}', '%') if ne_rel else '-'} |")
    name = "shadowsync_devices" if raw.get("device_ms") else "shadowsync"
    return {name: "\n".join(lines), name + "_targets": checks_markdown(targets(raw))}


def targets(raw: dict) -> list[tuple[str, bool]]:
    """ShadowSync's targets, on the median over seeds of each seed's ratio: a shadow solver's
    throughput >= 0.9x local's with as many trainers; its NE within 1% of its foreground
    twin's, or better."""
    out = []
    for n, by_name in raw["results"].items():
        tput = {name: per_seed(s, "throughput_samples_per_s") for name, s in by_name.items()}
        ne = {name: per_seed(s, "final_metric") for name, s in by_name.items()}
        for name in by_name:
            twin = TWINS.get(name.split(" ")[0])
            if twin is None or twin not in by_name:
                continue
            t = spread(ratios(tput[name], tput["local"]))
            out.append((f"{n} trainers: {name} per-trainer throughput {t[0]:.2f}x local's (median over seeds, range "
                        f"{t[1]:.2f}-{t[2]:.2f}; >= 0.9)", t[0] >= 0.9))
            rel = spread(ratios(ne[name], ne[twin]))
            out.append((f"{n} trainers: {name} NE {100 * (rel[0] - 1):+.2f}% against {twin}'s (median over seeds, "
                        f"range {100 * (rel[1] - 1):+.2f}% to {100 * (rel[2] - 1):+.2f}%; <= +1%)", rel[0] <= 1.01))
    return out


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--out", default="benchmarks/results/shadowsync")
    p.add_argument("--link", default="1gbit")
    p.add_argument("--trainers", default="1,2,4")
    p.add_argument("--steps", type=int, default=None, help="steps per trainer (default: 600; --devices: 400)")
    p.add_argument("--min-interval-ms", default=None,
                   help="shadow solvers' min_interval_ms values to run (default: 0,10,40; --devices: 0)")
    p.add_argument("--devices", action="store_true", help=f"emulated devices of {DEVICE_MS:g} ms per step")
    p.add_argument("--seeds", default="1", help="one run of every job per seed (default: 1)")
    p.add_argument("--json", default=None, help="the raw results (default: OUT/shadowsync.json)")
    args = p.parse_args()
    started = provenance("benchmarks/shadowsync.py")
    seeds = seed_list(args.seeds)
    steps = args.steps or (400 if args.devices else 600)
    device_ms = DEVICE_MS if args.devices else None
    plan = runs([float(v) for v in (args.min_interval_ms or ("0" if args.devices else "0,10,40")).split(",")])
    out = Path(args.out + ("_devices" if args.out == p.get_default("out") and args.devices else ""))
    trainers = [int(t) for t in args.trainers.split(",")]
    # one pass: enough generated logs for the most trainers
    logs = {"train": max(trainers) * steps * 256}
    keep = ("throughput_samples_per_s", "final_metric", "final_auc", "device", "phase_share", "solver_stats")
    results: dict[str, dict[str, dict[str, dict]]] = {}
    for n in trainers:
        configs = [RunConfig(workload="ctr", workload_options=logs, solver=solver, solver_options=opts, workers=n,
                             steps=steps, link=args.link, eval_every=steps // 3, timeout_s=120, device_ms=device_ms)
                   for _, solver, opts in plan]
        groups = compare_runs(configs, out / f"{n}-trainers", seeds)
        results[str(n)] = {name: kept(g, keep) for (name, _, _), g in zip(plan, groups)}
    payload = {"device_ms": device_ms, "link": args.link, "steps": steps, "results": results}
    finish(args.json or out / "shadowsync.json", started, render, payload, regime=regime(device_ms, args.link),
           seeds=seeds, checks=targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
