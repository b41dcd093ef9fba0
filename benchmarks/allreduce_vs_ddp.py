"""Throughput of our `allreduce` against PyTorch DDP, side by side in one run.

For each (workload, workers) row the two solvers run alternately, ``--rounds`` times each,
on the same seed, data and step budget; the row reports the median throughput of each and
the ratio ours / DDP (target: >= 1.0 on every row).

    python benchmarks/allreduce_vs_ddp.py [--rounds 3] [--link 1gbit] [--json PATH]

On a GPU: ``--device cuda --rows cnn:1`` (one worker per GPU over nccl); several workers
sharing one GPU need ``--backend gloo`` (docs/gpu.md).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from common import argument_parser, compare_runs, finish, provenance

from distsync.metrics.repeats import shown, spread
from distsync.config import RunConfig

ROWS = [("digits", 2, 300), ("digits", 4, 300), ("cnn", 2, 60), ("cnn", 4, 60)]
STEPS = {"digits": 300, "cnn": 60}
SOLVERS = ("allreduce", "ddp")


def regime(link: str | None, device: str) -> str:
    where = "CPU-bound real run (the workers share this machine's cores)" if device != "cuda" else "real GPU run"
    return where + (f", emulated {link} links" if link else ", loopback")


def round_ratios(row: dict) -> list[float]:
    """ours / DDP per round (the two ran back to back in each round)."""
    return [a / d for a, d in zip(row["all"]["allreduce"], row["all"]["ddp"])]


def render(raw: dict) -> dict[str, str]:
    """The page's table: per row, each solver's throughput and the ratio (median, range over rounds)."""
    lines = [f"{raw['repeats']} rounds per row (the two solvers back to back in each, alternating which goes first): "
             f"median (min-max). Regime: {raw['regime']}.", "",
             "| workload | workers | steps | allreduce (samples/s) | ddp (samples/s) | ours / DDP |",
             "|---|---|---|---|---|---|"]
    for r in raw["rows"]:
        lines.append(f"| {r['workload']} | {r['workers']} | {r['steps']} | {shown(r['all']['allreduce'], '{:,.0f}')} | "
                     f"{shown(r['all']['ddp'], '{:,.0f}')} | {shown(round_ratios(r), unit='x')} |")
    every = [x for r in raw["rows"] for x in round_ratios(r)]
    med, lo, hi = spread(every)
    lines += ["", f"Over every row and round: ours / DDP {med:.2f}x (range {lo:.2f}-{hi:.2f}x)."]
    on_gpu = any(r.get("device") == "cuda" for r in raw["rows"])
    return {"allreduce_vs_ddp-gpu" if on_gpu else "allreduce_vs_ddp": "\n".join(lines)}


def targets(raw: dict) -> list[tuple[str, bool]]:
    """Ours at least as fast as DDP on every row (the median over rounds)."""
    return [(f"{r['workload']} x{r['workers']}: ours / DDP {r['ratio']:.2f}x (target >= 1.0x)", r["ratio"] >= 1.0)
            for r in raw["rows"]]


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="default: benchmarks/results/allreduce_vs_ddp[-LINK].json")
    p.add_argument("--rows", help="WORKLOAD:WORKERS[,...] instead of the default rows, e.g. digits:2,cnn:1")
    p.add_argument("--link", help="emulated link for every worker, e.g. 1gbit (needs root)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--backend", default="auto", help="auto | nccl | gloo (what carries CUDA tensors)")
    args = p.parse_args()
    started = provenance("benchmarks/allreduce_vs_ddp.py")
    rows = ROWS
    if args.rows:
        rows = [(w, int(n), STEPS.get(w, 100)) for w, n in (r.split(":") for r in args.rows.split(","))]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for workload, workers, steps in rows:
            configs = [RunConfig(workload=workload, solver=solver, workers=workers, steps=steps, eval_every=10**6,
                                 link=args.link, device=args.device, backend=args.backend) for solver in SOLVERS]
            # (the two back to back in each round, each going first every other round)
            groups = compare_runs(configs, Path(tmp) / f"{workload}-{workers}", range(args.rounds), alternate=True)
            samples = {s: [x["throughput_samples_per_s"] for x in g["summaries"]] for s, g in zip(SOLVERS, groups)}
            med = {s: statistics.median(v) for s, v in samples.items()}
            results.append({"workload": workload, "workers": workers, "steps": steps, "rounds": args.rounds,
                            "link": args.link, "device": args.device, "backend": args.backend,
                            "allreduce_samples_per_s": med["allreduce"], "ddp_samples_per_s": med["ddp"],
                            "ratio": med["allreduce"] / med["ddp"], "all": samples})
    return finish(args.json or f"benchmarks/results/allreduce_vs_ddp{'-' + args.link if args.link else ''}.json",
                  started, render, {"rows": results}, regime=regime(args.link, args.device),
                  seeds=list(range(args.rounds)), checks=targets)


if __name__ == "__main__":
    sys.exit(main())
