"""Fault injection across every solver, bad input, and a soak with a fault every minute.

    python benchmarks/faults.py [--runs 20] [--soak 1200] [--parts faults,bad-input,soak] [--seed 0]
                                [--out benchmarks/results/faults] [--json PATH]

Method, raw results and figures: docs/benchmarks/faults.md.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import argument_parser, print_checks, provenance, table_header, table_row, write_record

from distsync.experiments.report import markdown_table
from distsync.metrics.processes import tree_usage, with_environ
from distsync.solvers import make_solver, solver_names

REPO = Path(__file__).resolve().parents[1]
DISTSYNC = [sys.executable, "-m", "distsync.cli"]
STEPS, EVERY = 120, 20


def random_fault(solver: str, rng: random.Random) -> str:
    roles = make_solver(solver).roles
    step = rng.randint(EVERY + 5, STEPS - 10)
    kinds = ["kill-worker", "stall", "nan"] + (["kill-role"] if roles else [])
    kind = rng.choice(kinds)
    if kind == "kill-worker":
        return f"kill:{rng.randint(0, 1)}@{step}"
    if kind == "stall":
        return f"stall:{rng.randint(0, 1)}@{step}:{rng.uniform(0.2, 2.0):.2f}"
    if kind == "nan":
        return f"nan:{rng.randint(0, 1)}@{step}"
    return f"kill:{'server' if 'server' in roles else 'coordinator'}@{step}"



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
    return {line.split()[0] for line in out.splitlines() if line.startswith("ds")}


def leftovers(tag: str, before_ns: set[str], grace_s: float = 5.0) -> tuple[int, int]:
    """Processes of run ``tag`` still there ``grace_s`` after its command returned, and network
    namespaces that appeared since ``before_ns``; the processes are then killed (so that one
    run's leftovers do not count for the next)."""
    deadline = time.monotonic() + grace_s
    while True:
        left = marked_processes(tag)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return len(left), len(namespaces() - before_ns)


# ---- (1) one fault per run ------------------------------------------------------------------------
def one_run(solver: str, fault: str, out: Path) -> dict:
    args = DISTSYNC + ["train", "--overwrite", "--solver", solver, "--workers", "2", "--steps", str(STEPS), "--eval-every", "40",
                       "--checkpoint-every", str(EVERY), "--max-restarts", "2", "--timeout", "10",
                       "--fault", fault, "--out", str(out)]
    if solver in ("hogwild",):
        args += ["--threads", "2"]
    tag, ns = str(out), namespaces()
    t0 = time.monotonic()
    try:
        proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120, env=run_env(tag))
    except subprocess.TimeoutExpired:
        procs, nss = leftovers(tag, ns, grace_s=0)
        return {"fault": fault, "finished": False, "as_designed": False, "hang": True, "left_processes": procs,
                "left_namespaces": nss}
    row = {"fault": fault, "finished": proc.returncode == 0, "hang": False, "seconds": time.monotonic() - t0}
    row["left_processes"], row["left_namespaces"] = leftovers(tag, ns)
    err = proc.stderr.strip()
    if proc.returncode != 0:
        row["error"] = err.splitlines()[-1] if err else f"exit {proc.returncode}"
        # A NaN loss stops the run by design, with one line naming it (and no traceback).
        row["as_designed"] = (fault.startswith("nan:") and "loss is nan" in row["error"] and "Traceback" not in err)
        return row
    row["as_designed"] = not fault.startswith("nan:")
    summary = json.loads((out / "summary.json").read_text())
    fired = summary["recovery"]["faults"]
    # (a dropped worker's survivors lose no step: they never stopped)
    row["steps_lost"] = [f["steps_lost"] if "steps_lost" in f else 0 for f in fired
                         if "steps_lost" in f or f.get("dropped")]
    row["restarts"] = summary["recovery"].get("restarts", 0)
    # (a restart's time to train again, or the time the others took to go on without the dead one)
    row["recovery_s"] = [f.get("recovery_s", f.get("went_on_s")) for f in fired
                         if "recovery_s" in f or "went_on_s" in f]
    row["dropped"] = len(summary["recovery"]["dropped"])
    row["lost_updates"] = lost_updates(solver, summary)
    return row


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
    if want is None:
        return None
    stats = [st for st in summary["solver_stats"].values() if "updates" in st]
    if not stats:
        return None
    return max(max(0, abs(want - st["updates"]) - int(st.get("versions_lost_at_most") or 0)) for st in stats)


def fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def fault_kinds(rows: list[dict]) -> list[str]:
    """The kinds of fault drawn: kill, kill:server, nan, stall ..."""
    out = set()
    for r in rows:
        kind, rest = r["fault"].split(":", 1)
        target = rest.split("@")[0]
        out.add(kind + ("" if target.isdigit() else ":" + target))
    return sorted(out)


def campaign(solvers: list[str], runs: int, rng: random.Random, out: Path) -> list[dict]:
    table = []
    for solver in solvers:
        rows = [one_run(solver, random_fault(solver, rng), out / solver / f"run{i}") for i in range(runs)]
        lost = [x for r in rows for x in r.get("steps_lost", [])]
        recovery = [x for r in rows for x in r.get("recovery_s", []) if x is not None]
        updates = [r["lost_updates"] for r in rows if r.get("lost_updates") is not None]
        line = {"solver": solver, "runs": rows, "finished": sum(r["finished"] for r in rows),
                "as_designed": sum(r["as_designed"] for r in rows), "hangs": sum(r["hang"] for r in rows),
                "median_steps_lost": statistics.median(lost) if lost else None, "max_steps_lost": max(lost, default=None),
                "max_recovery_s": max(recovery) if recovery else None, "lost_updates": max(updates) if updates else None,
                "dropped": sum(r.get("dropped", 0) for r in rows), "restarts": sum(r.get("restarts", 0) for r in rows),
                "left_processes": sum(r["left_processes"] for r in rows),
                "left_namespaces": sum(r["left_namespaces"] for r in rows)}
        table.append(line)
        print(f"{solver}: {line['as_designed']} of {len(rows)} as designed, {line['hangs']} hangs "
              f"({', '.join(r['fault'] for r in rows)})", flush=True)
        for r in rows:
            if not r["as_designed"]:
                print(f"  {solver} {r['fault']}: {r.get('error', 'hang')}", flush=True)
    return table


REGIME = {"faults": "CPU-bound real run (digits, 2 workers, loopback) on this machine's cores",
          "bad-input": "CPU-bound real runs (digits, 2 workers)",
          "soak": "emulated devices (allreduce, 4 workers, --device-ms), loopback"}


def _no_tmp(text: str, raw: dict) -> str:
    """``text`` with the run's output folder written ``RUN`` (and a table's ``|`` escaped)."""
    out = raw.get("out")
    if out:
        text = text.replace(str(Path(out).resolve()), "RUN").replace(str(out), "RUN")
    return text.replace("|", "\\|")


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
            lost = [v for r in x["runs"] for v in r.get("steps_lost", [])]
            rows.append([f"`{x['solver']}`", len(x["runs"]), x["as_designed"], x["dropped"], x["restarts"],
                         "-" if not lost else f"{statistics.median(lost):g} / {max(lost)}",
                         fmt(x["max_recovery_s"], "{:.2f}"), x["hangs"], fmt(x["lost_updates"], "{}"),
                         f"{x['left_processes']} / {x['left_namespaces']}", ", ".join(fault_kinds(x["runs"]))])
        runs = [r for x in t for r in x["runs"]]
        kinds: dict[str, int] = {}
        for r in runs:
            kind, rest = r["fault"].split(":", 1)
            target = rest.split("@")[0]
            label = ({"stall": "stalls", "nan": "NaN losses"}.get(kind)
                     or ("worker kills" if target.isdigit() else f"{target} kills"))
            kinds[label] = kinds.get(label, 0) + 1
        went_on = [g for x in t for r in x["runs"] if r.get("dropped") for g in r.get("recovery_s", []) if g is not None]
        lines = [head, "", f"Regime: {REGIME['faults']}. {raw.get('runs_per_solver')} runs per solver, one fault "
                 f"each, drawn with seed {raw.get('seed')}.", ""]
        lines += markdown_table(["solver", "faults injected", "ended as designed", "workers dropped", "restarts",
                      "steps lost (median / max)", "max recovery (s)", "hangs", "lost updates",
                      "left behind (processes / namespaces)", "fault kinds drawn"], rows)
        lines += ["", f"Totals: {len(runs)} runs ("
                  + ", ".join(f"{n} {k}" for k, n in kinds.items()) + f"), {sum(x['as_designed'] for x in t)} ended "
                  f"as designed, {sum(x['hangs'] for x in t)} hangs, {sum(x['dropped'] for x in t)} workers dropped, "
                  f"{sum(x['restarts'] for x in t)} restarts, lost updates at most "
                  f"{max((x['lost_updates'] or 0) for x in t)}, {sum(x['left_processes'] for x in t)} processes and "
                  f"{sum(x['left_namespaces'] for x in t)} namespaces left behind; going on without a dead worker: "
                  + (f"{max(went_on):.3f} s at most over {len(went_on)} drops." if went_on else "no drop timed.")]
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

class Poison(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.lin(x) * float("nan")

def make_workload():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 8, generator=g)
    y = (x[:, 0] > 0).long()
    return Workload(name="poison", make_model=Poison, train_data=(x, y), eval_data=(x, y), target=0.9,
                    batch_size=16, steps=20, eval_every=10)
"""


def _cli(*args: str, timeout: float = 90) -> tuple[int | None, str, float]:
    t0 = time.monotonic()
    try:
        proc = subprocess.run(DISTSYNC + list(args), cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, "", time.monotonic() - t0
    return proc.returncode, proc.stderr, time.monotonic() - t0


def _crashed_run(run: Path, seed: int = 0) -> None:
    """A run that died after its checkpoints 1 and 2 (steps 20 and 40)."""
    code, err, _ = _cli("train", "--overwrite", "--workers", "2", "--steps", "60", "--seed", str(seed), "--checkpoint-every", "20",
                        "--on-failure", "restart", "--max-restarts", "0", "--fault", "kill:1@50", "--out", str(run))
    if code == 0 or not (run / "checkpoints" / "ckpt-000002").exists():
        raise SystemExit(f"the crashed run to resume did not crash as planned: {err.strip()[-300:]}")


def _newest_data(run: Path) -> Path:
    return sorted((run / "checkpoints" / "ckpt-000002").glob("rank-1*.pt"))[0]


def bad_input(out: Path) -> list[dict]:
    """Each case: a command that must refuse the input in one line (or refuse it, log it and
    go on), lose nothing and not hang."""
    out.mkdir(parents=True, exist_ok=True)
    cases = []

    def resume_case(name: str, spoil) -> None:
        run = out / name
        _crashed_run(run)
        spoil(run)
        code, err, secs = _cli("train", "--resume", str(run))
        s = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
        resumed = ((s.get("recovery") or {}).get("resumed_from_steps") or [None])[-1]
        cases.append({"case": name, "exit": code, "seconds": secs, "stderr": err.strip().splitlines()[-3:],
                      "skipped_line": next((ln for ln in err.splitlines() if "skipped" in ln), None),
                      "resumed_from_step": resumed,
                      "ok": code == 0 and resumed == 20 and "Traceback" not in err and s.get("steps_per_worker") == 60
                      and "skipped checkpoint ckpt-000002" in err})

    def corrupt(run: Path) -> None:
        data = _newest_data(run)
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))

    def truncate(run: Path) -> None:
        data = _newest_data(run)
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])

    def foreign(run: Path) -> None:  # checkpoint 2 comes from a job with another model seed
        other = out / "other-job"
        _crashed_run(other, seed=7)
        import shutil

        shutil.rmtree(run / "checkpoints" / "ckpt-000002")
        shutil.copytree(other / "checkpoints" / "ckpt-000002", run / "checkpoints" / "ckpt-000002")

    resume_case("corrupt checkpoint", corrupt)
    resume_case("truncated checkpoint", truncate)
    resume_case("another job's checkpoint", foreign)

    def one_line_case(name: str, *args: str, want: str) -> None:
        code, err, secs = _cli(*args)
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        cases.append({"case": name, "exit": code, "seconds": secs, "stderr": lines[-3:],
                      "ok": code not in (0, None) and len(lines) == 1 and "Traceback" not in err and want in err})

    def config_case(name: str, change: dict, want: str) -> None:
        run = out / name.replace(" ", "-")
        _crashed_run(run)
        cfg = json.loads((run / "config.json").read_text())
        cfg.update(change)
        (run / "config.json").write_text(json.dumps(cfg))
        one_line_case(name, "train", "--resume", str(run), want=want)

    config_case("config: a wrong type", {"workers": "two"}, "config field workers must be an integer")
    config_case("config: an unknown key", {"wrokers": 2}, "unknown config field(s): wrokers")
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
def sample(pid: int) -> dict:
    return {"t": time.monotonic(), **tree_usage(pid)}


def soak(seconds: float, out: Path, device_ms: float = 30.0) -> dict:
    """``allreduce``, 4 workers on emulated devices, healing from live peers, a fault a minute."""
    base = ["train", "--overwrite", "--solver", "allreduce", "--workers", "4", "--device-ms", f"{device_ms:g}",
            "--timeout", "10"]
    probe = out / "probe"
    code, err, _ = _cli(*base, "--steps", "300", "--eval-every", "300", "--out", str(probe))
    if code != 0:
        raise SystemExit(f"the soak's probe run failed: {err.strip()[-300:]}")
    probed = json.loads((probe / "summary.json").read_text())
    rate = probed["steps_per_worker"] / probed["wall_time_s"]
    steps = int(rate * seconds)
    faults = []
    for minute in range(1, int(seconds // 60)):
        rank, step = (minute - 1) // 2 % 4, int(rate * 60 * minute)
        faults.append(f"kill:{rank}@{step}" if minute % 2 else f"stall:{rank}@{step}:2")
    args = base + ["--steps", str(steps), "--eval-every", str(max(1, steps // 20)),
                   "--max-restarts", str(len(faults)), "--out", str(out / "run")]
    for f in faults:
        args += ["--fault", f]
    tag, ns = str(out / "run"), namespaces()
    proc = subprocess.Popen(DISTSYNC + args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=run_env(tag))
    samples, start = [], time.monotonic()
    warm = min(60.0, seconds / 5)
    try:
        while proc.poll() is None and time.monotonic() - start < seconds * 2 + 120:
            time.sleep(5)
            samples.append(sample(proc.pid))
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
    end = samples[-1]["t"] if samples else start
    steady = [s for s in samples if s["t"] - start >= warm and end - s["t"] >= 15 and s["rss"] > 0] or samples
    first, last = steady[0], steady[-1]
    summary_path = out / "run" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    rec = summary.get("recovery") or {}
    fired = rec.get("faults", [])
    kills = [f for f in fired if f["kind"] == "kill"]
    return {"solver": "allreduce", "workers": 4, "device_ms": device_ms, "seconds": elapsed, "planned_seconds": seconds,
            "faults": faults,
            "exit": proc.returncode, "hang": hung, "error": err.strip().splitlines()[-1] if proc.returncode else None,
            "samples": len(samples), "rss_first_mb": first["rss"] / 2**20, "rss_last_mb": last["rss"] / 2**20,
            "rss_growth": last["rss"] / first["rss"] - 1, "threads": (first["threads"], last["threads"]),
            "fds": (first["fds"], last["fds"]), "kills_fired": len(kills),
            "stalls_fired": sum(f["kind"] == "stall" for f in fired),
            "replaced": sum(bool(f.get("replaced")) for f in kills), "restarts": rec.get("restarts"),
            "went_on_s_max": max((f["went_on_s"] for f in kills if "went_on_s" in f), default=None),
            "healed_s_max": max((f["healed_s"] for f in kills if f.get("healed_s") is not None), default=None),
            "survivor_steps_lost": sum(f.get("steps_lost") or 0 for f in kills),
            "final_metric": summary.get("final_metric"), "steps_per_worker": summary.get("steps_per_worker"),
            "left_processes": left_procs, "left_namespaces": left_ns,
            # (every sample: seconds since the start, resident MiB, threads, open files)
            "series": [[round(s["t"] - start, 1), round(s["rss"] / 2**20, 1), s["threads"], s["fds"]] for s in samples]}


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--runs", type=int, default=3, help="faulted runs per solver (the issue's figure: 20)")
    p.add_argument("--soak", type=float, default=120.0, help="seconds of the soak (the issue's figure: 1200)")
    p.add_argument("--soak-device-ms", type=float, default=30.0, help="the soak's emulated step time (default 30)")
    p.add_argument("--solvers", help="comma-separated (default: every registered solver)")
    p.add_argument("--parts", default="faults,bad-input,soak", help="which parts to run (default: all three)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/faults", help="the runs' folders")
    p.add_argument("--json", help="the raw results (default: OUT/faults.json)")
    args = p.parse_args()
    started = provenance("benchmarks/faults.py")
    out = Path(args.out)
    parts = set(args.parts.split(","))
    rng = random.Random(args.seed)
    solvers = args.solvers.split(",") if args.solvers else solver_names()
    results: dict = {"runs_per_solver": args.runs, "seed": args.seed, "parts": sorted(parts), "out": str(out)}
    out.mkdir(parents=True, exist_ok=True)
    regime = "; ".join(f"{k}: {v}" for k, v in REGIME.items() if k in parts and (k != "soak" or args.soak > 0))

    def save(announce: bool = False) -> None:  # after each part: a later part's failure keeps what was measured
        write_record(args.json or out / "faults.json", started, regime=regime, seeds=[args.seed],
                     payload={**results, "repeats": args.runs}, announce=announce)
    if "faults" in parts:
        results["solvers"] = campaign(solvers, args.runs, rng, out)
        save()
    if "bad-input" in parts:
        print()
        results["bad_input"] = bad_input(out / "bad-input")
        save()
    if "faults" in parts or "bad-input" in parts:
        for text in render(json.loads(Path(args.json or out / "faults.json").read_text())).values():
            print()
            print(text)
    if "soak" in parts and args.soak > 0:
        print()
        s = soak(args.soak, out / "soak", args.soak_device_ms)
        results["soak"] = s
        save()
        table_header(["soak", "minutes", "faults (kills / stalls)", "replaced", "restarts", "ended",
                      "RSS first -> last (MiB)", "growth", "threads", "open files", "left behind"])
        table_row([f"{s['solver']}, {s['workers']} workers", f"{s['seconds'] / 60:.1f}",
                   f"{s['kills_fired']} / {s['stalls_fired']}", s["replaced"], fmt(s["restarts"], "{}"),
                   "hang" if s["hang"] else ("ok" if s["exit"] == 0 else f"exit {s['exit']}"),
                   f"{s['rss_first_mb']:.0f} -> {s['rss_last_mb']:.0f}", f"{s['rss_growth']:+.1%}",
                   f"{s['threads'][0]} -> {s['threads'][1]}", f"{s['fds'][0]} -> {s['fds'][1]}",
                   f"{s['left_processes']} / {s['left_namespaces']}"], flush=True)
    checks = []
    if "solvers" in results:
        t = results["solvers"]
        checks += [(f"hangs: {sum(x['hangs'] for x in t)} (target 0)", sum(x["hangs"] for x in t) == 0),
                   (f"lost updates: max {max((x['lost_updates'] or 0) for x in t)} (target 0)",
                    all(not x["lost_updates"] for x in t)),
                   (f"left behind: {sum(x['left_processes'] for x in t)} processes, "
                    f"{sum(x['left_namespaces'] for x in t)} namespaces (target 0)",
                    sum(x["left_processes"] + x["left_namespaces"] for x in t) == 0)]
        went_on = [g for x in t for r in x["runs"] if r.get("dropped") for g in r.get("recovery_s", []) if g is not None]
        checks.append((f"going on without a dead worker: max {max(went_on, default=0):.3f} s (target < 1 s)",
                       max(went_on, default=0) < 1))
    if "bad_input" in results:
        n = sum(c["ok"] for c in results["bad_input"])
        checks.append((f"bad input handled: {n} of {len(results['bad_input'])}", n == len(results["bad_input"])))
    if "soak" in results:
        s = results["soak"]
        checks.append((f"soak memory growth {s['rss_growth']:+.1%} (target < 10%)", s["rss_growth"] < 0.10))
        checks.append(("soak: no hang, ended cleanly", not s["hang"] and s["exit"] == 0))
    print()
    print_checks(checks)
    results["checks"] = [{"check": text, "met": ok} for text, ok in checks]
    save(announce=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
