"""Do the same runs give the same results? Fingerprints of a few deterministic jobs across
solver families: their events (times left out), per-step losses, evaluations, checkpoints and
final models, written to one JSON file; ``--against`` compares two such files, equal within
1e-6 (relative) for numbers and exactly for everything else. A change of structure must leave
them equal.

    python tools/same_runs.py --out /tmp/before.json           # with the tree as it is
    python tools/same_runs.py --out /tmp/after.json --against /tmp/before.json

Each job is run through the ``distsync train`` command line (the interface that stays put),
on digits, with fixed seeds; jobs whose results depend on thread or message timing (Hogwild,
asynchronous servers, AD-PSGD, workers that step on their own under a budget) are left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: (name, command-line arguments after `distsync train`)
JOBS: list[tuple[str, list[str]]] = [
    ("allreduce-checkpointed", ["--solver", "allreduce", "--workers", "2", "--steps", "24", "--eval-every", "8",
                                "--checkpoint-every", "8", "--momentum", "0.9"]),
    ("ma", ["--solver", "ma", "--workers", "3", "--steps", "24", "--eval-every", "12", "-o", "every=3"]),
    ("ripples-static", ["--solver", "ripples", "--workers", "4", "--steps", "16", "--eval-every", "8",
                        "--group-size", "2"]),
    ("sync-ps", ["--solver", "sync-ps", "--workers", "2", "--steps", "16", "--eval-every", "8",
                 "--checkpoint-every", "8"]),
    ("sync-easgd", ["--solver", "sync-easgd", "--workers", "2", "--steps", "16", "--eval-every", "8"]),
    ("bmuf", ["--solver", "bmuf", "--workers", "2", "--steps", "16", "--eval-every", "8", "--lr", "0.05"]),
    ("allreduce-budget", ["--solver", "allreduce", "--workers", "2", "--budget", "samples=1024", "--eval-every", "8",
                          "--optimizer", "adam", "--lr", "0.01"]),
    ("allreduce-accumulate", ["--solver", "allreduce", "--workers", "2", "--steps", "12", "--accumulate", "2",
                              "--weight-decay", "0.01", "--eval-every", "6"]),
]
#: event fields that are timings or measurements of the machine, not results
TIMES = {"peak_rss_mib", "peak_device_mib", "unix", "t", "t0", "seconds", "elapsed_s", "wall_s", "duration_s", "compute", "comm", "wait", "meet",
         "device_math", "at", "time", "since", "clock", "close_s", "slept_s", "backward_s"}


def _tensor_digest(obj: Any) -> Any:
    """Tensors as lists of rounded values (compared within tolerance); the rest as it is."""
    import torch

    if isinstance(obj, torch.Tensor):
        return {"tensor": list(obj.shape), "values": obj.detach().double().flatten().tolist()}
    if isinstance(obj, dict):
        return {str(k): _tensor_digest(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))
                if str(k) not in TIMES}
    if isinstance(obj, (list, tuple)):
        return [_tensor_digest(v) for v in obj]
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    return repr(type(obj).__name__)


def _csv(path: Path, drop: set[str]) -> list[dict[str, str]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    head = lines[0].split(",")
    rows = [dict(zip(head, line.split(","))) for line in lines[1:]]
    rows = [{k: v for k, v in r.items() if k not in drop} for r in rows]
    return sorted(rows, key=lambda r: json.dumps(r, sort_keys=True))


def _events(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        e = json.loads(line)
        out.append({k: v for k, v in e.items() if k not in TIMES and not k.endswith("_s")})
    return sorted(out, key=lambda e: json.dumps(e, sort_keys=True, default=str))


def fingerprint(run: Path) -> dict[str, Any]:
    import torch

    fp: dict[str, Any] = {"steps": _csv(run / "steps.csv", TIMES), "evals": _csv(run / "evals.csv", TIMES),
                          "events": _events(run / "events.jsonl")}
    if (run / "model.pt").exists():
        fp["model"] = _tensor_digest(torch.load(run / "model.pt", map_location="cpu", weights_only=False))
    # Each rank's newest checkpoint (older ones are pruned as time goes; a file's name ends in
    # the time it was written: left out).
    newest: dict[str, Path] = {}
    for p in sorted(p for p in run.rglob("*.pt") if p.name != "model.pt"):
        newest[re.sub(r"-[0-9]{12,}(?=\.pt$)", "", p.name)] = p
    fp["checkpoints"] = {name: dict(_tensor_digest(torch.load(p, map_location="cpu", weights_only=False)),
                                    index=p.parent.name) for name, p in sorted(newest.items())}
    summary = json.loads((run / "summary.json").read_text())
    fp["summary"] = {k: summary.get(k) for k in ("final_metric", "final_loss", "steps", "samples", "solver")}
    return fp


def run_jobs(only: set[str]) -> dict[str, Any]:
    exe = [sys.executable, "-c", "import sys; from distsync.cli import main; sys.exit(main())", "train"]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in JOBS:
            if only and name not in only:
                continue
            d = Path(tmp) / name
            cmd = [*exe, *args, "--seed", "3", "--out", str(d)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            if done.returncode != 0:
                sys.exit(f"error: {name} failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
            out[name] = fingerprint(d)
            print(f"{name}: {len(out[name]['steps'])} step rows, {len(out[name]['checkpoints'])} checkpoint files",
                  flush=True)
    return out


def differences(a: Any, b: Any, where: str = "", rel: float = 1e-6) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):  # (timings left out, also of an older file)
        a, b = ({k: v for k, v in d.items() if k not in TIMES} for d in (a, b))
        found = [f"{where}.{k}: only in one" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            found += differences(a[k], b[k], f"{where}.{k}", rel)
        return found
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} against {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]", rel)]
    for x, y in ((a, b),):
        try:
            fx, fy = float(x), float(y)
        except (TypeError, ValueError):
            return [] if x == y else [f"{where}: {x!r} against {y!r}"]
        if isinstance(x, bool) or isinstance(y, bool):
            return [] if x == y else [f"{where}: {x!r} against {y!r}"]
        if math.isnan(fx) and math.isnan(fy):
            return []
        return [] if math.isclose(fx, fy, rel_tol=rel, abs_tol=rel) else [f"{where}: {x!r} against {y!r}"]
    return []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the fingerprints' JSON file")
    p.add_argument("--against", help="an earlier file to compare with")
    p.add_argument("--only", default="", help="job names, comma-separated (default: all)")
    args = p.parse_args()
    fps = run_jobs({x for x in args.only.split(",") if x})
    Path(args.out).write_text(json.dumps(fps, sort_keys=True) + "\n")
    digest = hashlib.sha256(Path(args.out).read_bytes()).hexdigest()[:12]
    print(f"wrote {args.out} ({digest})")
    if args.against:
        before = json.loads(Path(args.against).read_text())
        found = differences({k: before[k] for k in fps if k in before}, fps)
        found += [f"{k}: not in {args.against}" for k in fps if k not in before]
        for line in found[:40]:
            print("DIFFERS", line)
        print(f"{len(found)} differences over {len(fps)} jobs")
        sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
