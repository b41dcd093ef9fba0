"""How much of an emulated link's rate an all-reduce actually gets.

For 2 and 4 workers, at 100 Mbit, 1 Gbit and unshaped (loopback), all-reduce bus bandwidth
(2 (p - 1) / p * bytes / time, what each host's link carries in a ring all-reduce) and
point-to-point bandwidth for messages of 1, 10 and 50 MiB. Target: >= 80% of the link rate
for messages of 10 MiB and more. Needs root (network namespaces).

    python benchmarks/link_efficiency.py [--repeats 3] [--json benchmarks/results/link_efficiency.json]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from common import argument_parser, launch_or_exit, print_table, write_results
from distsync.config import RunConfig

LINKS = ("100mbit", "1gbit", None)
WORKERS = (2, 4)
SIZES_MB = (1.0, 10.0, 50.0)


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="benchmarks/results/link_efficiency.json")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for link in LINKS:
            for workers in WORKERS:
                cfg = RunConfig(workers=workers, link=link, task="linktest",
                                task_options={"sizes_mb": list(SIZES_MB), "repeats": args.repeats})
                res = launch_or_exit(cfg, Path(tmp) / f"{link}-{workers}")
                for r in res["rows"]:
                    rate = res["configured_bps"]
                    row = {"link": link or "unshaped", "workers": workers, "size_mb": r["size_mb"],
                           "allreduce_bus_mbps": r["allreduce_bus_bps"] / 1e6, "p2p_mbps": r["p2p_bps"] / 1e6,
                           "allreduce_share": r["allreduce_bus_bps"] / rate if rate else None,
                           "p2p_share": r["p2p_bps"] / rate if rate else None}
                    rows.append(row)
                    share = f"{row['allreduce_share']:.0%}" if rate else "-"
                    print(f"{row['link']:>9} x{workers} {r['size_mb']:>4g} MiB: all-reduce bus "
                          f"{row['allreduce_bus_mbps']:>9,.1f} Mbit/s ({share})", flush=True)
    print()
    pct = lambda v: f"{v:.0%}" if v is not None else "-"  # noqa: E731
    print_table(["link", "workers", "size (MiB)", "all-reduce bus (Mbit/s)", "of link", "p2p (Mbit/s)", "of link"],
                [[r["link"], r["workers"], f"{r['size_mb']:g}", f"{r['allreduce_bus_mbps']:,.1f}", pct(r["allreduce_share"]),
                  f"{r['p2p_mbps']:,.1f}", pct(r["p2p_share"])] for r in rows])
    write_results(args.json, {"rows": rows})
    ok = all(r["allreduce_share"] >= 0.8 for r in rows if r["allreduce_share"] is not None and r["size_mb"] >= 10)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
