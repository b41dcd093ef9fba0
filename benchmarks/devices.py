"""How far emulated devices hold on this machine: for each workload and worker count, one
`allreduce` run with `--device-ms`, and the share of steps whose real math overran the device
time, the median real math of a step (forward and backward) and of a whole step, and how busy
the machine's cores were while the job trained (sampled from /proc/stat; start-up excluded).

A run is an emulation of N dedicated devices while its steps stay within their device time
(at most 5% over, the threshold of `summary.json`'s `device.cpu_bound`); past that it is
CPU-bound and its numbers speak for this machine, not for the devices.

    python benchmarks/devices.py [--workers 4,8,16] [--out benchmarks/results/devices]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from common import argument_parser, launch_or_exit, table_header, table_row, write_results
from distsync.config import RunConfig

#: (workload, device ms per step, steps): device times a few times each one's real math alone
WORKLOADS = [("digits", 10.0, 200), ("mnist", 20.0, 150), ("cnn", 40.0, 100), ("ctr", 40.0, 100)]


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all cores, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


class CpuSampler(threading.Thread):
    """(unix time, busy, total) every ``every`` seconds until stopped."""

    def __init__(self, every: float = 0.2):
        super().__init__(daemon=True)
        self.every, self.samples, self.done = every, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.time(), *cpu_jiffies()))
            self.done.wait(self.every)

    def busy_between(self, t0: float, t1: float) -> float | None:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return None
        (_, b0, a0), (_, b1, a1) = inside[0], inside[-1]
        return (b1 - b0) / max(1, a1 - a0)


def training_window(run_dir: Path) -> tuple[float, float]:
    """Unix times of the first worker's start and the last step's end, from events.jsonl."""
    starts, ends = {}, []
    with open(run_dir / "events.jsonl") as f:
        for line in f:
            e = json.loads(line)
            if e.get("kind") == "start":
                starts[e["rank"]] = e["unix"]
            elif e.get("kind") == "step" and e.get("rank") in starts:
                ends.append(starts[e["rank"]] + e["t"])
    return min(starts.values()), max(ends)


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--out", default="benchmarks/results/devices")
    p.add_argument("--workers", default="4,8,16")
    p.add_argument("--workloads", default=",".join(w for w, _, _ in WORKLOADS))
    p.add_argument("--device-ms", type=float, default=None, help="one device time for every workload given")
    p.add_argument("--json", default=None, help="also write the rows here (e.g. docs/benchmarks/devices.json)")
    p.add_argument("--append", action="store_true", help="add the rows to those already in --json")
    args = p.parse_args()
    out = Path(args.out)
    wanted = args.workloads.split(",")
    rows = []
    plan = [(w, args.device_ms or ms, steps) for w, ms, steps in WORKLOADS if w in wanted]
    for workload, device_ms, steps in plan:
        for workers in [int(w) for w in args.workers.split(",")]:
            cfg = RunConfig(workload=workload, solver="allreduce", workers=workers, steps=steps, eval_every=steps,
                            device_ms=device_ms, timeout_s=120)
            run_dir = out / f"{workload}-{device_ms:g}ms-{workers}w"
            sampler = CpuSampler()
            sampler.start()
            t0 = time.monotonic()
            s = launch_or_exit(cfg, run_dir)
            seconds = time.monotonic() - t0
            sampler.done.set()
            sampler.join()
            rows.append({"workload": workload, "workers": workers, "device_ms": device_ms, "steps": steps,
                         "share_over": s["device"]["share_over"], "mean_over_ms": s["device"]["mean_over_ms"],
                         "cpu_bound": s["device"]["cpu_bound"],
                         "math_ms": s["device"]["math_ms"],
                         "step_ms": 1000 * statistics.median(s["wall_time_s"] / w["steps"] for w in s["per_worker"].values()),
                         "cores_busy_training": sampler.busy_between(*training_window(run_dir)),
                         "command_s": seconds, "cores": os.cpu_count()})
            r = rows[-1]
            busy = "?" if r["cores_busy_training"] is None else f"{r['cores_busy_training']:.0%}"
            print(f"{workload} {workers}w: over {r['share_over']:.0%}, real math {r['math_ms']:.1f} ms, step {r['step_ms']:.1f} ms, "
                  f"cores busy {busy}, {seconds:.0f} s", flush=True)
    print()
    print(f"allreduce, loopback links, {os.cpu_count()} cores; a step is over when its real math exceeds its device time")
    print()
    table_header(["workload", "workers", "device ms", "steps over", "mean overrun (ms)", "real math (ms)",
                  "step (ms)",
                  "cores busy while training", "emulation"])
    for r in rows:
        busy = "?" if r["cores_busy_training"] is None else f"{r['cores_busy_training']:.0%}"
        table_row([r["workload"], r["workers"], f"{r['device_ms']:g}", f"{r['share_over']:.1%}",
                   f"{r['mean_over_ms']:.1f}", f"{r['math_ms']:.1f}", f"{r['step_ms']:.1f}", busy,
                   "CPU-bound" if r["cpu_bound"] else "holds"])
    write_results(out / "summary.json", {"rows": rows})
    if args.json:
        command = " ".join(["python benchmarks/devices.py", *sys.argv[1:]])
        runs = [{"command": command, "rows": rows}]
        if args.append and Path(args.json).exists():
            runs = json.loads(Path(args.json).read_text())["runs"] + runs
        write_results(args.json, {"runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
