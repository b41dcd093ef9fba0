"""distsync's solvers against the peers' own implementations, side by side in one run.

    python benchmarks/peers.py [--seeds 1,2,3] [--pairs NAME,...] [--device-ms 20] [--link 1gbit]

Method, raw results and figures: docs/benchmarks/peers.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from common import argument_parser, checks_markdown, compare_runs, finish, kept, per_seed, provenance, seed_list
from distsync.metrics.repeats import ratios, shown, spread
from distsync.config import RunConfig

#: name -> (ours, ours' options, peer, peer's options, what the peer is)
PAIRS = {
    "allreduce/ddp": ("allreduce", {}, "ddp", {}, "torch DistributedDataParallel"),
    "fp16/torch-fp16-hook": ("allreduce", {"compress": "fp16"}, "ddp", {"comm_hook": "fp16"},
                             "DDP with torch's fp16_compress_hook"),
    "powersgd/torch-powersgd-hook": ("allreduce", {"compress": "powersgd", "powersgd_start": 2}, "ddp",
                                     {"comm_hook": "powersgd", "powersgd_start": 2},
                                     "DDP with torch's powerSGD_hook (rank 1, both exact for 2 steps)"),
    "ma/torch-post-local-sgd": ("ma", {"every": 4}, "torch-local-sgd", {"every": 4},
                                "torch's PostLocalSGDOptimizer with a PeriodicModelAverager"),
    "diloco/torchft-diloco": ("diloco", {"every": 20}, "torchft-diloco", {"every": 20},
                              "torchft's DiLoCo (its Manager, lighthouse and process group)"),
    "streaming-diloco/torchft-streaming": ("streaming-diloco", {"every": 20, "fragments": 2, "delay": 1, "alpha": 0.5},
                                           "torchft-diloco", {"every": 20, "fragments": 2, "delay": 1, "alpha": 0.5},
                                           "torchft's Streaming DiLoCo"),
    "ad-psgd/hivemind-pairs": ("ad-psgd", {}, "hivemind-averaging", {"group_size": 2},
                               "hivemind's DecentralizedAverager on its DHT, groups of 2, every step"),
    "ripples/hivemind-groups": ("ripples", {"schedule": "smart", "group_size": 3}, "hivemind-averaging",
                                {"group_size": 3}, "hivemind's DecentralizedAverager, groups of up to 3, every step"),
}
#: peers that do not run here, and why
NOT_RUN: list[tuple[str, str, str]] = []
WORKLOAD, CAP_S = "digits", 20.0


def regime(device_ms: float, link: str | None) -> str:
    return (f"emulated devices ({device_ms:g} ms a step, the real math inside it), "
            + (f"emulated {link} links" if link else "loopback links"))


def pair_ratios(raw: dict, name: str) -> tuple[list, list]:
    """Per seed: ours / peer's throughput, and peer's / ours time to target."""
    row = raw["results"][name]
    thr = ratios(per_seed(row["ours"], "throughput_samples_per_s"), per_seed(row["peer"], "throughput_samples_per_s"))
    return thr, ratios(per_seed(row["peer"], "time_to_target_s"), per_seed(row["ours"], "time_to_target_s"))


def render(raw: dict) -> dict[str, str]:
    lines = [f"`{raw['workload']}`, {raw['repeats']} seeds ({', '.join(map(str, raw['seeds']))}) per pair: median "
             f"(min-max). Regime: {raw['regime']}. Each job to its target (cap {raw['cap_s']:g} s).", "",
             "| pair | ours | peer | ours (samples/s) | peer (samples/s) | throughput ours / peer | ours to target (s) "
             "| peer to target (s) | time to target peer / ours | final metric ours | final metric peer |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in raw["pairs"]:
        row = raw["results"][name]
        thr, ttt = pair_ratios(raw, name)

        def col(side, key, fmt="{:.2f}"):
            return shown(per_seed(row[side], key).values(), fmt)

        lines.append(f"| {name} | `{row['ours_label']}` | {row['peer_what']} | "
                     f"{col('ours', 'throughput_samples_per_s', '{:,.0f}')} | "
                     f"{col('peer', 'throughput_samples_per_s', '{:,.0f}')} | {shown(thr, unit='x')} | "
                     f"{col('ours', 'time_to_target_s')} | {col('peer', 'time_to_target_s')} | {shown(ttt, unit='x')} | "
                     f"{col('ours', 'final_metric', '{:.3f}')} | {col('peer', 'final_metric', '{:.3f}')} |")
    if raw["not_run"]:
        lines += ["", "Not run here:", ""]
        lines += [f"- {ours} against {peer}: {why}" for ours, peer, why in raw["not_run"]]
    return {"peers": "\n".join(lines), "peers_targets": checks_markdown(checks(raw))}


def checks(raw: dict) -> list[tuple[str, bool]]:
    """The targets: ours at least 1.0x the peer's throughput, and its time to target within
    the spread (the ranges of the two overlap) or better."""
    out = []
    for name in raw["pairs"]:
        row = raw["results"][name]
        thr, _ = pair_ratios(raw, name)
        s = spread(thr)
        if s is not None:
            out.append((f"{name}: throughput ours / peer median {s[0]:.2f}x (range {s[1]:.2f}-{s[2]:.2f}; "
                        f"target >= 1.0x)", s[0] >= 1.0))
        ours, peer = (spread(per_seed(row[k], "time_to_target_s").values()) for k in ("ours", "peer"))
        if ours is not None and peer is not None:
            out.append((f"{name}: time to target ours {ours[0]:.2f} s ({ours[1]:.2f}-{ours[2]:.2f}), peer "
                        f"{peer[0]:.2f} s ({peer[1]:.2f}-{peer[2]:.2f}); target: within the spread or sooner",
                        ours[1] <= peer[2]))
    return out


def label(solver: str, options: dict) -> str:
    return " ".join([solver, *(f"-o {k}={v}" for k, v in options.items())])


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--pairs", help=f"comma-separated, of: {', '.join(PAIRS)} (default: all)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--device-ms", type=float, default=20.0)
    p.add_argument("--link", help="emulated link for every worker, e.g. 1gbit (needs root)")
    p.add_argument("--cap", type=float, default=CAP_S, help="seconds each job may train at most")
    p.add_argument("--out", default="benchmarks/results/peers")
    p.add_argument("--json", help="default: OUT/peers.json")
    args = p.parse_args()
    started = provenance("benchmarks/peers.py")
    names = list(PAIRS) if not args.pairs else args.pairs.split(",")
    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        p.error(f"unknown pair(s) {', '.join(unknown)}; valid: {', '.join(PAIRS)}")
    seeds, out = seed_list(args.seeds), Path(args.out)
    keep = ("time_to_target_s", "final_metric", "throughput_samples_per_s", "bytes_sent", "phase_share", "device")
    results: dict[str, dict] = {}
    for name in names:
        ours, ours_o, peer, peer_o, what = PAIRS[name]
        configs = [RunConfig(workload=WORKLOAD, solver=solver, solver_options=dict(opts), workers=args.workers,
                             device_ms=args.device_ms, link=args.link, eval_every=10,
                             budget=f"target,seconds={args.cap:g}", timeout_s=120)
                   for solver, opts in ((ours, ours_o), (peer, peer_o))]
        # (each side goes first every other seed)
        got = compare_runs(configs, out / name.replace("/", "--"), seeds, alternate=True)
        results[name] = {"ours_label": label(ours, ours_o), "peer_what": what, "ours": kept(got[0], keep),
                         "peer": kept(got[1], keep)}
    payload = {"pairs": names, "results": results, "workload": WORKLOAD, "cap_s": args.cap, "not_run": NOT_RUN}
    finish(args.json or out / "peers.json", started, render, payload, regime=regime(args.device_ms, args.link),
           seeds=seeds, checks=checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
