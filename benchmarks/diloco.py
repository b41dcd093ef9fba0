"""DiLoCo's and Streaming DiLoCo's claims, in the regime this machine allows.

Regime: simulated (part ``quality``, train mode); emulated devices behind an emulated link
(part ``overlap``; root).

    python benchmarks/diloco.py [--part quality|overlap|both] [--seeds 1,2,3] [--steps 600]

Method, raw results and figures: docs/benchmarks/diloco.md.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from common import argument_parser, compare_runs, finish, per_seed, provenance, seed_list
from distsync.metrics.repeats import shown
from distsync.comm import ring_allreduce_bytes
from distsync.config import RunConfig

#: (label, solver, options) of the quality part
QUALITY = [
    ("allreduce", "allreduce", {}),
    ("ma every=50", "ma", {"every": 50}),
    ("diloco every=10", "diloco", {"every": 10}),
    ("diloco every=50", "diloco", {"every": 50}),
    ("streaming-diloco every=50 fragments=5", "streaming-diloco", {"every": 50, "fragments": 5, "delay": 1}),
]
#: (label, solver, options) of the overlap part
OVERLAP = [
    ("diloco every=20", "diloco", {"every": 20}),
    ("streaming-diloco every=20 fragments=4 delay=0", "streaming-diloco", {"every": 20, "fragments": 4, "delay": 0}),
    ("streaming-diloco every=20 fragments=4 delay=2", "streaming-diloco", {"every": 20, "fragments": 4, "delay": 2}),
]
ADAMW_LR = 0.003


def sync_bytes(options: dict, steps: int, workers: int) -> tuple[float, float, int]:
    """Per worker: bytes sent over ``steps``, the largest single synchronization's, and the
    number of synchronizations (ring all-reduces of fp32 parameters): every step, every
    ``every`` steps, or (with ``fragments``) a fragment every ``every / fragments`` steps."""
    from distsync.solvers.diloco import layer_fragments
    from distsync.workloads import load_workload

    model = load_workload("lm").make_model()
    sizes = {n: p.numel() * 4 for n, p in model.named_parameters()}
    parts = [ring_allreduce_bytes(sum(sizes[k] for k in names), workers)
             for names in layer_fragments(list(sizes), options.get("fragments", 1))]
    n = steps // (options.get("every", 1) // options.get("fragments", 1))
    return sum(parts[i % len(parts)] for i in range(n)), max(parts), n


def quality(seeds: list[int], steps: int, workers: int) -> dict:
    from distsync.sim.train import simulate_training
    from distsync.workloads import load_workload

    w = load_workload("lm")
    out: dict[str, dict] = {}
    for label, solver, options in QUALITY:
        total, peak, syncs = sync_bytes(options, steps, workers)
        out[label] = {"solver": solver, "options": options, "bytes_per_worker": total, "peak_sync_bytes": peak,
                      "syncs": syncs, "seeds": {}}
        for seed in seeds:
            last = simulate_training(solver, options, w, workers, steps, lr=ADAMW_LR, optimizer="adamw", seed=seed,
                                     eval_every=steps).curve[-1]
            out[label]["seeds"][str(seed)] = {"loss": last["loss"], "metric": last["metric"],
                                              "perplexity": math.exp(last["loss"])}
    return out


def overlap(seeds: list[int], workers: int, device_ms: float, link: str, steps: int, out_dir: Path) -> dict:
    configs = [RunConfig(workload="lm", solver=solver, solver_options=dict(options), workers=workers, steps=steps,
                         optimizer="adamw", lr=ADAMW_LR, device_ms=device_ms, link=link, eval_every=10**6,
                         timeout_s=120) for _, solver, options in OVERLAP]
    out: dict[str, dict] = {}
    for (label, solver, options), group in zip(OVERLAP, compare_runs(configs, out_dir, seeds)):
        out[label] = {"solver": solver, "options": options, "seeds": {}}
        for seed, s in zip(group["seeds"], group["summaries"]):
            share = s.get("phase_share") or {}
            out[label]["seeds"][str(seed)] = {"comm_share": share.get("comm"), "wait_share": share.get("wait"),
                                              "throughput_samples_per_s": s["throughput_samples_per_s"],
                                              "device": s.get("device")}
    return out


def _col(row: dict, key: str, fmt: str) -> str:
    return shown(per_seed(row["seeds"], key).values(), fmt)


def render(raw: dict) -> dict[str, str]:
    blocks = {}
    q = raw.get("quality")
    if q:
        lines = [f"`lm`, {raw['workers']} workers, {raw['steps']} steps each, AdamW inner steps (lr {ADAMW_LR:g}), "
                 f"{raw['repeats']} seeds: median (min-max). Regime: simulated (train mode: the same math as real runs).",
                 "", "| solver | syncs per worker | MB sent per worker | largest sync (MB) | eval loss | perplexity | "
                 "next-byte accuracy |", "|---|---|---|---|---|---|---|"]
        for label, row in q.items():
            lines.append(f"| `{label}` | {row['syncs']} | {row['bytes_per_worker'] / 1e6:.1f} | "
                         f"{row['peak_sync_bytes'] / 1e6:.3f} | {_col(row, 'loss', '{:.3f}')} | "
                         f"{_col(row, 'perplexity', '{:.2f}')} | {_col(row, 'metric', '{:.3f}')} |")
        blocks["diloco_quality"] = "\n".join(lines)
    o = raw.get("overlap")
    if o:
        lines = [f"`lm`, {raw['workers']} workers, {raw['overlap_steps']} steps, {raw['device_ms']:g} ms emulated "
                 f"devices behind {raw['link']} links: the share of a worker's time communicating and waiting, median "
                 f"(min-max) over {raw['repeats']} seeds.", "",
                 "| solver | communicating | waiting | samples/s |", "|---|---|---|---|"]
        for label, row in o.items():
            lines.append(f"| `{label}` | {_col(row, 'comm_share', '{:.1%}')} | {_col(row, 'wait_share', '{:.1%}')} | "
                         f"{_col(row, 'throughput_samples_per_s', '{:,.0f}')} |")
        blocks["diloco_overlap"] = "\n".join(lines)
    return blocks


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--part", default="both", choices=("quality", "overlap", "both"))
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=600, help="steps per worker of the quality part")
    p.add_argument("--overlap-steps", type=int, default=100)
    p.add_argument("--device-ms", type=float, default=50.0)
    p.add_argument("--link", default="100mbit")
    p.add_argument("--out", default="benchmarks/results/diloco")
    p.add_argument("--json", help="default: OUT/diloco.json")
    args = p.parse_args()
    started = provenance("benchmarks/diloco.py")
    seeds = seed_list(args.seeds)
    raw: dict = {"workers": args.workers, "steps": args.steps, "overlap_steps": args.overlap_steps,
                 "device_ms": args.device_ms, "link": args.link}
    if args.part in ("quality", "both"):
        raw["quality"] = quality(seeds, args.steps, args.workers)
    if args.part in ("overlap", "both"):
        raw["overlap"] = overlap(seeds, args.workers, args.device_ms, args.link, args.overlap_steps, Path(args.out))
    regime = {"quality": "simulated (train mode)", "overlap": "emulated devices behind emulated links",
              "both": "simulated (train mode); emulated devices behind emulated links"}[args.part]
    finish(args.json or Path(args.out) / "diloco.json", started, render, raw, regime=regime, seeds=seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
