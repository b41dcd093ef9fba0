"""An outside kill campaign: real ``kill -9`` from outside the job, against every solver.

    python benchmarks/kill_campaign.py [--runs 100] [--seed 0] [--solvers a,b] [--cases worker,server]
                                       [--steps 160] [--json PATH]

Its engine (:func:`run_job`, :func:`analyze`) is lagging_worker.py's too: a ``distsync
train`` watched from outside, a signal to processes found by their name, and what the run's
files say of it. Method, raw results and figures: docs/benchmarks/kill_campaign.md.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import suppress
from pathlib import Path
from typing import Any, Callable, Iterable

from common import argument_parser, provenance, write_record
from faults import leftovers, marked_processes, namespaces, run_env

from distsync import marks
from distsync.experiments.report import markdown_table
from distsync.metrics import processes
from distsync.metrics.repeats import spread
from distsync.runtime.recovery import read_jsonl
from distsync.solvers import Capability, Solver, make_solver, solver_class, solver_names
from distsync.solvers.schedules import bipartite_roles

DISTSYNC = [sys.executable, "-m", "distsync.cli"]
HANG_S = 120.0  # no end this long after the signal (or the launch): a hang
START_S = 90.0  # no step this long after the launch: the run is recorded as not signalled
TIMEOUT_S, STEPS, DEVICE_MS, CHECKPOINT_EVERY = 10, 160, 20.0, 20
CASES = ("worker", "adpsgd-passive", "two-workers", "server", "coordinator")
SHARE = {"worker": 35, "two-workers": 25, "server": 20, "adpsgd-passive": 10, "coordinator": 10}
SOLVER_OPTIONS = {"ripples": {"schedule": "smart"}}
REGIME = ("emulated devices (--device-ms: each step lasts a fixed device time, the real math inside it), "
          "loopback, on this machine's cores shared with other work")


# ---- the solvers ---------------------------------------------------------------------------------
def configured(solver: str) -> Solver:
    """The solver with the campaign's options (:data:`SOLVER_OPTIONS`)."""
    return make_solver(solver, **SOLVER_OPTIONS.get(solver, {}))


def has_passives(solver: str) -> bool:
    """Whether workers of its own let a dead worker's replacement in, no server doing it:
    AD-PSGD's passive workers (the odd ranks)."""
    return Capability.HEALS_BY_CHANNELS in solver_class(solver).capabilities and not configured(solver).roles


def applicable(case: str, solvers: list[str]) -> list[str]:
    if case not in CASES:
        raise SystemExit(f"unknown case {case!r}; cases: {', '.join(CASES)}")
    if case in ("server", "coordinator"):
        return [s for s in solvers if case in configured(s).roles]
    return [s for s in solvers if has_passives(s)] if case == "adpsgd-passive" else list(solvers)


def plan(runs: int, cases: list[str], solvers: list[str], rng: random.Random) -> list[dict]:
    """``runs`` kills shared among the cases by :data:`SHARE` (each case at least one while
    there are enough), each case's among its solvers in turn (in a drawn order)."""
    cells = {c: here for c in cases if (here := applicable(c, solvers))}
    if not cells:
        raise SystemExit("no case applies to these solvers")
    total = sum(SHARE[c] for c in cells)
    exact = {c: runs * SHARE[c] / total for c in cells}
    count = {c: max(int(exact[c]), 1 if runs >= len(cells) else 0) for c in cells}
    while sum(count.values()) > runs:  # (the minimum of one pushed the sum over)
        c = max(count, key=lambda c: count[c] - exact[c])
        count[c] -= 1
    for c in sorted(cells, key=lambda c: exact[c] - count[c], reverse=True)[:runs - sum(count.values())]:
        count[c] += 1
    specs = []
    for case, here in cells.items():
        order = list(here)
        rng.shuffle(order)
        restart_case = case in ("server", "coordinator")
        for i in range(count[case]):
            specs.append({"case": case, "solver": order[i % len(order)],
                          "workers": 4 if case == "two-workers" else 3,
                          # (a third of the worker kills heal: the second, fifth, ... of each case)
                          "max_restarts": 1 if restart_case or i % 3 == 1 else 0,
                          "checkpoint_every": CHECKPOINT_EVERY if restart_case else None})
    rng.shuffle(specs)
    return specs


def train_command(solver: str, workers: int, steps: int, out: Path, timeout_s: int = TIMEOUT_S,
                  max_restarts: int = 0, checkpoint_every: int | None = None) -> list[str]:
    options = [arg for k, v in SOLVER_OPTIONS.get(solver, {}).items() for arg in (f"--{k}", v)]
    cmd = [*DISTSYNC, "train", "--workload", "digits", "--solver", solver, *options,
           "--workers", str(workers), "--steps", str(steps), "--eval-every", str(steps), "--device-ms", f"{DEVICE_MS:g}",
           "--timeout", str(timeout_s), "--seed", "1", "--out", str(out)]
    return (cmd + (["--max-restarts", str(max_restarts)] if max_restarts else [])
            + (["--checkpoint-every", str(checkpoint_every)] if checkpoint_every else []))


# ---- processes -----------------------------------------------------------------------------------
def signal_quietly(pid: int, sig: int) -> bool:
    """``os.kill``: False where the process is gone (a negative ``pid``: a process group)."""
    try:
        os.kill(pid, sig)
        return True
    except OSError:
        return False


def tail_lines(text: str, n: int = 5) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()][-n:]


def error_line(lines: list[str]) -> str | None:
    """The line that says what went wrong: the last one naming an error, else the last."""
    named = [ln for ln in lines if re.search(r"error|failed|Error|Traceback|timed out|stalled", ln)] or lines
    return named[-1].strip() if named else None


# ---- one run, watched from outside ---------------------------------------------------------------
def run_job(cmd: list[str], out: Path, workers: int, hang_s: float = HANG_S, want: list[str] | None = None,
            sig: int = signal.SIGKILL, delay_s: float = 0.0, gap_s: float = 0.0,
            rng: random.Random | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Run ``cmd`` (a ``distsync train`` into ``out``) watched from outside: in a session of its
    own, with ``faults.py``'s mark in its environment, its stderr into a file beside ``out``. With ``want``
    (patterns of process names): once each of its ``workers`` has written a step to its
    journal, ``delay_s`` later, ``sig`` to the processes each pattern names, ``gap_s``
    between two patterns (:func:`send`). A run not ended ``hang_s`` after the signal (else the
    launch) is a hang: its process group is killed. Returns the run's record (what was
    signalled, when, and how the run ended) and its ``summary.json`` (None: none written)."""
    tag, ns = str(out), namespaces()
    rec: dict[str, Any] = {"command": " ".join(["distsync", *cmd[len(DISTSYNC):]])}
    t0 = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.stderr", "w") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, stdin=subprocess.DEVNULL,
                                env=run_env(tag), start_new_session=True)
    try:
        sent = send(proc, out, tag, workers, want, sig, delay_s, gap_s, rng, rec) if want else None
        proc.wait(timeout=max(0.0, (sent or t0) + hang_s - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # (a hang)
    finally:
        ended = proc.poll() is not None
        for target in rec.get("targets", []) if sig == signal.SIGSTOP else []:
            signal_quietly(target["pid"], signal.SIGCONT)  # (a stopped worker the run left behind: let it end)
        if not ended:  # (a hang, or Ctrl-C: the run's process group goes, stopped processes too)
            for s in (signal.SIGCONT, signal.SIGKILL):
                signal_quietly(-proc.pid, s)
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
    rec.update(hang=not ended, rc=proc.returncode if ended else None, seconds=time.monotonic() - t0)
    rec["left_processes"], rec["left_namespaces"] = leftovers(tag, ns, grace_s=5 if ended else 0)
    rec["stderr_tail"] = tail_lines(Path(f"{out}.stderr").read_text(errors="replace"))
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        summary = None
    rec["final_metric"] = (summary or {}).get("final_metric")
    rec["finished"] = rec["rc"] == 0 and rec["final_metric"] is not None
    if rec["rc"] != 0:
        rec["error"] = error_line(rec["stderr_tail"])
    return rec, summary


def send(proc: subprocess.Popen, out: Path, tag: str, workers: int, want: list[str], sig: int, delay_s: float,
         gap_s: float, rng: random.Random | None, rec: dict[str, Any]) -> float | None:
    """:func:`run_job`'s signal, recorded into ``rec`` (``not_killed``: why none was sent);
    of several names one pattern matches (a server shard of several), one drawn by ``rng``.
    Returns when (``time.monotonic``) the first was sent."""
    deadline = time.monotonic() + START_S
    while not all(journal_steps(out, r) is not None for r in range(workers)):  # (training: a step of each)
        if proc.poll() is not None or time.monotonic() > deadline:
            rec["not_killed"] = "ended before training" if proc.poll() is not None else f"no step in {START_S:g} s"
            return None
        time.sleep(0.05)
    deadline = time.monotonic() + delay_s
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    if proc.poll() is not None:
        rec["not_killed"] = "ended before the kill"
        return None
    # every target found first (by its name, /proc/PID/comm), then signalled: two within 20 ms
    running = [info for pid in marked_processes(tag) if (info := processes.named(pid))]
    found = [[i for i in running if re.fullmatch(p, i["comm"])] for p in want]
    targets, sent, first = [], [], None
    for n, infos in enumerate(f for f in found if f):
        names = sorted({i["comm"] for i in infos})
        if len(names) > 1:
            drawn = rng.choice(names)
            infos = [i for i in infos if i["comm"] == drawn]
        if n:
            time.sleep(gap_s)
        for info in infos:
            role, tail = info["comm"].split("-")[1], info["comm"].rsplit("-", 1)[-1]
            info.update(rank=int(tail) if tail.isdigit() else None, role="coordinator" if role == "coordi" else role)
            sent.append(time.time())
            info["killed"] = signal_quietly(info["pid"], sig)
            targets.append(info)
            first = first or time.monotonic()
    rec.update(targets=targets, kill_unix=sent, kill_gap_ms=(max(sent) - min(sent)) * 1000 if len(sent) > 1 else None,
               # the workers' steps at the kill (a restart's journals start again from its checkpoint)
               steps_at_kill={str(r): journal_steps(out, r) for r in range(workers)})
    if not any(t["killed"] for t in targets):
        rec["not_killed"] = f"no process named {' / '.join(want)} (of {len(marked_processes(tag))})"
    return first


# ---- what a run wrote ----------------------------------------------------------------------------
def journal_steps(out: Path, rank: int) -> int | None:
    """The last step number in worker ``rank``'s journal (None: no step yet)."""
    steps = [e["step"] for e in read_jsonl(out / "journal" / f"rank-{rank}.jsonl") if e.get("kind") == "step"]
    return steps[-1] if steps else None


def run_events(out: Path) -> list[dict[str, Any]]:
    """The run's events: ``events.jsonl`` when it wrote its results, else the journals."""
    if (out / "events.jsonl").exists():
        return read_jsonl(out / "events.jsonl")
    return [e for p in sorted((out / "journal").glob("rank-*.jsonl")) for e in read_jsonl(p)]


def step_ends(events: list[dict[str, Any]], rank: int) -> list[float]:
    """When (unix time) each of worker ``rank``'s steps ended (its first training thread's)."""
    return [e["unix"] for e in events if e.get("rank") == rank and e.get("kind") == "step"
            and e.get("thread", 0) == 0 and "unix" in e]


def steps_done(events: list[dict[str, Any]], workers: int) -> dict[int, int]:
    """The steps each worker did (each step once, however often it was done again)."""
    return {r: len({e["step"] for e in events if e.get("kind") == "step" and e.get("rank") == r})
            for r in range(workers)}


def stall_after(times: list[float], at: float, within_s: float = 2.0) -> dict[str, float | None]:
    """How long a worker with step ends ``times`` waited after an event at ``at``: its longest
    wait between two steps that ends after ``at`` and starts before ``at + within_s`` (counted
    from ``at`` for the wait that straddles it), minus its median step time (``stall_s``); and
    when it finished its first step after ``at`` (``first_step_after_s``)."""
    gaps = list(zip(times, times[1:]))
    after = [t for t in times if t > at]
    if len(gaps) < 2 or not after:
        return {"stall_s": None, "first_step_after_s": None}
    median = statistics.median(b - a for a, b in gaps)
    near = [b - max(a, at) for a, b in gaps if b > at and a < at + within_s]
    return {"stall_s": max(0.0, max(near) - median) if near else None, "first_step_after_s": min(after) - at}


def noise_floor(events: list[dict[str, Any]], workers: int) -> float | None:
    """A run without a kill: its workers' longest wait between two steps minus their median
    step time (the first 5 steps left out: start-up), the most over workers; what a stall of
    the same size in a killed run may owe to this machine rather than to the kill."""
    floors = [stall_after(times, times[0], within_s=math.inf)["stall_s"]
              for r in range(workers) if (times := step_ends(events, r)[5:])]
    return max((f for f in floors if f is not None), default=None)


def rank_failures(out: Path, spared: set[int]) -> list[dict[str, Any]]:
    """Ranks (not in ``spared``) whose process failed: a traceback or ``error.json`` in their
    log (any attempt), or a mark in ``RUN/dropped`` (a stalled worker, ...)."""
    found = []
    for d in sorted((out / "logs").glob("*/attempt_*/*")):
        if not d.is_dir() or not d.name.isdigit() or int(d.name) in spared:
            continue
        err = d / "stderr.log"
        text = err.read_text(errors="replace") if err.exists() else ""
        if "Traceback" in text or (d / "error.json").exists():
            found.append({"rank": int(d.name), "attempt": d.parent.name, "line": error_line(tail_lines(text, 20))})
    for m in marks.read_marks(out, marks.DROPPED):
        if m["rank"] not in spared:
            name = marks.mark_path(out, marks.DROPPED, m.get("attempt"), m["rank"]).name
            found.append({"rank": m["rank"], "attempt": m.get("attempt"), "line": f"dropped: {name} {m}"})
    return found


def analyze(rec: dict[str, Any], out: Path, summary: dict[str, Any] | None, solver: str, workers: int,
            steps: int) -> None:
    """What the files of a run that :func:`run_job` signalled say about the signal, into ``rec``."""
    summary, events = summary or {}, run_events(out)
    recovery = summary.get("recovery") or {}
    targets = [t for t in rec.get("targets", []) if t["killed"]]
    killed = {t["rank"] for t in targets if t["rank"] is not None}
    survivors = [r for r in range(workers) if r not in {t["rank"] for t in targets if t["role"] == "worker"}]
    rec["survivor_failures"] = rank_failures(out, killed)
    done = steps_done(events, workers)
    rec["survivors_steps_lost"] = sum(max(0, steps - done[r]) for r in survivors)
    back = {e["rank"]: e["step"] for e in events if e.get("kind") == "resume" and e.get("rank") in survivors}
    if back and rec.get("steps_at_kill"):
        at = rec["steps_at_kill"]
        rec["steps_done_again"] = sum(max(0, (at.get(str(r)) or -1) + 1 - step) for r, step in back.items())
    stats = {rank: st for rank, st in (summary.get("solver_stats") or {}).items() if isinstance(st, dict)}
    s = configured(solver)  # (its plan says what the servers should count)
    want = s.Plan.server_updates(s.options, list(done.values()), steps)
    counted = [st["updates"] for st in stats.values() if "updates" in st]
    if want is not None and counted:
        rec["updates_lost"] = max(want - c for c in counted)
    if not rec.get("kill_unix"):
        return
    kill = min(rec["kill_unix"])
    after = {str(r): stall_after(step_ends(events, r), kill) for r in survivors}
    rec["stall_s"] = max((a["stall_s"] for a in after.values() if a["stall_s"] is not None), default=None)
    rec["survivors_went_on_s"] = max((a["first_step_after_s"] for a in after.values()
                                      if a["first_step_after_s"] is not None), default=None)
    dropped = [m["unix"] - kill for m in marks.read_marks(out, marks.DROPPED) if m["rank"] in killed]
    rec.update(dropped=bool(dropped), dropped_after_s=min(dropped, default=None))
    # summary.json's own record of the kill
    roles = {t["role"] for t in targets}
    rows = [f for f in recovery.get("faults") or [] if f.get("kind") == "kill" and abs(f.get("unix", kill) - kill) < 5
            and (f.get("rank") in killed or f.get("role") in roles)]
    rec["recovery_rows"] = rows
    rec["recovery_filled"] = any(r.get(k) is not None for r in rows for k in ("went_on_s", "healed_s", "recovery_s"))
    rec["recovery_dropped"] = [d for d in (recovery.get("dropped") or []) + (recovery.get("replaced") or [])
                               if d.get("rank") in killed and d.get("unix", kill) >= kill - 1]
    # from the run's own events, whatever summary.json says: the survivors' new view, a
    # replacement's join, a restart's resumption
    views = [v["unix"] for v in recovery.get("views") or [] if v.get("unix", 0) >= kill
             and not killed & set(v.get("members", []))]
    joins = [e["unix"] for e in events if e.get("kind") == "joined" and e.get("rank") in killed and e["unix"] >= kill]
    resumes = [e["unix"] for e in events if e.get("kind") == "resume" and e.get("unix", 0) >= kill]
    for key, times in (("view_after_s", views), ("joined_after_s", joins), ("resumed_after_s", resumes)):
        if times:
            rec[key] = min(times) - kill
    # a server or coordinator replaced while the workers waited: what the solvers' stats say of it
    rec["replacement_stats"] = {rank: said for rank, st in stats.items()
                                if (said := {k: v for k, v in st.items() if "replac" in k and v})}
    # healed: a killed worker's replacement joined, or a killed server or coordinator was replaced
    # while the others went on (the workers count servers_replaced or coordinator_replaced)
    rec["healed"] = "joined_after_s" in rec or (any(t["role"] != "worker" for t in targets)
                                                and bool(rec["replacement_stats"]))


def recorded(run: Callable[[], dict[str, Any]], about: dict[str, Any]) -> dict[str, Any]:
    """``run()``'s record; an error of the harness itself recorded instead, so that the others go on."""
    try:
        return run()
    except Exception as e:
        return {**about, "finished": False, "harness_error": f"{type(e).__name__}: {e}"}


def why_not(r: dict[str, Any]) -> str:
    """Why a run was not killed, or did not finish, in its record's words."""
    return r.get("not_killed") or ("hang" if r.get("hang") else r.get("error") or r.get("harness_error") or "")


def outcome(r: dict[str, Any]) -> str:
    """How a run ended, in a few words (the progress lines)."""
    return "finished" if r.get("finished") else f"NOT finished: {why_not(r)}"


# ---- the campaign's runs -------------------------------------------------------------------------
def clean_run(solver: str, workers: int, steps: int, tmp: Path) -> dict[str, Any]:
    out = tmp / f"clean-{solver}-{workers}w"
    rec, summary = run_job(train_command(solver, workers, steps, out), out, workers,
                           hang_s=HANG_S + steps * DEVICE_MS / 1000 * 3)
    return {"solver": solver, "workers": workers, **rec, "wall_time_s": (summary or {}).get("wall_time_s"),
            "longest_wait_s": noise_floor(run_events(out), workers)}


def kill_run(i: int, spec: dict, clean: dict, steps: int, tmp: Path, rng: random.Random) -> dict[str, Any]:
    case, solver, workers = spec["case"], spec["solver"], spec["workers"]
    out = tmp / f"{i:03d}-{case}-{solver}"
    if case == "worker":
        want = [f"ds-worker-{rng.randrange(workers)}"]
    elif case == "adpsgd-passive":
        want = [f"ds-worker-{rng.choice(bipartite_roles(workers)[1])}"]
    elif case == "two-workers":
        want = [f"ds-worker-{r}" for r in rng.sample(range(workers), 2)]
    else:
        want = [r"ds-server-\d+" if case == "server" else r"ds-coordi\w*-\d+"]
    # when: a moment drawn in the first half of the clean run's training (two workers: 0-20 ms apart)
    train_s = clean.get("wall_time_s") or steps * DEVICE_MS / 1000 * 1.3
    delay_s, gap_s = rng.uniform(0.1, 0.5) * train_s, rng.uniform(0.0, 0.02)
    cmd = train_command(solver, workers, steps, out, max_restarts=spec["max_restarts"],
                        checkpoint_every=spec["checkpoint_every"])
    rec, summary = run_job(cmd, out, workers, want=want, delay_s=delay_s, gap_s=gap_s, rng=rng)
    rec = {"i": i, **spec, **rec, "clean_metric": clean.get("final_metric"),
           "clean_longest_wait_s": clean.get("longest_wait_s")}
    analyze(rec, out, summary, solver, workers, steps)
    return rec


# ---- tables --------------------------------------------------------------------------------------
HEAD = ["kills", "finished", "survivor crashes", "hangs", "survivors' stall (ms, median / max)",
        "clean run's longest wait (ms)", "survivors' steps lost", "done again", "updates lost (max)",
        "recovery row (present / with went_on, healed or recovery s)", "dropped listed",
        "replaced (of runs with --max-restarts 1)", "restarted", "accuracy (clean → killed)"]


def was_killed(r: dict[str, Any]) -> bool:
    return bool(r.get("kill_unix")) and not r.get("not_killed")


def count(runs: list[dict], key: str) -> int:
    return sum(bool(r.get(key)) for r in runs)


def accuracy(cleans: Iterable[float | None], metrics: Iterable[float | None]) -> str | None:
    """``CLEAN → KILLED``: the mean final accuracy of runs without a kill and of runs with one
    (None: either is missing)."""
    cleans, metrics = [c for c in cleans if c is not None], [m for m in metrics if m is not None]
    return f"{statistics.mean(cleans):.3f} → {statistics.mean(metrics):.3f}" if cleans and metrics else None


def summary_row(runs: list[dict]) -> list[Any]:
    """``runs`` summed into a row of :data:`HEAD`."""
    killed = [r for r in runs if was_killed(r)]
    heal = [r for r in killed if r.get("max_restarts")]
    stalls = spread(r.get("stall_s") for r in killed)
    floor = spread(r.get("clean_longest_wait_s") for r in runs)
    return [len(killed), count(killed, "finished"), count(killed, "survivor_failures"), count(runs, "hang"),
            f"{stalls[0] * 1000:.0f} / {stalls[2] * 1000:.0f}" if stalls else "-",
            f"{floor[2] * 1000:.0f}" if floor else "-",
            sum(r.get("survivors_steps_lost") or 0 for r in killed),
            sum(r.get("steps_done_again") or 0 for r in killed),
            max((r["updates_lost"] for r in killed if r.get("updates_lost") is not None), default="-"),
            f"{count(killed, 'recovery_rows')} / {count(killed, 'recovery_filled')}", count(killed, "recovery_dropped"),
            f"{count(heal, 'healed')} / {len(heal)}" if heal else "-",
            sum(r.get("resumed_after_s") is not None for r in killed),
            accuracy((r.get("clean_metric") for r in killed), (r.get("final_metric") for r in killed)) or "-"]


def no_tmp(text: str | None) -> str:
    """``text`` with a run folder of these scripts' temporary folders written ``RUN``."""
    return re.sub(r"/[^\s;:()'\"]*/(kill_campaign|lagging_worker)-[^/\s]+/[^/\s;:()'\"]+", "RUN", text or "")


def provenance_line(raw: dict[str, Any]) -> str:
    """Where a raw file's figures come from: command, commit (and a working tree that
    differed), machine, seed, date."""
    changed, machine = raw.get("changed_files") or [], raw.get("machine") or {}
    differed = f" (the working tree differed in {len(changed)} files, {sum('src/' in f for f in changed)} under src/)"
    return (f"`{raw.get('command', '?')}` at commit {str(raw.get('commit'))[:10]}"
            + (differed if raw.get("dirty") else "") + f", {machine.get('cpu_count')} cores, torch {machine.get('torch')}, seed {raw.get('seed')}, "
            f"{raw.get('date') or raw.get('when', '')}")


def render(raw: dict[str, Any]) -> dict[str, str]:
    """The page's block ``kill_campaign``: a row per case (and all), the solvers killed in each
    case, the second kill's delay, and every run that did not finish, crashed a survivor, hung
    or was not killed."""
    runs = raw.get("runs", [])
    lines = [provenance_line(raw) + f"; {len(runs)} kills and {len(raw.get('clean', []))} clean runs in "
             f"{raw.get('seconds', 0) / 60:.1f} min ({raw.get('per_kill_s', 0):.1f} s a kill, all included)"
             + ("; **partial: the campaign did not end**" if raw.get("partial") else "") + ".", "",
             f"Regime: {raw.get('regime', REGIME)}. Each row sums its case's kills (at least "
             f"{raw.get('repeats', '?')} per case); stalls are the median and the worst over the kills.", ""]
    cases = [c for c in CASES if any(r["case"] == c for r in runs)]
    lines += markdown_table(["case", *HEAD], [[c, *summary_row([r for r in runs if r["case"] == c])] for c in cases]
                            + [["**all**", *summary_row(runs)]])
    lines += ["", "Solvers killed, per case (kills):", ""]
    for case in cases:
        killed = Counter(r["solver"] for r in runs if r["case"] == case)
        lines.append(f"- {case}: " + ", ".join(f"`{s}` {n}" for s, n in sorted(killed.items())))
    gaps = [r["kill_gap_ms"] for r in runs if r.get("kill_gap_ms") is not None]
    if gaps:
        lines += ["", f"Two workers at once: the second kill came {statistics.median(gaps):.0f} ms (median) / "
                      f"{max(gaps):.0f} ms (max) after the first."]
    bad = [r for r in runs if r.get("not_killed") or not r.get("finished") or r.get("survivor_failures") or r.get("hang")]
    if bad:
        lines += ["", "Runs that did not finish, crashed a survivor, hung or were not killed:", ""]
        for r in bad:
            what = ", ".join(t["comm"] for t in r.get("targets", [])) or "-"
            crash = "; ".join(f"rank {f['rank']} ({f['attempt']}): {f['line']}" for f in r.get("survivor_failures", []))
            lines.append(f"- {r['case']} {r['solver']} (kill {what}{', max-restarts 1' if r.get('max_restarts') else ''}): "
                         f"exit {r.get('rc')}; `{no_tmp(why_not(r))[:300]}`"
                         + (f"; survivors: `{no_tmp(crash)[:400]}`" if crash else ""))
    clean_bad = [f"- {c['solver']} ({c['workers']} workers): exit {c.get('rc')}; `{no_tmp(c.get('error'))}`"
                 for c in raw.get("clean", []) if c.get("rc") != 0]
    if clean_bad:
        lines += ["", "Clean runs (no kill) that failed:", "", *clean_bad]
    return {"kill_campaign": "\n".join(lines)}


# ---- the campaign --------------------------------------------------------------------------------
def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--runs", type=int, default=100, help="kills in all (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--solvers", help="comma-separated (default: every registered solver)")
    p.add_argument("--cases", help=f"comma-separated, of {', '.join(CASES)} (default: all)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"steps per worker (default {STEPS}: about 4 s)")
    p.add_argument("--json", default="benchmarks/results/kill_campaign.json",
                   help="the raw results (written after every run; default: benchmarks/results/kill_campaign.json)")
    args = p.parse_args()
    started = provenance("benchmarks/kill_campaign.py")
    rng = random.Random(args.seed)
    specs = plan(args.runs, args.cases.split(",") if args.cases else list(CASES),
                 args.solvers.split(",") if args.solvers else solver_names(), rng)
    settings = {"steps": args.steps, "device_ms": DEVICE_MS, "timeout_s": TIMEOUT_S, "hang_s": HANG_S,
                "checkpoint_every": CHECKPOINT_EVERY, "workload": "digits", "seed_of_runs": 1}
    payload: dict[str, Any] = {"seed": args.seed, "settings": settings, "clean": [], "runs": []}
    t0 = time.monotonic()

    def save(partial: bool) -> None:  # (after each run: an abort keeps what was measured)
        per_case = Counter(r["case"] for r in payload["runs"] if was_killed(r))
        payload.update(seconds=time.monotonic() - t0, per_kill_s=(time.monotonic() - t0) / max(1, len(payload["runs"])),
                       partial=partial, kills_per_case=per_case, repeats=min(per_case.values(), default=0))
        write_record(args.json, started, regime=REGIME, seeds=[args.seed], payload=payload, announce=not partial)
    cleans: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory(prefix="kill_campaign-") as tmp:
        for i, spec in enumerate(specs):
            key = (spec["solver"], spec["workers"])
            if key not in cleans:
                cleans[key] = clean_run(*key, args.steps, Path(tmp))
                payload["clean"].append(cleans[key])
                print(f"  clean {key[0]} ({key[1]} workers): {outcome(cleans[key])}", flush=True)
            r = recorded(lambda: kill_run(i, spec, cleans[key], args.steps, Path(tmp), rng), {"i": i, **spec})
            payload["runs"].append(r)
            print(f"[{i + 1}/{len(specs)} {time.monotonic() - t0:.0f} s] {spec['case']} {spec['solver']}: killed "
                  f"{','.join(t['comm'] for t in r.get('targets', [])) or '-'}; {outcome(r)}", flush=True)
            save(partial=True)
    save(partial=False)
    print()
    print(render(json.loads(Path(args.json).read_text()))["kill_campaign"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
