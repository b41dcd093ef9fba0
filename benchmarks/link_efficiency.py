"""How much of an emulated link's rate an all-reduce actually gets.

    python benchmarks/link_efficiency.py [--repeats 3] [--sizes 1,10,50] [--json PATH]

Method, raw results and figures: docs/benchmarks/link_efficiency.md.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from common import argument_parser, finish, launch_or_exit, provenance

from distsync.metrics.repeats import shown, spread
from distsync.config import RunConfig

LINKS = ("100mbit", "1gbit", None)
WORKERS = (2, 4)
SIZES_MB = (1.0, 10.0, 50.0)
REGIME = "emulated links (netns + tbf) for 100mbit and 1gbit; unshaped: loopback, CPU-bound, for reference"


def render(raw: dict[str, Any]) -> dict[str, str]:
    """The page's table: per link, workers and size, the all-reduce bus and point-to-point
    bandwidth and their share of the link (median and range over repeats)."""
    reps = [str(s) for s in raw["seeds"]]
    lines = [f"{raw['repeats']} repeats per row (each a separate job, {raw['inner']} timing(s) per message): "
             f"median (min-max). Regime: {raw['regime']}.", "",
             "| link | workers | size (MiB) | all-reduce bus (Mbit/s) | of link | p2p (Mbit/s) | of link |",
             "|---|---|---|---|---|---|---|"]
    for by_rep in raw["results"].values():
        rs = [by_rep[r] for r in reps if r in by_rep]
        r0 = rs[0]
        share = (lambda k: shown([100 * r[k] for r in rs], "{:.0f}", "%")) if r0["allreduce_share"] is not None \
            else (lambda k: "-")
        lines.append(f"| {r0['link']} | {r0['workers']} | {r0['size_mb']:g} | "
                     f"{shown([r['allreduce_bus_mbps'] for r in rs], '{:,.1f}')} | {share('allreduce_share')} | "
                     f"{shown([r['p2p_mbps'] for r in rs], '{:,.1f}')} | {share('p2p_share')} |")
    return {"link_efficiency": "\n".join(lines)}


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--repeats", type=int, default=3, help="jobs per link and worker count (default: 3)")
    p.add_argument("--inner", type=int, default=1, help="timings of each message inside a job (default: 1)")
    p.add_argument("--sizes", default=",".join(f"{s:g}" for s in SIZES_MB), help="message sizes in MiB")
    p.add_argument("--links", default="100mbit,1gbit,unshaped")
    p.add_argument("--json", default="benchmarks/results/link_efficiency.json")
    args = p.parse_args()
    started = provenance("benchmarks/link_efficiency.py")
    sizes = [float(s) for s in args.sizes.split(",")]
    links = [None if x == "unshaped" else x for x in args.links.split(",")]
    reps = list(range(1, args.repeats + 1))
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in reps:
            for link in links:
                for workers in WORKERS:
                    cfg = RunConfig(workers=workers, link=link, task="linktest",
                                    task_options={"sizes_mb": sizes, "repeats": args.inner})
                    res = launch_or_exit(cfg, Path(tmp) / f"{rep}-{link}-{workers}")
                    rate = res["configured_bps"]
                    for r in res["rows"]:
                        row = {"link": link or "unshaped", "workers": workers, "size_mb": r["size_mb"],
                               "allreduce_bus_mbps": r["allreduce_bus_bps"] / 1e6, "p2p_mbps": r["p2p_bps"] / 1e6,
                               "allreduce_share": r["allreduce_bus_bps"] / rate if rate else None,
                               "p2p_share": r["p2p_bps"] / rate if rate else None}
                        results.setdefault(f"{row['link']} {workers}w {r['size_mb']:g}MiB", {})[str(rep)] = row
                        share = f"{row['allreduce_share']:.0%}" if rate else "-"
                        print(f"repeat {rep} {row['link']:>9} x{workers} {r['size_mb']:>4g} MiB: all-reduce bus "
                              f"{row['allreduce_bus_mbps']:>9,.1f} Mbit/s ({share})", flush=True)
    payload = {"inner": args.inner, "sizes_mb": sizes, "results": results}
    print()
    checks = []
    for key, by_rep in results.items():
        shares = [r["allreduce_share"] for r in by_rep.values()]
        if shares[0] is not None and next(iter(by_rep.values()))["size_mb"] >= 10:
            med = spread(shares)[0]
            checks.append((f"{key}: all-reduce bus {med:.0%} of the link (median; >= 80%)", med >= 0.8))
    return finish(args.json, started, render, payload, regime=REGIME, seeds=reps, checks=lambda raw: checks)


if __name__ == "__main__":
    sys.exit(main())
