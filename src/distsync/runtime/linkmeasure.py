"""What each process of a `distsync linktest` job measures: the bandwidth the (emulated) links
actually deliver.

Point-to-point: worker 0 sends a tensor of each size to worker 1; the time is the
receiver's, from a common barrier to the data in hand. All-reduce: every worker all-reduces
a tensor of each size; the time is the slowest worker's, and the bus bandwidth is
``2 (p - 1) / p * bytes / time`` (what each rank's link carries in a ring all-reduce, so it
is directly comparable with the link rate). Partial All-Reduce (with 3 or more workers): the
first ``group`` workers sum a tensor of each size among themselves, as a ring of point-to-point
messages, as one all-reduce on a group of them and in one round of messages from each to each
(Ripples' ``reduce=ring``, ``reduce=collective`` and ``reduce=direct``), while the others
wait; the time is the slowest member's, set against the all-reduce of every worker. Medians over ``repeats``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from distsync.comm import PARTIAL_REDUCES, Comm, ring_allreduce_bytes
from distsync.config import RunConfig

DEFAULT_SIZES_MB = (1.0, 10.0)
#: the Partial All-Reduce's group: Ripples' default group size
GROUP = 3


def measure(comm: Comm, sizes_mb, repeats: int) -> dict[str, list[float]]:
    """This rank's seconds per (size, repeat) for p2p (receiver only) and all-reduce."""
    out: dict[str, list[float]] = {}
    for mb in sizes_mb:
        t = torch.zeros(int(mb * 2**20) // 4)
        p2p, ar = [], []
        for _ in range(repeats):
            if comm.num_workers >= 2:
                comm.barrier()
                t0 = time.perf_counter()
                if comm.rank == 0:
                    comm.send(t, dst=1)
                elif comm.rank == 1:
                    comm.recv(t, src=0)
                p2p.append(time.perf_counter() - t0)
            comm.barrier()
            t0 = time.perf_counter()
            comm.all_reduce(t, group=comm.worker_group)
            ar.append(time.perf_counter() - t0)
        out[f"p2p:{mb}"] = p2p
        out[f"allreduce:{mb}"] = ar
        if comm.num_workers >= GROUP:
            for reduce in PARTIAL_REDUCES:
                out[f"partial-{reduce}:{mb}"] = _partial(comm, t, reduce, repeats)
    return out


def _partial(comm: Comm, t: torch.Tensor, reduce: str, repeats: int) -> list[float]:
    """This rank's seconds per repeat of the first :data:`GROUP` workers' Partial All-Reduce
    (0 for the others); the first one, which may make the group, is not timed."""
    members = comm.worker_ranks[:GROUP]
    times = []
    for i in range(repeats + 1):
        comm.barrier()
        t0 = time.perf_counter()
        if comm.rank in members:
            comm.partial_all_reduce(t, members, reduce=reduce)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def run_linktest(cfg: RunConfig, comm: Comm, run_dir: Path, latency_mode: str | None = None) -> None:
    sizes = [float(s) for s in cfg.task_options.get("sizes_mb", DEFAULT_SIZES_MB)]
    repeats = int(cfg.task_options.get("repeats", 3))
    mine = measure(comm, sizes, repeats)
    gathered = comm.gather_object(mine)
    if comm.rank != 0:
        return
    p = comm.num_workers
    rows: list[dict[str, Any]] = []
    for mb in sizes:
        nbytes = int(mb * 2**20) // 4 * 4
        row: dict[str, Any] = {"size_mb": mb, "bytes": nbytes}
        if p >= 2:
            p2p_s = statistics.median(gathered[1][f"p2p:{mb}"])
            row.update(p2p_s=p2p_s, p2p_bps=nbytes * 8 / p2p_s)
        ar = [max(g[f"allreduce:{mb}"][i] for g in gathered) for i in range(repeats)]
        ar_s = statistics.median(ar)
        row.update(allreduce_s=ar_s, allreduce_bus_bps=ring_allreduce_bytes(nbytes, p) * 8 / ar_s if p > 1 else None)
        for reduce in PARTIAL_REDUCES:
            key = f"partial-{reduce}:{mb}"
            if key in gathered[0]:
                part = statistics.median(max(g[key][i] for g in gathered) for i in range(repeats))
                row.update({f"partial_{reduce}_s": part, f"partial_{reduce}_vs_allreduce": part / ar_s})
        rows.append(row)
    result = {
        "link": None if cfg.link is None else str(cfg.link),
        "configured_bps": cfg.link.bandwidth_bps if cfg.link else None,
        "latency_mode": latency_mode,
        "workers": p,
        "partial_group": GROUP if p >= GROUP else None,
        "repeats": repeats,
        "rows": rows,
    }
    tmp = run_dir / "linktest.json.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, run_dir / "linktest.json")
