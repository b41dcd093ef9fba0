"""A lagging worker must not be taken for a dead one; a stopped one must be dropped after
``--timeout``, a killed one at once.

    python benchmarks/lagging_worker.py [--runs 50] [--families a,b] [--repeats 3] [--parts lagging,stop] [--seed 0]
                                        [--json PATH]

Method, raw results and figures: docs/benchmarks/kill_campaign.md.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import argument_parser, provenance, write_record

from distsync.metrics.repeats import shown as spread_shown

from distsync.experiments.report import markdown_table
from faults import leftovers, namespaces
from kill_campaign import (DISTSYNC, SOLVER_ARGS, all_solvers, error_line, kill_group, launch,
                           named, no_tmp, provenance_line, read_json, run_events, shown, stall_after, step_times, tail_lines,
                           wait_end, wait_training)

LAGGING = ["train", "--workload", "digits", "--solver", "ripples", "--schedule", "smart", "--workers", "3",
           "--slow", "1:60", "--steps", "120", "--timeout", "4"]
HANG_S = 120.0
WORKERS, STEPS, DEVICE_MS, STOP_TIMEOUT = 3, 200, 20.0, 4


# ---- (1) the lagging worker ----------------------------------------------------------------------
def lagging_run(i: int, burner: bool, tmp: Path) -> dict[str, Any]:
    out = tmp / f"lagging-{i:03d}"
    cmd = [*DISTSYNC, *LAGGING, "--out", str(out)]
    burn = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if burner else None
    try:
        t0 = time.monotonic()
        proc = launch(cmd, out, str(out))
        try:
            ended = wait_end(proc, t0 + HANG_S)
        except BaseException:  # (Ctrl-C: the run goes with the harness)
            kill_group(proc)
            raise
        seconds = time.monotonic() - t0
    finally:
        if burn is not None:
            burn.kill()
            burn.wait()
    left = leftovers(str(out), set(), grace_s=5 if ended else 0)[0]
    err = tail_lines(f"{out}.stderr", 5)
    s = read_json(out / "summary.json") or {}
    rec = s.get("recovery") or {}
    return {"i": i, "burner": burner, "rc": proc.returncode if ended else None, "passed": ended and proc.returncode == 0,
            "hang": not ended, "seconds": seconds, "last_stderr": err[-1] if err else None,
            "error": error_line(err) if ended and proc.returncode != 0 else None, "stderr_tail": err,
            "dropped": [{k: d.get(k) for k in ("rank", "signal", "reason", "last_step", "unix")}
                        for d in rec.get("dropped") or []],
            "final_metric": s.get("final_metric"), "steps_by_worker": s.get("steps_by_worker"),
            "wall_time_s": s.get("wall_time_s"), "left_processes": left}


# ---- (2) a stopped worker, a killed worker -------------------------------------------------------
def stop_run(solver: str, how: str, rank: int, at_fraction: float, timeout_s: int, tmp: Path,
             repeat: int = 0) -> dict[str, Any]:
    out = tmp / f"{how}-{solver}-{repeat}"
    cmd = [*DISTSYNC, "train", "--workload", "digits", "--solver", solver, *SOLVER_ARGS.get(solver, []),
           "--workers", str(WORKERS), "--steps", str(STEPS), "--eval-every", str(STEPS), "--device-ms", f"{DEVICE_MS:g}",
           "--timeout", str(timeout_s), "--seed", "1", "--out", str(out)]
    sig = signal.SIGSTOP if how == "stop" else signal.SIGKILL
    r: dict[str, Any] = {"solver": solver, "how": how, "rank": rank, "repeat": repeat, "command": shown(cmd),
                         "timeout_s": timeout_s}
    tag, ns = str(out), namespaces()
    t0 = time.monotonic()
    proc = launch(cmd, out, tag)
    at_mono, target = None, None
    try:
        started = wait_training(proc, out, range(WORKERS), 90)
        if started is None:
            r["not_done"] = "ended before training" if proc.poll() is not None else "no step in 90 s"
        else:
            time.sleep(at_fraction * STEPS * DEVICE_MS / 1000)
            found = named(tag, f"ds-worker-{rank}")
            if proc.poll() is not None:
                r["not_done"] = "ended before the signal"
            elif not found:
                r["not_done"] = f"no process named ds-worker-{rank}"
            else:
                target = found[0]
                r["target"] = target
                r["signal_unix"] = time.time()
                os.kill(target["pid"], sig)
                at_mono = time.monotonic()
                r["signal_after_training_s"] = r["signal_unix"] - started
        ended = wait_end(proc, at_mono + HANG_S if at_mono else t0 + HANG_S)
    finally:
        if target is not None:  # (a stopped worker the run left behind: let it end)
            try:
                os.kill(target["pid"], signal.SIGCONT)
            except OSError:
                pass
        if proc.poll() is None:
            kill_group(proc)
    r["hang"] = not ended
    r["rc"] = proc.returncode if ended else None
    r["seconds"] = time.monotonic() - t0
    r["left_processes"], r["left_namespaces"] = leftovers(tag, ns, grace_s=5 if ended else 0)
    err = tail_lines(f"{out}.stderr", 5)
    r["stderr_tail"] = err
    s = read_json(out / "summary.json")
    r["finished"] = bool(ended and proc.returncode == 0 and s and s.get("final_metric") is not None)
    if ended and proc.returncode != 0:
        r["error"] = error_line(err)
    if "signal_unix" not in r:
        return r
    at = r["signal_unix"]
    marks = []
    for path in sorted((out / "dropped").glob("*.json")) if (out / "dropped").exists() else []:
        m = read_json(path) or {}
        if m.get("rank") == rank:
            marks.append({"file": path.name, **m})
    r["marks"] = marks
    r["dropped"] = bool(marks)
    if marks:
        r["dropped_after_s"] = min(m.get("unix", at) for m in marks) - at
    events = run_events(out)
    waits = {str(w): stall_after([u for _, u in step_times(events, w)], at) for w in range(WORKERS) if w != rank}
    r["survivors"] = waits
    went = [g["first_step_after_s"] for g in waits.values() if g.get("first_step_after_s") is not None]
    r["survivors_went_on_s"] = max(went) if went else None
    rec = (s or {}).get("recovery") or {}
    views = [v for v in rec.get("views") or [] if v.get("unix", 0) >= at and rank not in v.get("members", [])]
    if views:
        r["view_after_s"] = min(v["unix"] for v in views) - at
    r["recovery_rows"] = [f for f in rec.get("faults") or [] if f.get("rank") == rank and f.get("unix", at) >= at - 1]
    r["final_metric"] = (s or {}).get("final_metric")
    return r


# ---- tables --------------------------------------------------------------------------------------
def fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


REGIME = {"lagging": "CPU-bound real run (digits, 3 workers, one of them 60x slow) on this machine's cores, "
                      "half of the runs beside a process burning a core",
          "stop": "emulated devices (--device-ms 20: each step lasts 20 ms of device time, the real math inside it), "
                  "loopback, on this machine's cores"}


def cells(raw: dict[str, Any]) -> dict[str, int]:
    """Runs per cell: part (1) by burner, part (2) by solver and signal."""
    out: dict[str, int] = {}
    for r in raw.get("lagging") or []:
        key = f"lagging, {'burner' if r['burner'] else 'alone'}"
        out[key] = out.get(key, 0) + 1
    for r in raw.get("stops") or []:
        key = f"{r['solver']} {r['how']}"
        out[key] = out.get(key, 0) + 1
    return out


def render(raw: dict[str, Any]) -> dict[str, str]:
    """The page's blocks: ``lagging_worker`` (part 1) and ``stopped_worker`` (part 2), each
    when its part was run."""
    head = provenance_line(raw) + f"; {raw.get('seconds', 0) / 60:.1f} min" + (
        "; **partial: the run did not end**" if raw.get("partial") else "") + "."
    blocks = {}
    lag = raw.get("lagging") or []
    if lag:
        lines = [head, "", f"Regime: {REGIME['lagging']}.", ""]
        rows = []
        for label, sel in (("alone", False), ("beside a core-burning process", True)):
            runs = [r for r in lag if r["burner"] == sel]
            if not runs:
                continue
            secs = [r["seconds"] for r in runs if not r["hang"]]
            rows.append([label, len(runs), sum(r["passed"] for r in runs), sum(not r["passed"] for r in runs),
                         sum(r["hang"] for r in runs), sum(bool(r["dropped"]) for r in runs),
                         spread_shown(secs, "{:.1f}")])
        lines += [f"`{raw.get('lagging_command') or 'distsync ' + ' '.join(LAGGING) + ' --out TMP'}`", ""]
        lines += markdown_table(["runs", "n", "passed (exit 0)", "failed", "hangs", "runs that dropped a worker",
                           "seconds: median (min-max)"], rows)
        failed = {}
        for r in lag:
            if not r["passed"]:
                key = no_tmp(r.get("error") or r.get("last_stderr") or ("hang" if r["hang"] else f"exit {r['rc']}"))
                failed.setdefault(key, []).append(r)
        if failed:
            lines += ["", "Failures, by their last stderr line:", ""]
            for key, rs in sorted(failed.items(), key=lambda kv: -len(kv[1])):  # (one line per distinct message)
                lines.append(f"- {len(rs)}× ({sum(r['burner'] for r in rs)} beside the burner): `{no_tmp(key)[:300]}`")
        dropped = [r for r in lag if r["dropped"]]
        if dropped:
            lines += ["", "Runs that dropped a worker: " + "; ".join(
                f"run {r['i']}{' (burner)' if r['burner'] else ''}: rank "
                + ", ".join(f"{d['rank']} ({d.get('reason') or d.get('signal')})" for d in r["dropped"]) for r in dropped)]
        blocks["lagging_worker"] = "\n".join(lines)
    stops = raw.get("stops") or []
    if stops:
        by: dict[str, dict[str, list[dict]]] = {}
        for r in stops:
            by.setdefault(r["solver"], {}).setdefault(r["how"], []).append(r)
        rows = []
        for solver, d in sorted(by.items()):
            row = [f"`{solver}`"]
            for how in ("stop", "kill"):
                rs = d.get(how) or []
                if not rs:
                    row += ["-"] * 4
                    continue
                row += [f"{sum(bool(r.get('finished')) for r in rs)} of {len(rs)}"
                        + (f", {sum(bool(r.get('hang')) for r in rs)} hung" if any(r.get("hang") for r in rs) else ""),
                        f"{sum(bool(r.get('dropped')) for r in rs)} of {len(rs)}",
                        spread_shown([r.get("dropped_after_s") for r in rs]),
                        f"{spread_shown([r.get('survivors_went_on_s') for r in rs])} / "
                        f"{spread_shown([r.get('view_after_s') for r in rs])}"]
            rows.append(row)
        t = stops[0].get("timeout_s")
        n = min(len(x) for d in by.values() for x in d.values())
        lines = [head, "", f"Regime: {REGIME['stop']}. Each solver: `digits`, {WORKERS} workers, {STEPS} steps, "
                 f"`--timeout {t}`; a random worker stopped (SIGSTOP) or killed (SIGKILL) from outside, at least {n} "
                 f"runs of each: median (min-max) over the runs (a time a run did not have is left out, and the "
                 f"count of those that had it is given).", ""]
        lines += markdown_table(["solver", "SIGSTOP: finished", "dropped", "dropped after (s)",
                           "survivors went on after (s): first step / new view", "SIGKILL: finished", "dropped",
                           "dropped after (s)", "survivors went on after (s): first step / new view"], rows)
        bad = [r for r in stops if not r.get("finished")]
        if bad:
            lines += ["", "Runs that did not finish:", ""]
            lines += [f"- {r['solver']} {r['how']} rank {r['rank']}: "
                      f"{'hang' if r.get('hang') else 'exit ' + str(r.get('rc'))}; "
                      f"`{no_tmp(r.get('error') or r.get('not_done'))[:300]}`" for r in bad]
        blocks["stopped_worker"] = "\n".join(lines)
    return blocks


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--runs", type=int, default=50, help="(1): runs of the lagging command (default 50; half beside a burner)")
    p.add_argument("--families", help="(2): comma-separated solvers (default: every registered solver)")
    p.add_argument("--repeats", type=int, default=1, help="(2): runs of each solver and signal (default 1)")
    p.add_argument("--parts", default="lagging,stop", help="which parts (default: both)")
    p.add_argument("--timeout", type=int, default=STOP_TIMEOUT, help=f"(2): --timeout of its runs (default {STOP_TIMEOUT})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="benchmarks/results/lagging_worker.json",
                   help="the raw results (written after every run; default: benchmarks/results/lagging_worker.json)")
    p.add_argument("--keep", action="store_true", help="keep the run folders")
    args = p.parse_args()
    started = provenance("benchmarks/lagging_worker.py")
    parts = set(args.parts.split(","))
    rng = random.Random(args.seed)
    payload: dict[str, Any] = {"seed": args.seed, "parts": sorted(parts),
                               "lagging_command": "distsync " + " ".join(LAGGING) + " --out TMP",
                               "lagging": [], "stops": []}
    regime = "; ".join(f"({i}) {REGIME[k]}" for i, k in ((1, "lagging"), (2, "stop")) if k in parts)
    tmp = Path(tempfile.mkdtemp(prefix="lagging_worker-"))
    t0 = time.monotonic()

    def save(partial: bool = True) -> None:
        per_cell = cells(payload)
        payload.update(seconds=time.monotonic() - t0, partial=partial, runs_per_cell=per_cell,
                       repeats=min(per_cell.values(), default=0))
        write_record(args.json, started, regime=regime, seeds=[args.seed], payload=payload, announce=not partial)
    try:
        if "lagging" in parts:
            burners = [True] * (args.runs // 2) + [False] * (args.runs - args.runs // 2)
            rng.shuffle(burners)
            for i, burner in enumerate(burners):
                r = lagging_run(i, burner, tmp)
                payload["lagging"].append(r)
                print(f"[lagging {i + 1}/{args.runs} {time.monotonic() - t0:.0f} s]{' burner' if burner else ''}: "
                      f"{'pass' if r['passed'] else 'FAIL'} in {r['seconds']:.1f} s"
                      f"{'' if r['passed'] else '; ' + str(r['error'] or r['last_stderr'])}"
                      f"{'; dropped ' + str(r['dropped']) if r['dropped'] else ''}", flush=True)
                save()
        if "stop" in parts:
            families = args.families.split(",") if args.families else all_solvers()
            for repeat in range(args.repeats):
                for solver in families:
                    for how in ("stop", "kill"):
                        rank, frac = rng.randrange(WORKERS), rng.uniform(0.1, 0.3)
                        try:
                            r = stop_run(solver, how, rank, frac, args.timeout, tmp, repeat)
                        except KeyboardInterrupt:
                            raise
                        except Exception as e:  # (recorded: the others go on)
                            r = {"solver": solver, "how": how, "rank": rank, "repeat": repeat, "finished": False,
                                 "hang": False, "rc": None, "harness_error": f"{type(e).__name__}: {e}",
                                 "error": f"harness: {e}"}
                        payload["stops"].append(r)
                        print(f"[{how} {solver} {repeat + 1}/{args.repeats} {time.monotonic() - t0:.0f} s] rank {rank}: "
                              f"{'finished' if r['finished'] else 'NOT finished'}{', hang' if r.get('hang') else ''}; "
                              f"dropped {'after ' + fmt_s(r.get('dropped_after_s')) + ' s' if r.get('dropped') else 'no'}; "
                              f"survivors went on after {fmt_s(r.get('survivors_went_on_s'))} s"
                              f"{'; ' + str(r.get('error') or r.get('not_done')) if not r['finished'] else ''}",
                              flush=True)
                        save()
    finally:
        if args.keep:
            print(f"run folders kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    save(partial=False)
    for text in render(json.loads(Path(args.json).read_text())).values():
        print()
        print(text)
    return 0

if __name__ == "__main__":
    sys.exit(main())
