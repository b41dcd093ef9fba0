"""The simulator's sweep on docs/simulator.md: ``distsync sweep`` over workers,
computation/communication ratios and shares of slow workers, run in this process with the
arguments given, so that its output (``sweep.json``, ``scaling.png``, ``winners.png``) lands
in ``--out`` as the command writes it, and its rows, with how they were made, in the raw
results file that the page's tables render from.

    python benchmarks/sweep.py [DISTSYNC SWEEP OPTIONS ...] --out DIR [--json PATH]

The published sweep: ``python benchmarks/figures.py run sweep`` (its output in docs/sweep/,
its raw results in docs/benchmarks/raw/sweep.json). The sweep takes no seed (its simulator's
draws use seed 0), so a repeat gives the same rows: one run is the figure.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from common import argument_parser, provenance, write_record

from distsync.experiments.report import markdown_table

REGIME = "simulated (virtual workers, virtual time, in one process on this machine)"
#: the seed of the sweep's draws (slow workers, data order): ``run_sweep``'s, which the command does not take
SEED = 0


def render(raw: dict[str, Any]) -> str:
    """The page's block ``sweep``: which run it shows, then per worker count a table of the
    fastest solver to target in each cell (slow share x ratio), with allreduce's time beside
    it when allreduce is not the fastest."""
    rows = raw["rows"]
    machine = raw.get("machine") or {}
    lines = [f"`{raw.get('sweep', '?')}` (through `{raw.get('command', '?')}`) at commit {str(raw.get('commit'))[:10]}"
             + (" (the working tree differed)" if raw.get("dirty") else "")
             + f", {machine.get('cpu_count')} cores, torch {machine.get('torch')}, {raw.get('date', '')}; "
             f"{raw.get('seconds', 0) / 60:.1f} minutes of wall time. Regime: {raw.get('regime', REGIME)}.", ""]
    never = sorted({r["solver"] for r in rows} - {r["solver"] for r in rows if r["time_to_target_s"] is not None})
    lines += [f"Fastest to target per cell, with allreduce's time when it is not the fastest (virtual seconds; "
              f"ratio: computation/communication"
              + (f"; {', '.join(f'`{s}`' for s in never)} never reached the target" if never else "") + "):"]
    ratios = sorted({r["ratio"] for r in rows})
    for n in sorted({r["workers"] for r in rows}):
        table = []
        for share in sorted({r["slow_share"] for r in rows}):
            cells = []
            for ratio in ratios:
                here = [r for r in rows if (r["workers"], r["ratio"], r["slow_share"]) == (n, ratio, share)]
                reached = [r for r in here if r["time_to_target_s"] is not None]
                if not reached:
                    cells.append("none")
                    continue
                best = min(reached, key=lambda r: r["time_to_target_s"])  # (a tie: the first solver given)
                cell = f"{best['solver']} {best['time_to_target_s']:.2f}"
                base = next((r for r in here if r["solver"] == "allreduce"), None)
                if base is not None and base is not best:
                    cell += (f" (allreduce {base['time_to_target_s']:.2f})" if base["time_to_target_s"] is not None
                             else " (allreduce not reached)")
                cells.append(cell)
            table.append([f"{share:.0%}", *cells])
        lines += ["", f"**{n} workers**", *markdown_table(["slow share", *(f"{r:g}" for r in ratios)], table)]
    return "\n".join(lines)


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--out", required=True, help="the sweep's output folder (distsync sweep --out)")
    p.add_argument("--json", default="benchmarks/results/sweep.json", help="the raw results "
                   "(default: benchmarks/results/sweep.json)")
    args, sweep_args = p.parse_known_args()
    from distsync.cli import main as distsync

    started = provenance("benchmarks/sweep.py")
    command = ["sweep", *sweep_args, "--out", args.out]
    t0 = time.monotonic()
    rc = distsync(command)
    if rc != 0:
        return rc
    seconds = time.monotonic() - t0
    rows = json.loads((Path(args.out) / "sweep.json").read_text())
    write_record(args.json, started, regime=REGIME, seeds=[SEED], payload={
        "sweep": shlex.join(["distsync", *command]), "out": args.out, "seconds": seconds, "rows": rows})
    print()
    print(render(json.loads(Path(args.json).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
