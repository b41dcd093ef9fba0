"""Start-up cost of a one-step job: ``distsync train`` against ``torchrun`` on a trivial script.

Regime: CPU-bound real runs on this machine (every process of a job shares its cores; on the
2-core machine the benchmark was written on, start-up is CPU work: imports, data, Python).

    python benchmarks/startup.py [--workers 2,4] [--repeats 3] [--json benchmarks/results/startup.json]
    python benchmarks/startup.py --breakdown [--workers 4]
    python benchmarks/startup.py --full          # both, one JSON
    python benchmarks/startup.py --src DIR       # measure the distsync package under DIR (e.g. an old checkout's src)

Method, raw results and figures: docs/benchmarks/startup.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import provenance, write_record
from distsync.metrics.repeats import median, ratios, shown, spread
from distsync.experiments.report import markdown_table

BIN = Path(sys.executable).parent
REGIME = "CPU-bound real run on this machine ({cores} cores): every process of a job shares them"
KINDS = ("distsync", "torchrun")

TRIVIAL = """\
import torch
import torch.distributed as dist

torch.set_num_threads(1)  # like distsync's workers
dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
dist.destroy_process_group()
"""

# The tracer (benchmarks/startup_profile/tracer/): a ``sitecustomize`` every Python process of a
# traced job imports, loaded by its path.
TRACER_DIR = Path(__file__).resolve().parent / "startup_profile" / "tracer"


# Running commands
def tool(name: str) -> str:
    found = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if not found:
        sys.exit(f"startup.py: {name} not found next to {sys.executable} nor on PATH")
    return found


def job_env(src: str | None, trace: Path | None = None) -> dict[str, str]:
    """The environment of a measured command: ``src`` first on ``PYTHONPATH``; with ``trace``,
    the tracer before it, writing to that file."""
    env = dict(os.environ)
    env.pop("STARTUP_TRACE", None)
    parts = [p for p in (trace and str(TRACER_DIR), src, env.get("PYTHONPATH")) if p]
    if parts:
        env["PYTHONPATH"] = os.pathsep.join(parts)
    if trace:
        env["STARTUP_TRACE"] = str(trace)
    return env


def commands(n: int, work: Path, trivial: Path) -> dict[str, list[str]]:
    return {
        "distsync": [tool("distsync"), "train", "--overwrite", "--workload", "digits", "--steps", "1", "--workers", str(n),
                     "--out", str(work / "run")],
        "torchrun": [tool("torchrun"), "--standalone", "--nproc-per-node", str(n), str(trivial)],
    }


def run(cmd: list[str], env: dict[str, str], log: Path) -> dict:
    """Run ``cmd`` (its output into ``log``; a failure ends the script): wall seconds from start
    to exit, CPU seconds of the command and every process it started (those it left behind
    too, reaped here: :func:`main` makes this process their subreaper), load average before
    and after."""
    load0 = os.getloadavg()[0]
    with open(log, "wb") as out:
        t0 = time.time()
        a = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        wall = time.perf_counter() - a
        t1 = time.time()
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        sys.exit(f"startup.py: {' '.join(cmd)} failed (exit {rc}):\n{log.read_text(errors='replace')[-2000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    # processes the command left behind: wait for them (up to 30 s), adding their CPU
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            pid, _, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid:
            cpu += usage.ru_utime + usage.ru_stime
        else:
            time.sleep(0.01)
    return {"wall_s": wall, "cpu_s": cpu, "load_before": load0, "load_after": os.getloadavg()[0],
            "t_start": t0, "t_end": t1}


def compact(obj):
    """``obj`` with floats to 3 decimals and the runs' clock readings left out."""
    if isinstance(obj, float):
        return round(obj, 3)
    if isinstance(obj, dict):
        return {k: compact(v) for k, v in obj.items() if k not in ("t_start", "t_end")}
    if isinstance(obj, (list, tuple)):
        return [compact(v) for v in obj]
    return obj


# (1) Timing
def run_timing(workers: list[int], repeats: int, warmup: int, src: str | None, tmp: Path, trivial: Path) -> dict:
    plan: list[tuple[int, int, str]] = []
    for r in range(-warmup, repeats):
        k = (r + warmup) % len(KINDS)  # rotate which goes first, so none always follows another
        plan += [(r, n, which) for n in workers for which in KINDS[k:] + KINDS[:k]]
    runs: list[dict] = []
    for i, (r, n, which) in enumerate(plan):
        work = tmp / f"{which}-{n}-{r}"
        work.mkdir(parents=True, exist_ok=True)
        res = run(commands(n, work, trivial)[which], job_env(src), work / "output.log")
        tag = "warm-up" if r < 0 else f"repeat {r + 1}/{repeats}"
        print(f"  [{i + 1}/{len(plan)}] {which:8s} N={n} {tag:12s} {res['wall_s']:6.2f} s wall  "
              f"{res['cpu_s']:6.2f} s CPU  load {res['load_before']:.2f}", flush=True)
        if r >= 0:
            runs.append({"command": which, "workers": n, "repeat": r, **res})
        shutil.rmtree(work, ignore_errors=True)
    return {"repeats": repeats, "warmup": warmup, "runs": runs,
            "load_average_1min": dict(zip(("median", "min", "max"), spread(x["load_before"] for x in runs))),
            "commands": {k: " ".join(v).replace(str(tmp), "TMP") for k, v in commands(0, tmp / "W", trivial).items()},
            "trivial_script": TRIVIAL}


# (2) Breakdown
def processes(events: list[dict]) -> list[dict]:
    """The trace's processes: each one's ``rank`` (None: not a rank), its ``points`` (``name>``
    and ``name<``: a traced call's or import's entry and exit; ``site``, ``os_exit``,
    ``atexit``), each a list of (unix, cpu) readings, and ``cpu_s``, its CPU at its last event."""
    by_pid: dict[int, list[dict]] = {}
    for e in events:
        by_pid.setdefault(e["pid"], []).append(e)
    out = []
    for evs in by_pid.values():
        points: dict[str, list[tuple[float, float]]] = {}
        for e in evs:
            if e["ev"] in ("call", "import"):
                name = e["fn"] if e["ev"] == "call" else "import:" + e["mod"]
                points.setdefault(name + ">", []).append((e["t0"], e["cpu0"]))
                points.setdefault(name + "<", []).append((e["t"], e["cpu"]))
            elif e["ev"] in ("site", "os_exit", "atexit"):
                points.setdefault(e["ev"], []).append((e["t"], e["cpu"]))
        out.append({"rank": next((e["rank"] for e in evs if e.get("rank") is not None), None), "points": points,
                    "cpu_s": max(e["cpu"] for e in evs)})
    return out


def at(proc: dict, name: str, which: int = 0) -> tuple[float, float | None] | None:
    """The ``which``-th reading of point ``name`` in ``proc`` (None: there is none)."""
    pts = proc["points"].get(name, [])
    return pts[which] if which < len(pts) else None


def segments(proc: dict, marks: list[tuple[str, str | tuple[str, int]]], begin: tuple | None) -> list[dict]:
    """Consecutive segments from ``begin`` (unix, cpu) between the named points that exist, in
    order: the label of each segment is the label given with its END point (a reading's CPU
    None: unknown, as past a process's last event)."""
    out, prev = [], begin
    for label, point in marks:
        pt = at(proc, *((point, 0) if isinstance(point, str) else point))
        if pt is None:
            continue
        if prev is not None:
            cpu = None if None in (pt[1], prev[1]) else pt[1] - prev[1]
            out.append({"phase": label, "wall_s": pt[0] - prev[0], "cpu_s": cpu})
        prev = pt
    return out


#: each worker's phases, as (label, the point that ends it)
WORKER_MARKS = {
    "torchrun": [
        ("interpreter up (exec, site)", "site"),
        ("import torch", "distributed_c10d.init_process_group>"),
        ("init_process_group (gloo; waits for every rank)", "distributed_c10d.init_process_group<"),
        ("all_reduce", "distributed_c10d.all_reduce<"),
        ("destroy_process_group", "distributed_c10d.destroy_process_group<"),
        ("end of script to atexit", "atexit"),
    ],
    "distsync": [
        ("interpreter up (exec, site)", "site"),
        ("until run_process: a fresh interpreter imports torch, distsync.worker, distsync.runtime.process "
         "(a forked process only forks)", "process.run_process>"),
        ("run_process: threads, solver, roles", "comm.Comm.from_env>"),
        ("init_process_group (gloo; waits for every rank)", "comm.Comm.from_env<"),
        ("load_workload: import distsync.workloads.digits (sklearn, scipy, pandas)",
         "import:distsync.workloads.digits<"),
        ("load_workload: load_digits + split + tensors", "workloads.load_workload<"),
        ("recovery_for (checkpoints, faults)", "process.recovery_for<"),
        ("model + make_optimizer: torch.optim's first call imports torch._dynamo (if not yet imported)",
         "loop.make_optimizer<"),
        ("solver.attach, samplers", ("comm.Comm.barrier>", 0)),
        ("start barrier (waits for the slowest worker)", ("comm.Comm.barrier<", 0)),
        ("1 training step + final evaluation + model.pt", "loop.train_worker<"),
        ("gather_object of every rank's events", "comm.Comm.gather_object<"),
        ("write events.jsonl + summary.json (rank 0)", "process.write_results<"),
        ("final barrier (monitored_barrier)", ("comm.Comm.barrier<", 1)),
        ("destroy_process_group (Comm.close)", "comm.Comm.close<"),
        ("to os._exit", "os_exit"),
    ],
}


def parent_marks(kind: str) -> list[tuple[str, object]]:
    """The launching process's phases, as (label, the point that ends it)."""
    if kind == "torchrun":
        pre = [
            ("process start + interpreter up (site)", "site"),
            ("import torch + torch.distributed.run", "run.main>"),
            ("parse args, config until launch_agent", "api.launch_agent>"),
        ]
    else:
        pre = [
            ("process start + interpreter up (site)", "site"),
            ("import distsync.cli (torch, rich, distsync)", "cli.main>"),
            ("main: build the parser, parse arguments", "cli._cmd_train>"),
            ("options, resolve(): solver class and options", "import:distsync.workloads.digits>"),
            ("resolve() -> typed_options imports distsync.workloads.digits: sklearn (+scipy, pandas)",
             "import:distsync.workloads.digits<"),
            ("resolve() builds the workload for its defaults (load_digits, split)", "workloads.load_workload<"),
            ("rest of resolve, launch(): config.json, bind_listeners, LaunchConfig", "api.launch_agent>"),
        ]
    return pre + [
        ("agent set-up (rendezvous handler, TCPStore) until rendezvous", "api.SimpleElasticAgent._rendezvous>"),
        ("rendezvous (c10d, 1 node)", "api.SimpleElasticAgent._rendezvous<"),
        ("_start_workers: start every rank (Popen; or the fork server's start and its preload, then forks)",
         "local_elastic_agent.LocalElasticAgent._start_workers<"),
        ("workers run (see the per-worker table)", "LAST_WORKER_EXIT"),
        ("worker exit (interpreter teardown, if any) + agent's poll (monitor_interval)",
         "local_elastic_agent.LocalElasticAgent._monitor_workers<"),
        ("exit barrier (1 agent)", "api.SimpleElasticAgent._exit_barrier<"),
        ("agent _shutdown (close process context)", "local_elastic_agent.LocalElasticAgent._shutdown<"),
        ("launch_agent returns (rendezvous shutdown, events)", "api.launch_agent<"),
    ] + ([] if kind == "torchrun" else [
        ("launch() returns (read summary.json, stop progress poller)", "launch.launch<"),
        ("print table, return from main", "cli.main<"),
    ]) + [
        ("atexit", "atexit"),
        ("to os._exit (a launcher that leaves without finalization)", "os_exit"),
        ("interpreter exit (finalization: GC, module teardown; none after os._exit) until the command has exited",
         "COMMAND_EXIT"),
    ]


def analyse(kind: str, res: dict, events: list[dict]) -> dict:
    """One traced run: the launching process's phases (``launcher``), each worker phase's
    median wall over the workers and CPU summed over them (``workers``)."""
    procs = processes(events)
    parent = next((p for p in procs if p["rank"] is None and at(p, "api.launch_agent>")),
                  min(procs, key=lambda p: (at(p, "site") or (float("inf"),))[0]))
    # a rank's process is the one that joins the process group (a forked job also has a
    # supervising parent per rank, which carries the rank's environment but does not)
    workers = [p for p in procs if p is not parent and p["rank"] is not None
               and (at(p, "process.run_process>") or at(p, "distributed_c10d.init_process_group>"))]
    exits = [x[0] for x in (at(p, "os_exit") or at(p, "atexit") for p in workers) if x]
    if exits:
        parent["points"]["LAST_WORKER_EXIT"] = [(max(exits), None)]
    parent["points"]["COMMAND_EXIT"] = [(res["t_end"], None)]
    spawn = at(parent, "local_elastic_agent.LocalElasticAgent._start_workers>")
    cells = [c for w in workers for c in segments(w, WORKER_MARKS[kind], spawn and (spawn[0], 0.0))]
    per_phase = []
    for label, _ in WORKER_MARKS[kind]:
        mine = [c for c in cells if c["phase"] == label]
        if mine:
            per_phase.append({"phase": label, "wall_median_s": median(c["wall_s"] for c in mine),
                              "cpu_sum_s": sum(c["cpu_s"] for c in mine if c["cpu_s"] is not None)})
    return {"command": kind, "wall_s": res["wall_s"], "cpu_s": res["cpu_s"], "load_before": res["load_before"],
            # CPU no traced event saw: what ran after each process's last event (interpreter finalization)
            "cpu_after_last_event_s": res["cpu_s"] - sum(p["cpu_s"] for p in procs),
            "launcher": segments(parent, parent_marks(kind), (res["t_start"], 0.0)),
            "workers": per_phase,
            # (a function the tracer could not wrap, its code moved: its phase is missing)
            "patch_failed": sorted({e["fn"] for e in events if e["ev"] == "patch-failed"})}


# What one piece of start-up costs on its own: (name, code, the entry it adds to). Each is run
# as ``python -c CODE`` that reports its CPU at the end, then leaves with os._exit; the cost is
# the median over the repeats of its CPU before its exit.
WORKER = "import distsync.worker, distsync.runtime.process"
DIGITS = "from distsync.workloads import load_workload\nload_workload('digits')"
_LAUNCHER_ROW, _WORKER_ROW = "import distsync.cli (distsync's launcher)", f"{WORKER} (a worker, before its workload)"
ISOLATED = [
    ("python -c pass", "pass", None),
    ("import torch", "import torch", "python -c pass"),
    ("import torch.distributed.run (torchrun's launcher)", "import torch.distributed.run", "import torch"),
    (_LAUNCHER_ROW, "import distsync.cli", "import torch"),
    ("launcher + load_workload('digits') (sklearn, scipy, pandas)", f"import distsync.cli\n{DIGITS}", _LAUNCHER_ROW),
    ("launcher + import distsync.experiments (the summary table's import: matplotlib)",
     "import distsync.cli, distsync.experiments", _LAUNCHER_ROW),
    (_WORKER_ROW, WORKER, "import torch"),
    ("worker + load_workload('digits') (sklearn, scipy, pandas)", f"{WORKER}\n{DIGITS}", _WORKER_ROW),
    ("worker + torch.optim.SGD(...) (its first call imports torch._dynamo)",
     f"{WORKER}, torch\ntorch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)", _WORKER_ROW),
    ("worker + the digits arrays with numpy only (np.loadtxt of sklearn's digits.csv.gz, no sklearn import)",
     f"{WORKER}, importlib.util, os, numpy as np\n"
     "d = os.path.join(importlib.util.find_spec('sklearn').submodule_search_locations[0], 'datasets', 'data')\n"
     "a = np.loadtxt(os.path.join(d, 'digits.csv.gz'), delimiter=',')", _WORKER_ROW),
]
OS_EXIT = "import os\nos._exit(0)\n"
# An interpreter's exit after the imports of distsync's launcher, and of torch: (name, code, how it ends).
LAUNCHER = f"import distsync.cli, distsync.experiments\n{DIGITS}\n"
EXITS = [
    ("launcher's imports; normal exit", LAUNCHER, ""),
    ("launcher's imports; gc.freeze() before exit", LAUNCHER + "import gc\ngc.freeze()\n", ""),
    ("launcher's imports; os._exit(0)", LAUNCHER, OS_EXIT),
    ("import torch; normal exit", "import torch\n", ""),
    ("import torch; os._exit(0)", "import torch\n", OS_EXIT),
]


def _clocked(code: str, src: str | None, end: str) -> dict:
    """CPU seconds of ``python -c CODE`` until ``end`` (``cpu_s``) and from there to its exit
    (``exit_cpu_s``); ``error``: its output's tail, when it failed."""
    clock = "\nimport sys as _s, time as _t\n_s.stdout.write('CLOCK %r\\n' % _t.process_time())\n_s.stdout.flush()\n"
    proc = subprocess.Popen([sys.executable, "-c", code + clock + end], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=job_env(src), cwd=REPO)
    out = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    m = re.search(r"CLOCK (\S+)", out)
    if not m or os.waitstatus_to_exitcode(status) != 0:
        return {"error": out[-500:]}
    return {"cpu_s": float(m[1]), "exit_cpu_s": usage.ru_utime + usage.ru_stime - float(m[1])}


def isolated_costs(src: str | None, repeats: int = 3) -> dict:
    pieces = [(name, code, OS_EXIT) for name, code, _ in ISOLATED] + EXITS
    samples: dict[str, list[dict]] = {name: [] for name, _, _ in pieces}
    for _ in range(repeats):
        for name, code, end in pieces:
            samples[name].append(_clocked(code, src, end))
    cost = {}
    for name, runs in samples.items():
        ok = [r for r in runs if "error" not in r]
        cost[name] = {k: median(r[k] for r in ok) for k in ("cpu_s", "exit_cpu_s")} if ok else runs[0]
    rows = []
    for name, _code, base in ISOLATED:
        row = {"what": name, **({"error": cost[name]["error"]} if "error" in cost[name]
                                else {"cpu_s": cost[name]["cpu_s"]})}
        if base and "error" not in cost[name] and "error" not in cost[base]:
            row.update(adds_cpu_s=row["cpu_s"] - cost[base]["cpu_s"], over=base)
        rows.append(row)
    exits = [{"what": name, "exit_cpu_s": cost[name]["exit_cpu_s"]} for name, _, _ in EXITS if "error" not in cost[name]]
    return {"repeats": repeats, "rows": rows, "interpreter_exit": exits}


def run_breakdown(workers: list[int], src: str | None, tmp: Path, trivial: Path) -> dict:
    by_workers = []
    for n in workers:
        entry: dict = {"workers": n}
        for kind in KINDS:
            trace = tmp / f"{kind}-{n}.trace.jsonl"
            work = tmp / f"traced-{kind}-{n}"
            work.mkdir(parents=True, exist_ok=True)
            res = run(commands(n, work, trivial)[kind], job_env(src, trace), tmp / f"{kind}-{n}.log")
            events = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
            entry[kind] = analyse(kind, res, events)
        by_workers.append(entry)
    print("costs in isolation (each piece as its own python -c, median of 3)...", flush=True)
    return {"by_workers": by_workers, "isolated": isolated_costs(src)}


# The page's tables
def _head(raw: dict) -> str:
    return (f"`{raw['command']}` at commit {str(raw['commit'])[:10]}"
            + (" (the working tree differed)" if raw.get("dirty") else "")
            + f", {raw['machine']['cpu_count']} cores, torch {raw['machine']['torch']}, {raw['date']}.")


def _joined(tables: dict[int, list[dict]], cols: list[tuple[str, str]]) -> tuple[list[str], list[list]]:
    """One row per phase (in the order first seen), for each worker count the columns ``cols``
    ((key, label)) of that count's row for the phase."""
    order: list[str] = []
    for rows in tables.values():
        order += [r["phase"] for r in rows if r["phase"] not in order]
    headers = ["phase"] + [f"N={n} {label}" for n in tables for _, label in cols]
    out = []
    for phase in order:
        row = [phase]
        for n, rows in tables.items():
            r = next((x for x in rows if x["phase"] == phase), None)
            row += ["-" if r is None or r.get(k) is None else f"{r[k]:.2f}" for k, _ in cols]
        out.append(row)
    return headers, out


def render(raw: dict) -> dict[str, str]:
    """The page's blocks: ``startup`` (timing), ``startup_breakdown`` and ``startup_isolated``
    (when the raw results have a breakdown)."""
    blocks = {}
    t = raw.get("timing")
    if t:
        load = t["load_average_1min"]
        lines = [_head(raw), "", f"Regime: {raw.get('regime')}. {t['repeats']} timed runs of each command per worker "
                 f"count, alternated (after {t['warmup']} warm-up round(s)): median (min-max); the ratio to torchrun "
                 f"per repeat (the runs of one round). 1-minute load average during the runs: {load['min']:.2f} to "
                 f"{load['max']:.2f} (median {load['median']:.2f}). Wall: command start to exit; CPU: user+system "
                 f"seconds of the command and every process it started.", ""]
        rows = []
        for n in dict.fromkeys(x["workers"] for x in t["runs"]):
            runs = {name: {x["repeat"]: x for x in t["runs"] if x["command"] == name and x["workers"] == n}
                    for name in KINDS}
            base = {k: x["wall_s"] for k, x in runs["torchrun"].items()}
            for name in KINDS:
                walls = {k: x["wall_s"] for k, x in runs[name].items()}
                met = median(walls.values()) / median(base.values()) <= 1.5
                rows.append([n, name, shown(walls.values()), shown(x["cpu_s"] for x in runs[name].values()),
                             "1.00x" if name == "torchrun" else shown(ratios(walls, base), unit="x"),
                             "" if name == "torchrun" else ("met" if met else "MISSED") + " (median)"])
        lines += markdown_table(["workers", "command", "wall (s)", "CPU (s)", "/ torchrun", "target <= 1.5x"], rows)
        blocks["startup"] = "\n".join(lines)
    b = raw.get("breakdown")
    if b:
        lines = [_head(raw), "", "One traced run of each command per worker count (tracing adds a little to each "
                 "process; a single run's walls are noisier than the timing's medians). Launcher: wall and CPU of "
                 "each phase of the launching process (serial). Workers: wall, the median over the workers; CPU, "
                 "summed over them.", ""]
        for kind in KINDS:
            entries = {e["workers"]: e[kind] for e in b["by_workers"] if kind in e}
            if not entries:
                continue
            summary = "; ".join(f"N={n}: {a['wall_s']:.2f} s wall, {a['cpu_s']:.2f} s CPU (all processes), load "
                                f"{a['load_before']:.2f}" for n, a in entries.items())
            lines += [f"**{kind}** ({summary}), the launching process:", ""]
            headers, rows = _joined({n: a["launcher"] for n, a in entries.items()},
                                    [("wall_s", "wall (s)"), ("cpu_s", "CPU (s)")])
            lines += markdown_table(headers, rows) + ["", f"**{kind}**, each worker:", ""]
            headers, rows = _joined({n: a["workers"] for n, a in entries.items()},
                                    [("wall_median_s", "wall (s)"), ("cpu_sum_s", "CPU (s)")])
            lines += markdown_table(headers, rows) + [""]
            after = "; ".join(f"N={n}: {a['cpu_after_last_event_s']:.2f}" for n, a in entries.items())
            lines += [f"CPU seconds after every process's last traced event (interpreter finalization): {after}.", ""]
        blocks["startup_breakdown"] = "\n".join(lines).rstrip("\n")
        iso = b.get("isolated")
        if iso:
            lines = [_head(raw), "", f"Each piece as its own `python -c`, median of {iso['repeats']}: CPU seconds of "
                     "that process before its exit, and what it adds over the line named.", ""]
            rows = [[f"`{r['what']}`", "failed" if "error" in r else f"{r['cpu_s']:.2f}",
                     f"{r['adds_cpu_s']:.2f} over `{r['over']}`" if "adds_cpu_s" in r else ""] for r in iso["rows"]]
            rows += [[f"interpreter exit: {r['what']}", f"{r['exit_cpu_s']:.2f}", ""] for r in iso["interpreter_exit"]]
            lines += markdown_table(["what", "CPU (s)", "adds (CPU s)"], rows)
            blocks["startup_isolated"] = "\n".join(lines)
    return blocks


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="2,4", help="comma-separated worker counts (default: 2,4)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each command per worker count (default: 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default: 1)")
    p.add_argument("--breakdown", action="store_true", help="only the breakdown of one traced run per worker count")
    p.add_argument("--full", action="store_true", help="the timings and the breakdown, in one JSON")
    p.add_argument("--json", help="where to write the results (default: benchmarks/results/startup.json, "
                                  "or startup-breakdown.json with --breakdown)")
    p.add_argument("--src", help="a folder holding the distsync package to measure, put first on PYTHONPATH "
                                 "(default: the installed one)")
    args = p.parse_args()
    try:
        workers = [int(x) for x in args.workers.split(",") if x.strip()]
    except ValueError:
        p.error(f"bad --workers {args.workers!r}")
    if not workers or min(workers) < 1 or args.repeats < 1 or args.warmup < 0:
        p.error("--workers must be >= 1, --repeats >= 1, --warmup >= 0")
    started = provenance("benchmarks/startup.py")
    src = str(Path(args.src).resolve()) if args.src else None
    regime = REGIME.format(cores=os.cpu_count() or 1)
    # processes a command leaves behind (a fork server outliving its launcher) become this
    # process's children when their parent ends, so that run() reaps them and counts their CPU
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    out: dict = {"benchmark": "startup", "src": src or "the installed package"}
    tmp = Path(tempfile.mkdtemp(prefix="distsync-startup-"))
    try:
        trivial = tmp / "trivial_allreduce.py"
        trivial.write_text(TRIVIAL)
        if not args.breakdown:
            out["timing"] = run_timing(workers, args.repeats, args.warmup, src, tmp, trivial)
        if args.breakdown or args.full:
            print("\nbreakdown (traced runs; tracing adds a little to each process)...", flush=True)
            out["breakdown"] = run_breakdown(workers, src, tmp, trivial)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = compact(out)
    print("\n\n".join(render({**started, "regime": regime, **out}).values()))
    path = args.json or REPO / "benchmarks" / "results" / ("startup-breakdown.json" if args.breakdown else "startup.json")
    # (every run of a command here is the same job, seed 0: the repeats are runs, not seeds)
    write_record(path, started, regime=regime, seeds=[0], payload={**out, "repeats": 1 if args.breakdown else args.repeats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
