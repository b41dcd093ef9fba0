"""Real sizes against their limits: allreduce and DDP at ResNet-50's and GPT-2 small's sizes
beside the ring's bound, parameter servers sharded over 1, 2 and 4 servers beside their links'
bound, and each worker's peak memory.

Regime: emulated devices (each step's device time is the workload's published GPU step time,
``STEP_MS`` in its module; backward's two thirds of it spent as the gradients become ready,
``--device-backward``) behind emulated links (netns + tbf), on one machine.

    sudo python benchmarks/real_sizes.py [--models resnet50,gpt2] [--links 1gbit,10gbit] [--workers 4,8]
                                         [--parts ring,servers] [--seeds 1,2,3] [--steps 6] [--json PATH]

A setting's solvers run side by side: each seed runs every one of them, one after another,
in an order reversed every other seed.

Method, raw results and figures: docs/benchmarks/real_sizes.md.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import (argument_parser, checks_markdown, finish, launch_or_exit, provenance, seed_list, solver_entry,
                    write_record)

from distsync.config import RunConfig, parse_link
from distsync.metrics.repeats import median, shown
from distsync.workloads import load_workload
from distsync.workloads import gpt2, resnet50

#: per model: its device time per step (ms), and the batch and options that keep the math on
#: this CPU inside it
MODELS = {"resnet50": (resnet50.STEP_MS, 2, {}), "gpt2": (gpt2.STEP_MS, 1, {})}
#: allreduce as it runs (its front buckets on the wire into the next forward), allreduce with
#: each step's update inside its step, and DDP
RING = ("allreduce", "allreduce:next_forward=false", "ddp")
#: a row whose steps ran over their device time this often is CPU-bound: its time says what this
#: machine's CPU does, not what the link allows (the bound is not judged there)
CPU_BOUND = 0.5
BACKWARD_SHARE = 2 / 3
REGIME = "emulated devices (published GPU step times) behind emulated links, on one machine"
SERVERS = (1, 2, 4)


def model_bytes(model: str) -> int:
    net = load_workload(model, MODELS[model][2]).make_model()
    return sum(p.numel() * p.element_size() for p in net.parameters())


def ring_s(nbytes: float, workers: int, bandwidth_bps: float) -> float:
    """A ring all-reduce's time on links of ``bandwidth_bps``: 2 (n-1)/n of the bytes each way."""
    return 2 * (workers - 1) / workers * nbytes * 8 / bandwidth_bps


def servers_s(nbytes: float, workers: int, servers: int, bandwidth_bps: float) -> float:
    """A synchronous parameter-server round: the gradients out of each worker's link (the
    whole model) and into each server's (every worker's shard), then the parameters back the
    same way; the busier of the two links sets each direction's time."""
    return 2 * max(1.0, workers / servers) * nbytes * 8 / bandwidth_bps


def run(model: str, solver: str, workers: int, link: str, steps: int, seed: int, out: Path) -> dict[str, Any]:
    name, options = solver_entry(solver)
    step_ms, batch, workload_options = MODELS[model]
    cfg = RunConfig(workload=model, workload_options=workload_options, solver=name, solver_options=options,
                    workers=workers, steps=steps, batch_size=batch, eval_every=10**6, seed=seed, link=link,
                    device_ms=step_ms, device_backward=BACKWARD_SHARE)
    run_dir = out / f"{model}-{solver}-{workers}-{link}-{seed}"
    s = launch_or_exit(cfg, run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # (a GPT-2 run leaves a 500 MB model behind)
    return {"step_s": s["step_s"], "samples_per_s": s["throughput_samples_per_s"],
            "peak_rss_mib": max(w.get("peak_rss_mib", 0.0) for w in s["per_worker"].values()),
            "math_ms": s["device"]["math_ms"], "share_over": s["device"]["share_over"]}


def cell_bounds(model: str, nbytes: int, workers: int, link: str, math_ms: float, kind: str, servers: int = 0):
    """(compute, communication, bound with overlap, bound without) in seconds: compute is the
    device time, or the real math where it took longer (a CPU-bound run)."""
    compute = max(MODELS[model][0], math_ms) / 1000
    bw = parse_link(link).bandwidth_bps
    comm = ring_s(nbytes, workers, bw) if kind == "ring" else servers_s(nbytes, workers, servers, bw)
    return compute, comm, max(compute, comm), compute + comm


def render(raw: dict[str, Any]) -> dict[str, str]:
    head = (f"{raw['repeats']} repeats per row: median (min-max). Regime: {raw['regime']}. Step: the slowest "
            f"worker's median step after the first; bound with overlap max(compute, comm), without compute + comm; "
            f"compute is the device time (or the real math where a step overran it: CPU-bound rows say so).")
    blocks = {}
    name = "real_sizes_" + "_".join(dict.fromkeys(r["model"] for r in raw["rows"]))  # (a block per model run)
    for part in ("ring", "servers"):
        key = f"{name}_{part}"
        rows = [r for r in raw["rows"] if r["part"] == part]
        if not rows:
            continue
        bound = "bound s (overlap / none)" if part == "ring" else "bound s (a round after backward)"
        lines = [head, "",
                 f"| model | link | workers | solver | step s | {bound} | step / bound | "
                 "samples/s | peak MiB per worker | steps over device time |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            runs, limit = r["runs"], r["bound_overlap_s"] if part == "ring" else r["bound_none_s"]
            bounds = (f"{r['bound_overlap_s']:.2f} / {r['bound_none_s']:.2f}" if part == "ring"
                      else f"{r['bound_none_s']:.2f}")
            lines.append(
                f"| {r['model']} ({r['model_mb']:.0f} MB) | {r['link']} | {r['workers']} | {r['solver']} | "
                f"{shown([x['step_s'] for x in runs])} | {bounds} | "
                f"{shown([x['step_s'] / limit for x in runs], unit='x')} | "
                f"{shown([x['samples_per_s'] for x in runs], '{:.1f}')} | "
                f"{shown([x['peak_rss_mib'] for x in runs], '{:,.0f}')} | "
                f"{shown([x['share_over'] for x in runs], '{:.0%}')} |")
        blocks[key] = "\n".join(lines)
    found = checks(raw)  # (from the rows: the targets as this code states them)
    if found:
        blocks[f"{name}_targets"] = checks_markdown(found)
    return blocks


def checks(raw: dict[str, Any]) -> list[tuple[str, bool | None]]:
    """The targets of each allreduce row: its step within 10% of max(compute, ring) where the row
    is not CPU-bound; at least 1.15x DDP's throughput where communication is at least the
    compute (at least DDP's elsewhere); peak memory at most 1.2x DDP's."""
    out: list[tuple[str, bool | None]] = []
    by = {(r["model"], r["link"], r["workers"], r["solver"]): r for r in raw["rows"] if r["part"] == "ring"}
    for (model, link, workers, solver), r in by.items():
        if solver.partition(":")[0] == "ddp":  # (DDP is what the others are set against)
            continue
        where = f"{model} x{workers} on {link}"
        step = median(x["step_s"] for x in r["runs"])
        over = median(x["share_over"] for x in r["runs"])
        text = f"{solver} within 10% of max(compute, ring), {where}: {step / r['bound_overlap_s']:.2f}x"
        if over > CPU_BOUND:
            out.append((f"{text} (CPU-bound: {over:.0%} of steps over their device time)", None))
        else:
            out.append((text, step <= 1.1 * r["bound_overlap_s"]))
        ddp = by.get((model, link, workers, "ddp"))
        if ddp is not None:
            ratio = median(a["samples_per_s"] / d["samples_per_s"] for a, d in zip(r["runs"], ddp["runs"]))
            mem = median(a["peak_rss_mib"] / d["peak_rss_mib"] for a, d in zip(r["runs"], ddp["runs"]))
            want = 1.15 if r["comm_s"] >= r["compute_s"] else 1.0
            why = "communication at least the compute" if want > 1.0 else "compute above communication"
            out.append((f"{solver} at least {want:.2f}x DDP's throughput ({why}), {where}: {ratio:.2f}x",
                        ratio >= want))
            out.append((f"{solver}'s peak memory at most 1.2x DDP's, {where}: {mem:.2f}x", mem <= 1.2))
    return out


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--models", default="resnet50,gpt2")
    p.add_argument("--links", default="1gbit,10gbit")
    p.add_argument("--workers", default="4,8")
    p.add_argument("--parts", default="ring,servers", help="ring (allreduce, ddp) and/or servers (sync-ps sharded)")
    p.add_argument("--solvers", default=",".join(RING), help="the ring part's solvers (SOLVER[:KEY=VALUE])")
    p.add_argument("--seeds", default="1,2,3", help="one run of every row per seed")
    p.add_argument("--steps", type=int, default=8, help="steps per worker (the first is left out of the step time; "
                   "allreduce measures its wire on the first two)")
    p.add_argument("--json", default="benchmarks/results/real_sizes.json")
    args = p.parse_args()
    started = provenance("benchmarks/real_sizes.py")
    seeds = seed_list(args.seeds)
    models, links = args.models.split(","), args.links.split(",")
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)}; valid: {', '.join(MODELS)}")
    settings = []  # (part, model, link, workers, [(solver, servers)]): its solvers run side by side
    for model in models:
        for link in links:
            for n in (int(w) for w in args.workers.split(",")):
                if "ring" in args.parts:
                    settings.append(("ring", model, link, n, [(solver, 0) for solver in args.solvers.split(",")]))
                if "servers" in args.parts:
                    settings.append(("servers", model, link, n, [(f"sync-ps:servers={k}", k) for k in SERVERS]))
    sizes = {m: model_bytes(m) for m in models}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for part, model, link, n, solvers in settings:
            # a seed's runs of every solver one after another, in turn reversed every other seed:
            # what else shares the machine meanwhile falls on all of them alike
            runs: dict[str, list[dict[str, Any]]] = {solver: [] for solver, _ in solvers}
            for i, seed in enumerate(seeds):
                for solver, _ in (solvers if i % 2 == 0 else solvers[::-1]):
                    runs[solver].append(run(model, solver, n, link, args.steps, seed, Path(tmp)))
            for solver, servers in solvers:
                done = runs[solver]
                compute, comm, overlap, none = cell_bounds(model, sizes[model], n, link,
                                                           median(r["math_ms"] for r in done), part, servers)
                rows.append({"part": part, "model": model, "model_mb": sizes[model] / 1e6, "link": link,
                             "workers": n, "solver": solver, "compute_s": compute, "comm_s": comm,
                             "bound_overlap_s": overlap, "bound_none_s": none, "runs": done})
                print(f"{model} {link} x{n} {solver}: step {shown([r['step_s'] for r in done])} s, "
                      f"bound {overlap:.2f}/{none:.2f} s, over {shown([r['share_over'] for r in done], '{:.0%}')}",
                      flush=True)
            # (written after each setting: a run stopped early keeps the rows it finished)
            write_record(args.json, started, regime=REGIME, seeds=seeds, announce=False,
                         payload={"rows": rows, "device_backward": BACKWARD_SHARE, "partial": True})
    payload = {"rows": rows, "device_backward": BACKWARD_SHARE,
               "models": {m: {"step_ms": MODELS[m][0], "batch": MODELS[m][1], "bytes": sizes[m]} for m in models}}
    return finish(args.json, started, render, payload, regime=REGIME, seeds=seeds, checks=checks)


if __name__ == "__main__":
    sys.exit(main())
