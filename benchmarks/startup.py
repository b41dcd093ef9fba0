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
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import provenance, write_record
from distsync.metrics.repeats import ratios, shown
from distsync.experiments.report import markdown_table

BIN = Path(sys.executable).parent
REGIME = "CPU-bound real run on this machine ({cores} cores): every process of a job shares them"

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


# ---------------------------------------------------------------------------------------------
# Running commands
# ---------------------------------------------------------------------------------------------
def tool(name: str) -> str:
    here = BIN / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if not found:
        sys.exit(f"startup.py: {name} not found next to {sys.executable} nor on PATH")
    return found


def base_env(src: str | None, extra_path: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    parts = [p for p in (extra_path, src, env.get("PYTHONPATH")) if p]
    if parts:
        env["PYTHONPATH"] = os.pathsep.join(parts)
    env.pop("STARTUP_TRACE", None)
    return env


def commands(n: int, work: Path, trivial: Path) -> dict[str, list[str]]:
    return {
        "distsync": [tool("distsync"), "train", "--overwrite", "--workload", "digits", "--steps", "1", "--workers", str(n),
                     "--out", str(work / "run")],
        "torchrun": [tool("torchrun"), "--standalone", "--nproc-per-node", str(n), str(trivial)],
    }


def become_subreaper() -> bool:
    """Make processes that a command leaves behind (a fork server outliving its launcher) this
    process's children when their parent ends, so :func:`timed` reaps them and counts their CPU."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except Exception:
        return False


def timed(cmd: list[str], env: dict[str, str], log: Path, timeout: float = 300.0) -> dict:
    """Wall seconds from start to exit, CPU seconds of the command and every process it
    started (those it left behind too, reaped here: see :func:`become_subreaper`), exit code,
    load average before and after."""
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
        proc.returncode = os.waitstatus_to_exitcode(status)
    cpu = usage.ru_utime + usage.ru_stime
    # processes the command left behind: wait for them (up to 30 s), adding their CPU
    left, deadline = 0, time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            pid, _, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.01)
            continue
        left += 1
        cpu += usage.ru_utime + usage.ru_stime
    return {"wall_s": wall, "cpu_s": cpu, "rc": proc.returncode, "left_behind": left,
            "left_behind_s": time.perf_counter() - a - wall,
            "load_before": load0, "load_after": os.getloadavg()[0], "t_start": t0, "t_end": t1}


# ---------------------------------------------------------------------------------------------
# (1) Timing
# ---------------------------------------------------------------------------------------------
def run_timing(workers: list[int], repeats: int, warmup: int, src: str | None, tmp: Path) -> dict:
    trivial = tmp / "trivial_allreduce.py"
    trivial.write_text(TRIVIAL)
    env = base_env(src)
    kinds = ["distsync", "torchrun"]
    runs: list[dict] = []
    plan: list[tuple[int, int, str]] = []
    for r in range(-warmup, repeats):
        for n in workers:
            # rotate which goes first, so none always follows another
            k = (r + warmup) % len(kinds)
            plan += [(r, n, which) for which in kinds[k:] + kinds[:k]]
    for i, (r, n, which) in enumerate(plan):
        work = tmp / f"{which.replace(',', '_')}-{n}-{r}"
        work.mkdir(parents=True, exist_ok=True)
        cmd = commands(n, work, trivial)[which]
        res = timed(cmd, env, work / "output.log")
        tag = "warm-up" if r < 0 else f"repeat {r + 1}/{repeats}"
        print(f"  [{i + 1}/{len(plan)}] {which:8s} N={n} {tag:12s} {res['wall_s']:6.2f} s wall  "
              f"{res['cpu_s']:6.2f} s CPU  load {res['load_before']:.2f}" + ("" if res["rc"] == 0 else f"  EXIT {res['rc']}"),
              flush=True)
        if res["rc"] != 0:
            tail = (work / "output.log").read_text(errors="replace")[-2000:]
            sys.exit(f"startup.py: {' '.join(cmd)} failed (exit {res['rc']}):\n{tail}")
        if r >= 0:
            runs.append({"command": which, "workers": n, "repeat": r, **res})
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for n in workers:
        row: dict = {"workers": n}
        for which in kinds:
            mine = [x for x in runs if x["command"] == which and x["workers"] == n]
            row[which] = {"median_wall_s": statistics.median(x["wall_s"] for x in mine),
                          "min_wall_s": min(x["wall_s"] for x in mine), "max_wall_s": max(x["wall_s"] for x in mine),
                          "median_cpu_s": statistics.median(x["cpu_s"] for x in mine)}
        row["ratio"] = row["distsync"]["median_wall_s"] / row["torchrun"]["median_wall_s"]
        rows.append(row)
    loads = [x["load_before"] for x in runs]
    return {"repeats": repeats, "warmup": warmup, "rows": rows, "runs": runs,
            "load_average_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
            "commands": {k: " ".join(v).replace(str(tmp), "TMP") for k, v in commands(0, tmp / "W", trivial).items()},
            "trivial_script": TRIVIAL}


def compact(obj, drop=("per_worker", "t_start", "t_end", "from")):
    """``obj`` with floats to 3 decimals and the bulky per-worker detail left out."""
    if isinstance(obj, float):
        return round(obj, 3)
    if isinstance(obj, dict):
        return {k: compact(v, drop) for k, v in obj.items() if k not in drop}
    if isinstance(obj, (list, tuple)):
        return [compact(v, drop) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------------
# (2) Breakdown
# ---------------------------------------------------------------------------------------------
def traced_run(cmd: list[str], src: str | None, tmp: Path, name: str) -> tuple[dict, list[dict]]:
    trace = tmp / f"{name}.trace.jsonl"
    trace.unlink(missing_ok=True)
    env = base_env(src, str(TRACER_DIR))
    env["STARTUP_TRACE"] = str(trace)
    res = timed(cmd, env, tmp / f"{name}.log")
    if res["rc"] != 0:
        tail = (tmp / f"{name}.log").read_text(errors="replace")[-2000:]
        sys.exit(f"startup.py: traced {' '.join(cmd)} failed (exit {res['rc']}):\n{tail}")
    events = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    return res, events


class Proc:
    """One process's events: points ``name>`` (enter) and ``name<`` (exit), each (unix, cpu)."""

    def __init__(self, pid: int, events: list[dict]):
        self.pid = pid
        self.events = events
        self.rank = next((e["rank"] for e in events if e.get("rank") is not None), None)
        self.points: dict[str, list[tuple[float, float]]] = {}
        for e in events:
            if e["ev"] == "site":
                self.add("site", e["t"], e["cpu"])
                if e.get("started"):
                    self.add("started", e["started"], 0.0)
            elif e["ev"] == "call":
                self.add(e["fn"] + ">", e["t0"], e["cpu0"])
                self.add(e["fn"] + "<", e["t"], e["cpu"])
            elif e["ev"] == "import":
                self.add("import:" + e["mod"] + ">", e["t0"], e["cpu0"])
                self.add("import:" + e["mod"] + "<", e["t"], e["cpu"])
            elif e["ev"] in ("os_exit", "atexit"):
                self.add(e["ev"], e["t"], e["cpu"])
        self.cmd = next((e.get("cmd") for e in events if e["ev"] == "site"), [])

    def add(self, name: str, t: float, cpu: float) -> None:
        self.points.setdefault(name, []).append((t, cpu))

    def at(self, name: str, which: int = 0) -> tuple[float, float] | None:
        pts = self.points.get(name)
        if not pts:
            return None
        try:
            return pts[which]
        except IndexError:
            return None

    def last_cpu(self) -> float:
        return max((e["cpu"] for e in self.events), default=0.0)


def segments(proc: Proc, marks: list[tuple[str, str | tuple[str, int] | None]], t_begin: float | None = None,
             t_end: float | None = None) -> list[dict]:
    """Consecutive segments between the named points that exist, in order: label of each
    segment is the label given with its END point."""
    out = []
    prev_t, prev_cpu, prev_name = t_begin, 0.0 if t_begin is not None else None, "start"
    for label, point in marks:
        if point is None:  # the end of the process (t_end); CPU unknown past its last event
            pt = (t_end, None) if t_end is not None else None
        else:
            name, idx = (point, 0) if isinstance(point, str) else point
            pt = proc.at(name, idx)
        if pt is None:
            continue
        if prev_t is not None:
            cpu = (pt[1] - prev_cpu) if (pt[1] is not None and prev_cpu is not None) else None
            out.append({"phase": label, "wall_s": pt[0] - prev_t, "cpu_s": cpu, "from": prev_name})
        prev_t, prev_cpu, prev_name = pt[0], pt[1], label
    return out


def worker_marks(kind: str) -> list[tuple[str, object]]:
    if kind == "torchrun":
        return [
            ("interpreter up (exec, site)", "site"),
            ("import torch", "distributed_c10d.init_process_group>"),
            ("init_process_group (gloo; waits for every rank)", "distributed_c10d.init_process_group<"),
            ("all_reduce", "distributed_c10d.all_reduce<"),
            ("destroy_process_group", "distributed_c10d.destroy_process_group<"),
            ("end of script to atexit", "atexit"),
        ]
    return [
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
    ]


def parent_marks(kind: str) -> list[tuple[str, object]]:
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
        ("summary table: import distsync.experiments (matplotlib, ...)", "cli._summary_table<"),
        ("print table, return from main", "cli.main<"),
    ]) + [
        ("atexit", "atexit"),
        ("to os._exit (a launcher that leaves without finalization)", "os_exit"),
        ("interpreter exit (finalization: GC, module teardown; none after os._exit) until the command has exited",
         None),
    ]


def analyse(kind: str, res: dict, events: list[dict]) -> dict:
    by_pid: dict[int, list[dict]] = {}
    for e in events:
        by_pid.setdefault(e["pid"], []).append(e)
    procs = {pid: Proc(pid, evs) for pid, evs in by_pid.items()}
    parent = next((p for p in procs.values() if p.rank is None and p.at("api.launch_agent>")), None)
    if parent is None:
        parent = min(procs.values(), key=lambda p: p.at("site")[0] if p.at("site") else float("inf"))
    # a rank's process is the one that joins the process group (a forked job also has a
    # supervising parent per rank, which carries the rank's environment but does not)
    joined = ("process.run_process>", "distributed_c10d.init_process_group>")
    workers = sorted((p for p in procs.values() if p is not parent and p.rank is not None
                      and any(p.at(j) for j in joined)), key=lambda p: int(p.rank))
    exits = [p.at("os_exit") or p.at("atexit") for p in workers]
    exits = [x for x in exits if x]
    if exits:
        parent.add("LAST_WORKER_EXIT", max(x[0] for x in exits), None)
    spawn = parent.at("local_elastic_agent.LocalElasticAgent._start_workers>")
    parent_rows = segments(parent, parent_marks(kind), t_begin=res["t_start"], t_end=res["t_end"])
    worker_rows = []
    for w in workers:
        worker_rows.append(segments(w, worker_marks(kind), t_begin=spawn[0] if spawn else None))
    # per phase, across workers
    phases = [label for label, _ in worker_marks(kind)]
    per_phase = []
    for label in phases:
        cells = [r for rows in worker_rows for r in rows if r["phase"] == label]
        if not cells:
            continue
        walls = [c["wall_s"] for c in cells]
        cpus = [c["cpu_s"] for c in cells if c["cpu_s"] is not None]
        per_phase.append({"phase": label, "wall_median_s": statistics.median(walls), "wall_max_s": max(walls),
                          "cpu_sum_s": sum(cpus), "workers": len(cells)})
    patch_failed = sorted({e["fn"] for e in events if e["ev"] == "patch-failed"})
    if patch_failed:
        print(f"  (not traced, code moved: {', '.join(patch_failed)})", flush=True)
    # CPU no traced event saw: what ran after each process's last event (interpreter finalization)
    untraced = res["cpu_s"] - sum(p.last_cpu() for p in procs.values())
    return {"command": kind, "wall_s": res["wall_s"], "cpu_s": res["cpu_s"], "load_before": res["load_before"],
            "cpu_after_last_event_s": untraced,
            "launcher": parent_rows, "launcher_cpu_s": parent.last_cpu(),
            "workers": per_phase, "per_worker": [{"rank": int(w.rank), "phases": rows, "cpu_s": w.last_cpu()}
                                                 for w, rows in zip(workers, worker_rows)],
            "patch_failed": patch_failed}


# What one piece of start-up costs on its own: (name, code, the entry it adds to). Each is run
# as ``python -c CODE`` that reports its clock and CPU at the end; the cost is the median over
# the repeats of its CPU (and wall) minus its base's.
ISOLATED = [
    ("python -c pass", "pass", None),
    ("import torch", "import torch", "python -c pass"),
    ("import torch.distributed.run (torchrun's launcher)", "import torch.distributed.run", "import torch"),
    ("import distsync.cli (distsync's launcher)", "import distsync.cli", "import torch"),
    ("launcher + load_workload('digits') (sklearn, scipy, pandas)",
     "import distsync.cli\nfrom distsync.workloads import load_workload\nload_workload('digits')",
     "import distsync.cli (distsync's launcher)"),
    ("launcher + import distsync.experiments (the summary table's import: matplotlib)",
     "import distsync.cli, distsync.experiments", "import distsync.cli (distsync's launcher)"),
    ("import distsync.worker, distsync.runtime.process (a worker, before its workload)",
     "import distsync.worker, distsync.runtime.process", "import torch"),
    ("worker + load_workload('digits') (sklearn, scipy, pandas)",
     "import distsync.worker, distsync.runtime.process\nfrom distsync.workloads import load_workload\n"
     "load_workload('digits')", "import distsync.worker, distsync.runtime.process (a worker, before its workload)"),
    ("worker + torch.optim.SGD(...) (its first call imports torch._dynamo)",
     "import distsync.worker, distsync.runtime.process, torch\n"
     "torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)",
     "import distsync.worker, distsync.runtime.process (a worker, before its workload)"),
    ("worker + the digits arrays with numpy only (np.loadtxt of sklearn's digits.csv.gz, no sklearn import)",
     "import distsync.worker, distsync.runtime.process, importlib.util, os, numpy as np\n"
     "d = os.path.join(importlib.util.find_spec('sklearn').submodule_search_locations[0], 'datasets', 'data')\n"
     "a = np.loadtxt(os.path.join(d, 'digits.csv.gz'), delimiter=',')",
     "import distsync.worker, distsync.runtime.process (a worker, before its workload)"),
]
# Interpreter exit of a process that imported what distsync's launcher imports.
EXIT_CODE = ("import distsync.cli, distsync.experiments\nfrom distsync.workloads import load_workload\n"
             "load_workload('digits')\n")
EXIT_VARIANTS = [("normal exit", "", ""), ("gc.freeze() before exit", "import gc\ngc.freeze()\n", ""),
                 ("os._exit(0)", "", "EXIT")]
TORCH_EXIT = [("import torch; normal exit", "import torch\n", ""),
              ("import torch; os._exit(0)", "import torch\n", "EXIT")]


def _clocked(code: str, src: str | None, exit_how: str = "") -> dict:
    tail = "\nimport os as _o, sys as _s, time as _t\n_s.stdout.write('CLOCK %r %r\\n' % (_t.time(), _t.process_time()))\n" \
           "_s.stdout.flush()\n" + ("_o._exit(0)\n" if exit_how == "EXIT" else exit_how)
    t0 = time.time()
    a = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code + tail], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=base_env(src), cwd=REPO)
    out = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - a
    t1 = time.time()
    m = re.search(r"CLOCK (\S+) (\S+)", out)
    cpu = usage.ru_utime + usage.ru_stime
    if not m or os.waitstatus_to_exitcode(status) != 0:
        return {"error": out[-500:]}
    return {"wall_s": wall, "cpu_s": cpu, "exit_wall_s": t1 - float(m[1]), "exit_cpu_s": cpu - float(m[2]),
            "wall_to_end_s": float(m[1]) - t0}


def isolated_costs(src: str | None, repeats: int = 3) -> dict:
    samples: dict[str, list[dict]] = {}
    for _ in range(repeats):
        for name, code, _base in ISOLATED:
            samples.setdefault(name, []).append(_clocked(code, src, "EXIT"))
        for name, pre, how in EXIT_VARIANTS:
            samples.setdefault("launcher's imports; " + name, []).append(_clocked(EXIT_CODE + pre, src, how))
        for name, code, how in TORCH_EXIT:
            samples.setdefault(name, []).append(_clocked(code, src, how))
    med = {}
    for name, runs in samples.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            med[name] = {"error": runs[0].get("error")}
            continue
        med[name] = {k: statistics.median(r[k] for r in ok) for k in ok[0]}
    rows = []
    for name, _code, base in ISOLATED:
        m = med[name]
        if "error" in m:
            rows.append({"what": name, "error": m["error"]})
            continue
        # a process that ends with os._exit: its cost is what ran before the exit
        row = {"what": name, "cpu_s": m["cpu_s"] - m["exit_cpu_s"], "wall_s": m["wall_to_end_s"]}
        if base and "error" not in med[base]:
            b = med[base]
            row["adds_cpu_s"] = row["cpu_s"] - (b["cpu_s"] - b["exit_cpu_s"])
            row["adds_wall_s"] = row["wall_s"] - b["wall_to_end_s"]
            row["over"] = base
        rows.append(row)
    exits = [{"what": name, "exit_wall_s": med[name]["exit_wall_s"], "exit_cpu_s": med[name]["exit_cpu_s"]}
             for name in med if ("exit" in name or "freeze" in name) and "error" not in med[name]]
    return {"repeats": repeats, "rows": rows, "interpreter_exit": exits}


def run_breakdown(workers: list[int], src: str | None, tmp: Path) -> dict:
    trivial = tmp / "trivial_allreduce.py"
    trivial.write_text(TRIVIAL)
    result: dict = {"by_workers": []}
    for n in workers:
        entry: dict = {"workers": n}
        for kind in ("distsync", "torchrun"):
            work = tmp / f"traced-{kind}-{n}"
            work.mkdir(parents=True, exist_ok=True)
            res, events = traced_run(commands(n, work, trivial)[kind], src, tmp, f"{kind}-{n}")
            entry[kind] = analyse(kind, res, events)
        result["by_workers"].append(entry)
    print("costs in isolation (each piece as its own python -c, median of 3)...", flush=True)
    result["isolated"] = isolated_costs(src)
    return result


# ---------------------------------------------------------------------------------------------
# The page's tables
# ---------------------------------------------------------------------------------------------
def _head(raw: dict) -> str:
    m = raw.get("machine") or {}
    return (f"`{raw.get('command', '?')}` at commit {str(raw.get('commit'))[:10]}"
            + (" (the working tree differed)" if raw.get("dirty") else "")
            + f", {m.get('cpu_count') or m.get('cores')} cores, torch {m.get('torch')}, {raw.get('date') or raw.get('when', '')}.")


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
        names = ["distsync", "torchrun"]
        for r in t["rows"]:
            n = r["workers"]
            runs = {name: {x["repeat"]: x for x in t["runs"] if x["command"] == name and x["workers"] == n}
                    for name in names}
            base = {k: x["wall_s"] for k, x in runs["torchrun"].items()}
            for name in names:
                walls = {k: x["wall_s"] for k, x in runs[name].items()}
                ratio = ratios(walls, base)
                target = "" if name == "torchrun" else ("met" if r[name]["median_wall_s"] / r["torchrun"]["median_wall_s"]
                                                        <= 1.5 else "MISSED") + " (median)"
                rows.append([n, name, shown(walls.values()), shown(x["cpu_s"] for x in runs[name].values()),
                             "1.00x" if name == "torchrun" else shown(ratio, unit="x"), target])
        lines += markdown_table(["workers", "command", "wall (s)", "CPU (s)", "/ torchrun", "target <= 1.5x"], rows)
        blocks["startup"] = "\n".join(lines)
    b = raw.get("breakdown")
    if b:
        lines = [_head(raw), "", "One traced run of each command per worker count (tracing adds a little to each "
                 "process; a single run's walls are noisier than the timing's medians). Launcher: wall and CPU of "
                 "each phase of the launching process (serial). Workers: wall, the median over the workers; CPU, "
                 "summed over them.", ""]
        for kind in ("distsync", "torchrun"):
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


# ---------------------------------------------------------------------------------------------
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
    cores = os.cpu_count() or 1
    become_subreaper()
    print(f"regime: {REGIME.format(cores=cores)}; uptime load average {os.getloadavg()}", flush=True)
    out: dict = {"benchmark": "startup", "src": src or "the installed package", "load_average_at_start": os.getloadavg()}
    tmp = Path(tempfile.mkdtemp(prefix="distsync-startup-"))
    try:
        if not args.breakdown:
            out["timing"] = run_timing(workers, args.repeats, args.warmup, src, tmp)
        if args.breakdown or args.full:
            print("\nbreakdown (traced runs; tracing adds a little to each process)...", flush=True)
            out["breakdown"] = run_breakdown(workers, src, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n\n".join(render({**started, "regime": REGIME.format(cores=cores), **compact(out)}).values()))
    out["load_average_at_end"] = os.getloadavg()
    default = "startup-breakdown.json" if args.breakdown else "startup.json"
    path = Path(args.json) if args.json else REPO / "benchmarks" / "results" / default
    # (every run of a command here is the same job, seed 0: the repeats are runs, not seeds)
    write_record(path, started, regime=REGIME.format(cores=cores), seeds=[0],
                 payload={**compact(out), "repeats": 1 if args.breakdown else args.repeats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
