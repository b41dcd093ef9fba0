"""What allreduce's next-forward overlap costs a step where nothing is on the wire: its forward
pre-hooks, the optimizer stepped bucket by bucket, the held zeroing. ResNet-50 trains in one
process through `allreduce`'s hooks with a comm of two workers whose all-reduce is done at once
(no wire), ``next_forward`` on and off in turns, each step timed to its end on the device.

    python benchmarks/next_forward_hooks.py [--device cpu|cuda] [--batch 32] [--steps 20] [--rounds 3]

Regime: one process, real math (on the GPU with ``--device cuda``); no communication.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from common import argument_parser, finish, provenance

from distsync.comm.devices import synchronize
from distsync.comm.mirror import MirroredPeer
from distsync.metrics.repeats import shown
from distsync.solvers import make_solver
from distsync.workloads.resnet50 import ResNet50

REGIME = "one process, real math, a comm of two workers whose all-reduce is done at once (no wire)"


def step_times(next_forward: bool, device: torch.device, batch: int, steps: int) -> list[float]:
    torch.manual_seed(0)
    model = ResNet50(classes=10).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    solver = make_solver("allreduce", next_forward=next_forward)
    solver.offer_next_forward(None)
    solver.same_start = False
    solver.attach(model, opt, MirroredPeer())
    x, y = torch.randn(batch, 3, 32, 32, device=device), torch.randint(0, 10, (batch,), device=device)
    times = []
    for step in range(steps):
        a = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        solver.after_backward(step)
        solver.update(step)
        solver.zero_grad()
        synchronize(device)
        times.append(time.perf_counter() - a)
    solver.close()
    return times[3:]  # (the first steps warm up, and measure the split)


def render(raw: dict[str, Any]) -> dict[str, str]:
    r = raw["result"]
    name = "next_forward_hooks" + ("-gpu" if r["device"] == "cuda" else "")
    lines = [f"{raw['repeats']} rounds (on and off in turns), each the median of {r['steps']} steps: median (min-max). "
             f"Regime: {raw['regime']}; ResNet-50 (10 classes), batch {r['batch']} of 32x32 images on {r['device_name']}.",
             "", "| next_forward | step ms | cost |", "|---|---|---|",
             f"| off | {shown([t * 1e3 for t in r['off']], '{:.1f}')} | |",
             f"| on | {shown([t * 1e3 for t in r['on']], '{:.1f}')} | "
             f"{shown([a / b - 1 for a, b in zip(r['on'], r['off'])], '{:+.1%}')} |"]
    return {name: "\n".join(lines)}


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="default: benchmarks/results/next_forward_hooks[-gpu].json")
    args = p.parse_args()
    started = provenance("benchmarks/next_forward_hooks.py")
    device = torch.device(args.device)
    torch.set_num_threads(1) if device.type == "cpu" else None
    on, off = [], []
    for k in range(args.rounds):
        for flag in ((True, False) if k % 2 == 0 else (False, True)):
            (on if flag else off).append(statistics.median(step_times(flag, device, args.batch, args.steps)))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "one CPU thread"
    result = {"device": device.type, "device_name": name, "batch": args.batch, "steps": args.steps, "on": on,
              "off": off}
    gpu = device.type == "cuda"
    return finish(args.json or f"benchmarks/results/next_forward_hooks{'-gpu' if gpu else ''}.json", started, render,
                  {"result": result}, regime=REGIME, seeds=list(range(args.rounds)))


if __name__ == "__main__":
    sys.exit(main())
