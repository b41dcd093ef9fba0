"""The seed's comparison: asynchronous against synchronous solvers, on two kinds of model.

Regime: CPU-bound workers behind emulated links (the default), or emulated devices behind
emulated links (``--devices``); needs root.

    python benchmarks/async_vs_sync.py [--out benchmarks/results/async_vs_sync]
    python benchmarks/async_vs_sync.py --devices --workers 4,8 [--seeds 1,2,3] [--settings wide] [--json PATH]

Method, raw results and figures: docs/benchmarks/async_vs_sync.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from common import (argument_parser, checks_markdown, compare_runs, finish, kept, per_seed, provenance, seed_list,
                    solver_entry)
from distsync.config import RunConfig
from distsync.metrics.repeats import ratios, shown, spread, verdict
from distsync.solvers import make_options, solver_class, takes_option

SOLVERS = ["allreduce", "sync-easgd", "sync-ps", "ea-wild", "ea-wild:tau=16", "async-easgd", "async-measgd", "easgd",
           "async-ps", "async-msgd"]
# Server momentum (async-msgd) and local Nesterov momentum (async-measgd) multiply the step.
LR_SCALE = {"async-msgd": 0.1, "async-measgd": 0.5}
#: (model, link, steps, device ms, setting)
CPU_SETTINGS = [("wide", "200mbit", 150, None, "communication-bound"), ("cnn", "1gbit", 300, None, "compute-bound")]
DEVICE_SETTINGS = [("wide", "1gbit", None, 10.0, "communication-bound"), ("cnn", "1gbit", None, 150.0, "compute-bound")]
KEEP = ("time_to_target_s", "final_metric", "throughput_samples_per_s", "steps_by_worker", "phase_share", "device",
        "bytes_sent", "wall_time_s", "budget", "time_to_target_from")


def lockstep(entry: str, workers: int) -> bool:
    """Whether the entry's workers take their steps in lockstep (a synchronous solver)."""
    solver, opts = solver_entry(entry)
    cls = solver_class(solver)
    return cls.Plan.lockstep_lead(make_options(cls, opts), workers) is not None


def column(setting) -> str:
    model, link, _, device_ms, kind = setting
    device = f", {device_ms:g} ms devices" if device_ms else ""
    return f"{model} @ {link}{device} ({kind})"


def regime(devices: bool) -> str:
    return ("emulated devices behind emulated 1 Gbit links" if devices
            else "emulated cluster: CPU-bound workers behind emulated links")


def render(raw: dict) -> dict[str, str]:
    """The page's table: per setting and solver, time to target, speedup over allreduce and
    final metric (median and range over seeds)."""
    lines = [f"{raw['repeats']} seeds ({', '.join(map(str, raw['seeds']))}) per cell: median (min-max); "
             f"speedup = allreduce's time to target / the solver's, per seed. Regime: {raw['regime']}.", "",
             "| workers | setting | solver | time to target (s) | speedup over allreduce | vs 1.0 | final metric |",
             "|---|---|---|---|---|---|---|"]
    for setting in raw["settings"]:
        model = setting[0]
        for w, by_model in raw["results"].items():
            if model not in by_model:
                continue
            base = per_seed(by_model[model]["allreduce"], "time_to_target_s")
            for entry, by_seed in by_model[model].items():
                t = per_seed(by_seed, "time_to_target_s")
                r = ratios(base, t)
                lines.append(f"| {w} | {column(setting)} | `{entry}` | {shown(t.values(), '{:.1f}')} | "
                             f"{'-' if entry == 'allreduce' else shown(r, unit='x')} | "
                             f"{'-' if entry == 'allreduce' else verdict(r)} | "
                             f"{shown([x['final_metric'] for x in by_seed.values()], '{:.4f}')} |")
    name = "async_vs_sync_devices" if raw.get("devices") else "async_vs_sync"
    return {name: "\n".join(lines), name + "_targets": checks_markdown(targets(raw))}


def targets(raw: dict) -> list[tuple[str, bool]]:
    """The seed's targets, on the median over seeds of each seed's ratio: communication-bound,
    ea-wild (and its tau=16 variant) >= 1.5x allreduce (and sync-easgd, emulated cluster);
    compute-bound, ea-wild no faster than the synchronous solvers."""
    settings = raw["settings"]
    comm_model = settings[0][0]
    compute_model = settings[1][0] if len(settings) > 1 else None
    rivals = ("allreduce",) if raw.get("devices") else ("allreduce", "sync-easgd")
    out = []

    def ttt(w: str, m: str, s: str) -> dict[str, float | None]:
        return per_seed(raw["results"][w][m].get(s, {}), "time_to_target_s")

    for w, by_model in raw["results"].items():
        for fast in ("ea-wild", "ea-wild:tau=16"):
            if fast not in by_model[comm_model]:
                continue
            for rival in rivals:
                got = spread(ratios(ttt(w, comm_model, rival), ttt(w, comm_model, fast)))
                if got:
                    out.append((f"{w} workers, {comm_model}: {fast} {got[0]:.2f}x {rival}'s speed to target "
                                f"(median over seeds, range {got[1]:.2f}-{got[2]:.2f}; target >= 1.5x)", got[0] >= 1.5))
        if compute_model is None or compute_model not in by_model:
            continue
        for sync in (e for e in by_model[compute_model] if lockstep(e, int(w))):
            got = spread(ratios(ttt(w, compute_model, "ea-wild"), ttt(w, compute_model, sync)))
            if got:
                out.append((f"{w} workers, {compute_model}: {sync} {got[0]:.2f}x ea-wild's speed to target "
                            f"(median over seeds, range {got[1]:.2f}-{got[2]:.2f}; target >= 1.0x)", got[0] >= 1.0))
    return out


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--out", default=None, help="run folders (default: benchmarks/results/async_vs_sync[_devices])")
    p.add_argument("--workers", default="4", help="comma-separated worker counts (default: 4)")
    p.add_argument("--solvers", default=",".join(SOLVERS))
    p.add_argument("--devices", action="store_true", help="emulated devices, each job to its target")
    p.add_argument("--cap", type=float, default=60.0, help="with --devices: seconds a job may train at most")
    p.add_argument("--seeds", default="1", help="one run of every job per seed (default: 1)")
    p.add_argument("--settings", default=None, help="comma-separated models of the settings to run (default: all)")
    p.add_argument("--json", default=None, help="the raw results (default: OUT/async_vs_sync.json)")
    args = p.parse_args()
    started = provenance("benchmarks/async_vs_sync.py")
    solvers = args.solvers.split(",")
    if solvers[0] != "allreduce":
        p.error("--solvers must start with allreduce (the baseline)")
    seeds = seed_list(args.seeds)
    settings = DEVICE_SETTINGS if args.devices else CPU_SETTINGS
    if args.settings:
        settings = [s for s in settings if s[0] in args.settings.split(",")]
    out = Path(args.out or ("benchmarks/results/async_vs_sync" + ("_devices" if args.devices else "")))
    table: dict[str, dict[str, dict[str, dict]]] = {}
    from distsync.workloads import load_workload

    for workers in [int(w) for w in args.workers.split(",")]:
        for model, link, steps, device_ms, _ in settings:
            w = load_workload(model)
            # one server per worker, but no more servers than the model has tensors to shard
            servers = min(workers, sum(1 for _ in w.make_model().parameters()))
            configs = []
            for entry in solvers:
                solver, opts = solver_entry(entry)
                if device_ms and takes_option(solver, "servers"):
                    opts = {"servers": servers, **opts}
                configs.append(RunConfig(workload=model, solver=solver, solver_options=opts, workers=workers,
                                         steps=steps, link=link, eval_every=10, lr=w.lr * LR_SCALE.get(solver, 1.0),
                                         timeout_s=120, device_ms=device_ms,
                                         budget=f"target,seconds={args.cap:g}" if device_ms else None))
            groups = compare_runs(configs, out / f"{workers}w" / model, seeds)
            table.setdefault(str(workers), {})[model] = {e: kept(g, KEEP) for e, g in zip(solvers, groups)}

    payload = {"settings": settings, "results": table, "devices": args.devices}
    finish(args.json or out / "async_vs_sync.json", started, render, payload, regime=regime(args.devices),
           seeds=seeds, checks=targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
