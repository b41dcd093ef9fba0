"""allreduce's next-forward overlap changes no bit of the model: 50 steps of digits, cnn and the
resnet50 workload on 2 and 4 workers, with ``next_forward`` on (the default) and off, side by
side, every parameter and buffer compared for equality.

    python benchmarks/next_forward_equal.py [--workloads digits,cnn,resnet50] [--workers 2,4] [--steps 50]

Regime: real runs on this machine's cores (CPU-bound; equality does not depend on the pace).
Method and table: docs/benchmarks/real_sizes.md.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import argument_parser, finish, launch_or_exit, provenance

from distsync.config import RunConfig

REGIME = "real runs on this machine's cores (CPU-bound: equality does not depend on the pace)"
#: buckets small enough that every model has several (under the 25 MiB default, digits and cnn have one)
BUCKET_MB = {"digits": 0.002, "cnn": 0.05, "resnet50": 25.0}


def run(workload: str, workers: int, steps: int, next_forward: bool, out: Path) -> tuple[dict, dict[str, Any]]:
    cfg = RunConfig(workload=workload, solver="allreduce", workers=workers, steps=steps, eval_every=10**6, seed=1,
                    solver_options={"bucket_mb": BUCKET_MB[workload], "next_forward": next_forward})
    run_dir = out / f"{workload}-{workers}-{next_forward}"
    summary = launch_or_exit(cfg, run_dir)
    model = torch.load(run_dir / "model.pt", weights_only=True)
    return model, summary["solver_stats"]["0"]["next_forward"]


def render(raw: dict[str, Any]) -> dict[str, str]:
    lines = [f"Regime: {raw['regime']}. `allreduce` with `next_forward` on (the default) and off, the same seed and "
             f"data; the model saved at the end compared tensor by tensor.", "",
             "| workload | workers | steps | buckets | sent during backward | steps held | tensors | bit-identical |",
             "|---|---|---|---|---|---|---|---|"]
    for r in raw["rows"]:
        lines.append(f"| {r['workload']} | {r['workers']} | {r['steps']} | {r['buckets']} | {r['during_backward']} | "
                     f"{r['held_steps']} | {r['tensors']} | {'yes' if r['equal'] else 'no: ' + r['first_difference']} |")
    return {"next_forward_equal": "\n".join(lines)}


def checks(raw: dict[str, Any]) -> list[tuple[str, bool]]:
    return [(f"{r['workload']} x{r['workers']}, {r['steps']} steps: models bit-identical with next_forward on and off, "
             f"{r['held_steps']} steps held", r["equal"] and r["held_steps"] > 0) for r in raw["rows"]]


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--workloads", default="digits,cnn,resnet50")
    p.add_argument("--workers", default="2,4")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--json", default="benchmarks/results/next_forward_equal.json")
    args = p.parse_args()
    started = provenance("benchmarks/next_forward_equal.py")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads.split(","):
            for workers in (int(w) for w in args.workers.split(",")):
                held, stats = run(workload, workers, args.steps, True, Path(tmp))
                bounded, _ = run(workload, workers, args.steps, False, Path(tmp))
                differ = [k for k in held if not torch.equal(held[k], bounded[k])]
                rows.append({"workload": workload, "workers": workers, "steps": args.steps,
                             "buckets": stats["buckets"], "during_backward": stats["during_backward"],
                             "held_steps": stats["held_steps"], "tensors": len(held), "equal": not differ,
                             "first_difference": differ[0] if differ else ""})
                print(rows[-1], flush=True)
    return finish(args.json, started, render, {"rows": rows}, regime=REGIME, seeds=[1], checks=checks)


if __name__ == "__main__":
    sys.exit(main())
