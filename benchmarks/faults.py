"""Fault injection across every solver, bad input, and a soak with a fault every minute.

    python benchmarks/faults.py [--runs 20] [--soak 1200] [--parts faults,bad-input,soak] [--seed 0]
                                [--out benchmarks/results/faults] [--json PATH]

Method, raw results and figures: docs/benchmarks/faults.md.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from common import argument_parser, provenance, write_record

from distsync.experiments.report import markdown_table
from distsync.metrics.processes import tree_usage, with_environ
from distsync.metrics.repeats import spread
from distsync.runtime.network import NETNS_PREFIX
from distsync.solvers import make_solver, solver_names

REPO = Path(__file__).resolve().parents[1]
DISTSYNC = [sys.executable, "-m", "distsync.cli"]
STEPS, EVERY = 120, 20


def random_fault(solver: str, rng: random.Random) -> str:
    """One fault after the first checkpoint: a worker (rank 0 or 1) killed, stalled or given a
    NaN loss, or, for a solver whose plan has processes beside the workers, the first of them killed."""
    roles = list(make_solver(solver).roles)
    step = rng.randint(EVERY + 5, STEPS - 10)
    kind = rng.choice(["kill", "stall", "nan"] + (["kill-role"] if roles else []))
    if kind == "kill-role":
        return f"kill:{roles[0]}@{step}"
    rank = rng.randint(0, 1)
    return f"stall:{rank}@{step}:{rng.uniform(0.2, 2.0):.2f}" if kind == "stall" else f"{kind}:{rank}@{step}"


def _cli(*args: str, timeout: float = 90, env: dict[str, str] | None = None) -> tuple[int | None, str, float]:
    """``distsync ARGS``: its exit status (None: still running after ``timeout`` s, and killed),
    its stderr and its seconds."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run(DISTSYNC + list(args), cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, "", time.monotonic() - t0
    return proc.returncode, proc.stderr, time.monotonic() - t0


# ---- what a run leaves behind -------------------------------------------------------------------
MARK = "DISTSYNC_FAULTS_RUN"  # in the environment of a run's command, and so of every process it starts


def run_env(tag: str) -> dict[str, str]:
    return {**os.environ, MARK: tag}


def marked_processes(tag: str) -> set[int]:
    """The processes (this one aside) whose environment carries run ``tag``'s mark."""
    return with_environ(MARK, tag, but=os.getpid())


def namespaces() -> set[str]:
    """The network namespaces a run with emulated links makes (``ip netns``; none if absent)."""
    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {line.split()[0] for line in out.splitlines() if line.startswith(NETNS_PREFIX)}


def leftovers(tag: str, before_ns: set[str], grace_s: float = 5.0) -> tuple[int, int]:
    """Processes of run ``tag`` still there ``grace_s`` after its command returned, and network
    namespaces that appeared since ``before_ns``; the processes are then killed (so that one
    run's leftovers do not count for the next)."""
    deadline = time.monotonic() + grace_s
    while (left := marked_processes(tag)) and time.monotonic() <= deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return len(left), len(namespaces() - before_ns)


# ---- (1) one fault per run ------------------------------------------------------------------------
def one_run(solver: str, fault: str, out: Path) -> dict:
    tag, ns = str(out), namespaces()
    code, err, _ = _cli("train", "--overwrite", "--solver", solver, "--workers", "2", "--steps", str(STEPS),
                        "--eval-every", "40", "--checkpoint-every", str(EVERY), "--max-restarts", "2",
                        "--timeout", "10", "--fault", fault, "--out", str(out), timeout=120, env=run_env(tag))
    row = {"fault": fault, "finished": code == 0, "hang": code is None}
    row["left_processes"], row["left_namespaces"] = leftovers(tag, ns, grace_s=0 if code is None else 5)
    if code is None:
        return {**row, "as_designed": False}
    err = err.strip()
    if code != 0:
        row["error"] = err.splitlines()[-1] if err else f"exit {code}"
        # A NaN loss stops the run by design, with one line naming it (and no traceback).
        row["as_designed"] = fault.startswith("nan:") and "loss is nan" in row["error"] and "Traceback" not in err
        return row
    row["as_designed"] = not fault.startswith("nan:")
    summary = json.loads((out / "summary.json").read_text())
    rec = summary["recovery"]
    # steps lost: a dropped worker's survivors lose none (they never stopped); recovery: a
    # restart's time to train again, or the time the others took to go on without the dead one
    return {**row, "steps_lost": [f.get("steps_lost", 0) for f in rec["faults"]
                                  if "steps_lost" in f or f.get("dropped")],
            "restarts": rec.get("restarts", 0), "dropped": len(rec["dropped"]),
            "recovery_s": [f.get("recovery_s", f.get("went_on_s")) for f in rec["faults"]
                           if "recovery_s" in f or "went_on_s" in f],
            "lost_updates": lost_updates(solver, summary)}


def lost_updates(solver: str, summary: dict) -> int | None:
    """How far the servers' update counts are from the pushes the workers made, beyond what
    a replaced server reported it may have lost (``versions_lost_at_most``: its updates that
    were neither in the copy it was rebuilt from nor made again). A worker's pushes are its
    steps as its journal has them (``steps_by_worker``): a dropped worker's last journaled
    step + 1 would count steps its other Hogwild threads had not finished (their steps
    interleave). None: no servers."""
    steps = summary["steps_by_worker"]
    s = make_solver(solver)  # (its plan says what the servers should count: Plan.server_updates)
    want = s.Plan.server_updates(s.options, [int(steps.get(str(rank), 0)) for rank in range(len(steps))], STEPS)
    stats = [st for st in summary["solver_stats"].values() if "updates" in st]
    if want is None or not stats:
        return None
    return max(max(0, abs(want - st["updates"]) - int(st.get("versions_lost_at_most") or 0)) for st in stats)


def campaign(solvers: list[str], runs: int, rng: random.Random, out: Path) -> list[dict]:
    """A row per solver: its runs, and the most updates one of them lost."""
    table = []
    for solver in solvers:
        rows = [one_run(solver, random_fault(solver, rng), out / solver / f"run{i}") for i in range(runs)]
        lost = [r["lost_updates"] for r in rows if r.get("lost_updates") is not None]
        table.append({"solver": solver, "runs": rows, "lost_updates": max(lost, default=None)})
        print(f"{solver}: {sum(r['as_designed'] for r in rows)} of {len(rows)} as designed "
              f"({', '.join(r['fault'] for r in rows)})", flush=True)
    return table


# ---- the page's blocks ----------------------------------------------------------------------------
REGIME = {"faults": "CPU-bound real run (digits, 2 workers, loopback) on this machine's cores",
          "bad-input": "CPU-bound real runs (digits, 2 workers)",
          "soak": "emulated devices (allreduce, 4 workers, --device-ms), loopback"}
#: what is summed over runs: ended as designed, hangs, workers dropped, restarts, left behind
COUNTED = ("as_designed", "hang", "dropped", "restarts", "left_processes", "left_namespaces")


def counts(runs: list[dict]) -> dict[str, int]:
    """:data:`COUNTED` summed over ``runs``."""
    return {k: sum(r.get(k, 0) for r in runs) for k in COUNTED}


def _kind(fault: str) -> str:
    """``kill``, ``kill:server``, ``nan``, ``stall`` ...: the fault's kind, and its target unless a rank."""
    kind, rest = fault.split(":", 1)
    target = rest.split("@")[0]
    return kind if target.isdigit() else f"{kind}:{target}"


#: the totals' words for each kind (a role's kill: ``server kills``)
KIND_LABELS = {"kill": "worker kills", "stall": "stalls", "nan": "NaN losses"}


def _no_tmp(text: str, raw: dict) -> str:
    """``text`` with the run's output folder written ``RUN`` (and a table's ``|`` escaped)."""
    out = raw.get("out")
    if out:
        text = text.replace(str(Path(out).resolve()), "RUN").replace(str(out), "RUN")
    return text.replace("|", "\\|")


def fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def render(raw: dict) -> dict[str, str]:
    """The page's blocks: ``faults`` (one fault per run, a row per solver) and
    ``faults_bad_input``, each when its part was run."""
    machine = raw.get("machine") or {}
    head = (f"`{raw.get('command', '?')}` at commit {str(raw.get('commit'))[:10]}"
            + (" (the working tree differed)" if raw.get("dirty") else "")
            + f", {machine.get('cpu_count')} cores, torch {machine.get('torch')}, seed {raw.get('seed')}, "
            f"{raw.get('date', '')}.")
    blocks = {}
    if raw.get("solvers"):
        t = raw["solvers"]
        rows = []
        for x in t:
            c = counts(x["runs"])
            lost = spread(v for r in x["runs"] for v in r.get("steps_lost", []))
            recovery = spread(v for r in x["runs"] for v in r.get("recovery_s", []))
            rows.append([f"`{x['solver']}`", len(x["runs"]), c["as_designed"], c["dropped"], c["restarts"],
                         "-" if not lost else f"{lost[0]:g} / {lost[2]}",
                         fmt(recovery[2] if recovery else None, "{:.2f}"), c["hang"], fmt(x["lost_updates"], "{}"),
                         f"{c['left_processes']} / {c['left_namespaces']}",
                         ", ".join(sorted({_kind(r["fault"]) for r in x["runs"]}))])
        runs = [r for x in t for r in x["runs"]]
        c = counts(runs)
        went_on = [g for r in runs if r.get("dropped") for g in r.get("recovery_s", []) if g is not None]
        kinds = Counter(KIND_LABELS.get(k, f"{k.split(':')[-1]} kills") for k in (_kind(r["fault"]) for r in runs))
        lines = [head, "", f"Regime: {REGIME['faults']}. {raw.get('runs_per_solver')} runs per solver, one fault "
                 f"each, drawn with seed {raw.get('seed')}.", ""]
        lines += markdown_table(["solver", "faults injected", "ended as designed", "workers dropped", "restarts",
                                 "steps lost (median / max)", "max recovery (s)", "hangs", "lost updates",
                                 "left behind (processes / namespaces)", "fault kinds drawn"], rows)
        lines += ["", f"Totals: {len(runs)} runs (" + ", ".join(f"{n} {k}" for k, n in kinds.items())
                  + f"), {c['as_designed']} ended as designed, {c['hang']} hangs, {c['dropped']} workers dropped, "
                  f"{c['restarts']} restarts, lost updates at most {max((x['lost_updates'] or 0) for x in t)}, "
                  f"{c['left_processes']} processes and {c['left_namespaces']} namespaces left behind; going on "
                  "without a dead worker: " + (f"{max(went_on):.3f} s at most over {len(went_on)} drops."
                                               if went_on else "no drop timed.")]
        bad = [(x["solver"], r) for x in t for r in x["runs"] if not r["as_designed"]]
        if bad:
            lines += ["", "Runs that did not end as designed:", ""]
            lines += [f"- `{s}` `{r['fault']}`: `{_no_tmp(str(r.get('error', 'hang')), raw)[:300]}`" for s, r in bad]
        blocks["faults"] = "\n".join(lines)
    if raw.get("bad_input"):
        cases = raw["bad_input"]
        rows = [[c["case"], "yes" if c["ok"] else "NO", fmt(c["exit"], "{}"), f"{c['seconds']:.1f}",
                 f"`{_no_tmp(c.get('skipped_line') or (c['stderr'][-1] if c['stderr'] else ''), raw).strip()[:200]}`"
                 + (f"; resumed from step {c['resumed_from_step']}" if c.get("resumed_from_step") is not None else "")]
                for c in cases]
        lines = [head, "", f"Regime: {REGIME['bad-input']}; each case once.", ""]
        lines += markdown_table(["bad input", "handled", "exit", "seconds", "what it said"], rows)
        lines += ["", f"{sum(c['ok'] for c in cases)} of {len(cases)} handled."]
        blocks["faults_bad_input"] = "\n".join(lines)
    return blocks


# ---- (2) bad input ----------------------------------------------------------------------------------
NAN_WORKLOAD = """
import torch
from distsync.workloads import Workload

class Poison(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * float("nan")

def make_workload():
    x = torch.randn(200, 8, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    return Workload(name="poison", make_model=lambda: Poison(8, 2), train_data=(x, y), eval_data=(x, y),
                    target=0.9, batch_size=16, steps=20, eval_every=10)
"""


def _crashed_run(run: Path, seed: int = 0) -> Path:
    """A run that died after its checkpoints 1 and 2 (steps 20 and 40); its checkpoint 2."""
    code, err, _ = _cli("train", "--overwrite", "--workers", "2", "--steps", "60", "--seed", str(seed),
                        "--checkpoint-every", "20", "--on-failure", "restart", "--max-restarts", "0",
                        "--fault", "kill:1@50", "--out", str(run))
    if code == 0 or not (run / "checkpoints" / "ckpt-000002").exists():
        raise SystemExit(f"the crashed run to resume did not crash as planned: {err.strip()[-300:]}")
    return run / "checkpoints" / "ckpt-000002"


def _spoil(ckpt: Path, how: str, other_job: Path) -> None:
    """Rank 1's data in checkpoint ``ckpt`` corrupted (a byte flipped) or truncated (to a third),
    or the whole checkpoint replaced by that of a job with another model seed (``foreign``)."""
    if how == "foreign":
        shutil.rmtree(ckpt)
        shutil.copytree(_crashed_run(other_job, seed=7), ckpt)
        return
    data = sorted(ckpt.glob("rank-1*.pt"))[0]
    raw = bytearray(data.read_bytes())
    if how == "truncate":
        raw = raw[: len(raw) // 3]
    else:
        raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def bad_input(out: Path) -> list[dict]:
    """Each case: a command that must refuse the input in one line (or refuse it, log it and
    go on), lose nothing and not hang."""
    out.mkdir(parents=True, exist_ok=True)
    cases = []
    for name, how in [("corrupt checkpoint", "corrupt"), ("truncated checkpoint", "truncate"),
                      ("another job's checkpoint", "foreign")]:
        run = out / name
        _spoil(_crashed_run(run), how, out / "other-job")
        code, err, secs = _cli("train", "--resume", str(run))
        s = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
        resumed = ((s.get("recovery") or {}).get("resumed_from_steps") or [None])[-1]
        cases.append({"case": name, "exit": code, "seconds": secs, "stderr": err.strip().splitlines()[-3:],
                      "skipped_line": next((ln for ln in err.splitlines() if "skipped" in ln), None),
                      "resumed_from_step": resumed,
                      "ok": code == 0 and resumed == 20 and "Traceback" not in err and s.get("steps_per_worker") == 60
                      and "skipped checkpoint ckpt-000002" in err})

    def one_line_case(name: str, *args: str, want: str) -> None:
        code, err, secs = _cli(*args)
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        cases.append({"case": name, "exit": code, "seconds": secs, "stderr": lines[-3:],
                      "ok": code not in (0, None) and len(lines) == 1 and "Traceback" not in err and want in err})

    for name, change, want in [("config: a wrong type", {"workers": "two"}, "config field workers must be an integer"),
                               ("config: an unknown key", {"wrokers": 2}, "unknown config field(s): wrokers")]:
        run = out / name.replace(" ", "-")
        _crashed_run(run)
        (run / "config.json").write_text(json.dumps({**json.loads((run / "config.json").read_text()), **change}))
        one_line_case(name, "train", "--resume", str(run), want=want)
    one_line_case("an absurd size: 100,000 workers", "train", "--workers", "100000", "--out", str(out / "absurd"),
                  want="--workers 44 or fewer")
    one_line_case("an absurd size: a batch of 10^15", "train", "--batch-size", str(10**15), "--out",
                  str(out / "absurd-batch"), want="fewer than the batch size")
    jobs = out / "jobs.toml"
    jobs.write_text('[crossover]\npolicy = "alternate"\n\n[[job]]\nname = "a"\nsolver = "allreduce"\nsteps = "many"\n')
    one_line_case("jobs file: a wrong type", "crossover", str(jobs), "--out", str(out / "x"), want="steps")
    raising = out / "raising.py"
    raising.write_text("def make_workload():\n    raise RuntimeError('the data folder is empty')\n")
    one_line_case("workload raises while built", "train", "--workload", f"{raising}:make_workload", "--out",
                  str(out / "raising"), want="the data folder is empty")
    poison = out / "poison.py"
    poison.write_text(NAN_WORKLOAD)
    one_line_case("workload's loss is NaN", "train", "--workload", f"{poison}:make_workload", "--out",
                  str(out / "poison"), want="loss is nan")
    return cases


# ---- (3) soak ---------------------------------------------------------------------------------------
def soak(seconds: float, out: Path, device_ms: float = 30.0) -> dict:
    """``allreduce``, 4 workers on emulated devices, healing from live peers, a fault a minute;
    the job's resident memory, threads and open files sampled every 5 s."""
    base = ["train", "--overwrite", "--solver", "allreduce", "--workers", "4", "--device-ms", f"{device_ms:g}",
            "--timeout", "10"]
    code, err, _ = _cli(*base, "--steps", "300", "--eval-every", "300", "--out", str(out / "probe"))
    if code != 0:
        raise SystemExit(f"the soak's probe run failed: {err.strip()[-300:]}")
    probed = json.loads((out / "probe" / "summary.json").read_text())
    rate = probed["steps_per_worker"] / probed["wall_time_s"]
    steps = int(rate * seconds)
    faults = []
    for minute in range(1, int(seconds // 60)):
        rank, step = (minute - 1) // 2 % 4, int(rate * 60 * minute)
        faults.append(f"kill:{rank}@{step}" if minute % 2 else f"stall:{rank}@{step}:2")
    args = base + ["--steps", str(steps), "--eval-every", str(max(1, steps // 20)),
                   "--max-restarts", str(len(faults)), "--out", str(out / "run")]
    args += [a for f in faults for a in ("--fault", f)]
    tag, ns = str(out / "run"), namespaces()
    proc = subprocess.Popen(DISTSYNC + args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=run_env(tag))
    samples, start = [], time.monotonic()
    try:
        while proc.poll() is None and time.monotonic() - start < seconds * 2 + 120:
            time.sleep(5)
            samples.append({"t": time.monotonic() - start, **tree_usage(proc.pid)})
    finally:
        hung = proc.poll() is None
        if hung:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    err = proc.stderr.read() if proc.stderr else ""
    elapsed = time.monotonic() - start
    left_procs, left_ns = leftovers(tag, ns)
    # Growth over training: from the first sample after the warm-up to the last one at least
    # 15 s before the job ended (its processes exiting would look like memory given back).
    end, warm = (samples[-1]["t"] if samples else 0), min(60.0, seconds / 5)
    steady = [s for s in samples if s["t"] >= warm and end - s["t"] >= 15 and s["rss"] > 0] or samples
    first, last = steady[0], steady[-1]
    summary_path = out / "run" / "summary.json"
    rec = (json.loads(summary_path.read_text()) if summary_path.exists() else {}).get("recovery") or {}
    kills = [f for f in rec.get("faults", []) if f["kind"] == "kill"]
    return {"seconds": elapsed, "faults": faults, "exit": proc.returncode, "hang": hung,
            "error": err.strip().splitlines()[-1] if proc.returncode else None,
            "rss_mb": (first["rss"] / 2**20, last["rss"] / 2**20), "rss_growth": last["rss"] / first["rss"] - 1,
            "threads": (first["threads"], last["threads"]), "fds": (first["fds"], last["fds"]),
            "kills_fired": len(kills),
            "stalls_fired": sum(f["kind"] == "stall" for f in rec.get("faults", [])),
            "replaced": sum(bool(f.get("replaced")) for f in kills), "restarts": rec.get("restarts"),
            "left_processes": left_procs, "left_namespaces": left_ns,
            # (every sample: seconds since the start, resident MiB, threads, open files)
            "series": [[round(s["t"], 1), round(s["rss"] / 2**20, 1), s["threads"], s["fds"]] for s in samples]}


def soak_table(s: dict) -> list[str]:
    """The soak's row (printed, not rendered on a page): its target is memory growth under 10%."""
    row = ["allreduce, 4 workers", f"{s['seconds'] / 60:.1f}", f"{s['kills_fired']} / {s['stalls_fired']}",
           s["replaced"], fmt(s["restarts"], "{}"),
           "hang" if s["hang"] else ("ok" if s["exit"] == 0 else f"exit {s['exit']}"),
           "{:.0f} -> {:.0f}".format(*s["rss_mb"]), f"{s['rss_growth']:+.1%}", "{} -> {}".format(*s["threads"]),
           "{} -> {}".format(*s["fds"]), f"{s['left_processes']} / {s['left_namespaces']}"]
    return markdown_table(["soak", "minutes", "faults (kills / stalls)", "replaced", "restarts", "ended",
                           "RSS first -> last (MiB)", "growth", "threads", "open files", "left behind"], [row])


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--runs", type=int, default=3, help="faulted runs per solver (the issue's figure: 20)")
    p.add_argument("--soak", type=float, default=120.0, help="seconds of the soak (the issue's figure: 1200)")
    p.add_argument("--solvers", help="comma-separated (default: every registered solver)")
    p.add_argument("--parts", default="faults,bad-input,soak", help="which parts to run (default: all three)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/faults", help="the runs' folders")
    p.add_argument("--json", help="the raw results (default: OUT/faults.json)")
    args = p.parse_args()
    started = provenance("benchmarks/faults.py")
    out, parts = Path(args.out), set(args.parts.split(","))
    path = args.json or out / "faults.json"
    results: dict = {"runs_per_solver": args.runs, "seed": args.seed, "parts": sorted(parts), "out": str(out)}
    out.mkdir(parents=True, exist_ok=True)
    regime = "; ".join(f"{k}: {v}" for k, v in REGIME.items() if k in parts and (k != "soak" or args.soak > 0))

    def save(announce: bool = False) -> None:  # after each part: a later part's failure keeps what was measured
        write_record(path, started, regime=regime, seeds=[args.seed], payload={**results, "repeats": args.runs},
                     announce=announce)
    if "faults" in parts:
        solvers = args.solvers.split(",") if args.solvers else solver_names()
        results["solvers"] = campaign(solvers, args.runs, random.Random(args.seed), out)
        save()
    if "bad-input" in parts:
        results["bad_input"] = bad_input(out / "bad-input")
        save()
    if "solvers" in results or "bad_input" in results:
        for text in render(json.loads(Path(path).read_text())).values():
            print(f"\n{text}")
    if "soak" in parts and args.soak > 0:
        results["soak"] = soak(args.soak, out / "soak")
        save()
        print("\n" + "\n".join(soak_table(results["soak"])), flush=True)
    save(announce=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
