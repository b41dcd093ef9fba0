"""An outside kill campaign: real ``kill -9`` from outside the job, against every solver.

    python benchmarks/kill_campaign.py [--runs 100] [--seed 0] [--solvers a,b] [--cases worker,server]
                                       [--json PATH]

Method, raw results and figures: docs/benchmarks/kill_campaign.md.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

from common import argument_parser, provenance, write_record

from distsync.experiments.report import markdown_table
from faults import leftovers, marked_processes, namespaces, run_env

from distsync import marks
from distsync.metrics.processes import named as proc_named
from distsync.runtime.recovery import read_jsonl

REPO = Path(__file__).resolve().parents[1]
DISTSYNC = [sys.executable, "-m", "distsync.cli"]
HANG_S = 120.0  # no end this long after the kill: a hang (--hang-s)
START_S = 90.0  # no step this long after the launch: the run is recorded as not started
TIMEOUT_S = 10
STEPS = 160
CHECKPOINT_EVERY = 20
CASES = ("worker", "adpsgd-passive", "two-workers", "server", "coordinator")
SHARE = {"worker": 35, "two-workers": 25, "server": 20, "adpsgd-passive": 10, "coordinator": 10}
SOLVER_ARGS = {"ripples": ["--schedule", "smart"]}


# ---- the solvers ---------------------------------------------------------------------------------
def all_solvers() -> list[str]:
    from distsync.solvers import solver_names

    return list(solver_names())


def roles(solver: str) -> tuple[str, ...]:
    """The extra processes the solver runs with the campaign's options (a server, a coordinator)."""
    from distsync.solvers import make_solver

    args = SOLVER_ARGS.get(solver, [])
    return tuple(make_solver(solver, **{k.lstrip("-"): v for k, v in zip(args[::2], args[1::2])}).roles)


def passive_ranks(workers: int) -> list[int]:
    """AD-PSGD's passive workers."""
    from distsync.solvers.schedules import bipartite_roles

    return list(bipartite_roles(workers)[1])


def expected_updates(solver: str, steps_done: list[int], steps: int) -> int | None:
    """The updates the servers should count, given each worker's steps (the solver's plan says:
    ``Plan.server_updates``; None: no servers, or exchanges that follow time)."""
    from distsync.solvers import make_solver

    s = make_solver(solver)
    return s.Plan.server_updates(s.options, steps_done, steps)


def applicable(case: str, solvers: list[str]) -> list[str]:
    if case in ("worker", "two-workers"):
        return list(solvers)
    if case in ("server", "coordinator"):
        return [s for s in solvers if case in roles(s)]
    if case == "adpsgd-passive":
        return [s for s in solvers if s == "ad-psgd"]
    raise SystemExit(f"unknown case {case!r}; cases: {', '.join(CASES)}")


def plan(runs: int, cases: list[str], solvers: list[str], rng: random.Random) -> list[dict]:
    """``runs`` kills shared among the cases by :data:`SHARE` (each case at least one while
    there are enough), each case's among its solvers in turn (in a drawn order)."""
    cells = {c: applicable(c, solvers) for c in cases}
    cells = {c: s for c, s in cells.items() if s}
    if not cells:
        raise SystemExit("no case applies to these solvers")
    total = sum(SHARE[c] for c in cells)
    exact = {c: runs * SHARE[c] / total for c in cells}
    count = {c: int(exact[c]) for c in cells}
    if runs >= len(cells):
        for c in cells:
            count[c] = max(1, count[c])
    while sum(count.values()) > runs:  # (the minimum of one pushed the sum over)
        c = max(count, key=lambda c: count[c] - exact[c])
        count[c] -= 1
    for c in sorted(cells, key=lambda c: exact[c] - count[c], reverse=True):
        if sum(count.values()) >= runs:
            break
        count[c] += 1
    specs = []
    for case, solvers_here in cells.items():
        order = list(solvers_here)
        rng.shuffle(order)
        for i in range(count[case]):
            restart_case = case in ("server", "coordinator")
            specs.append({"case": case, "solver": order[i % len(order)],
                          "workers": 4 if case == "two-workers" else 3,
                          # (a third of the worker kills heal: the second, fifth, ... of each case)
                          "max_restarts": 1 if restart_case or i % 3 == 1 else 0,
                          "checkpoint_every": CHECKPOINT_EVERY if restart_case else None})
    rng.shuffle(specs)
    return specs


def train_command(solver: str, workers: int, steps: int, device_ms: float, out: Path, max_restarts: int = 0,
                  checkpoint_every: int | None = None) -> list[str]:
    cmd = [*DISTSYNC, "train", "--workload", "digits", "--solver", solver, *SOLVER_ARGS.get(solver, []),
           "--workers", str(workers), "--steps", str(steps), "--eval-every", str(steps), "--device-ms", f"{device_ms:g}",
           "--timeout", str(TIMEOUT_S), "--seed", "1", "--out", str(out)]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    if checkpoint_every:
        cmd += ["--checkpoint-every", str(checkpoint_every)]
    return cmd


def shown(cmd: list[str]) -> str:
    """A command as a user would type it (``distsync ...``)."""
    return " ".join(["distsync", *cmd[len(DISTSYNC):]])


# ---- processes -----------------------------------------------------------------------------------

def named(tag: str, pattern: str) -> list[dict[str, Any]]:
    """The processes of run ``tag`` (``faults.py``'s mark in their environment) whose name
    (``/proc/PID/comm``) matches ``pattern``, a regular expression."""
    found = []
    for pid in marked_processes(tag):
        info = proc_named(pid)
        if info and re.fullmatch(pattern, info["comm"]):
            found.append(info)
    return sorted(found, key=lambda i: i["comm"])


def rank_of(comm: str) -> int | None:
    tail = comm.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def launch(cmd: list[str], out: Path, tag: str) -> subprocess.Popen:
    """``cmd`` in a session of its own (its process group is what a hang's cleanup kills),
    with ``faults.py``'s mark in its environment, its output into files beside ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.stdout", "w") as so, open(f"{out}.stderr", "w") as se:
        return subprocess.Popen(cmd, cwd=REPO, stdout=so, stderr=se, stdin=subprocess.DEVNULL,
                                env=run_env(tag), start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGCONT, signal.SIGKILL):  # (a stopped process too)
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            pass


def wait_end(proc: subprocess.Popen, deadline: float) -> bool:
    """Whether ``proc`` ended before ``deadline`` (``time.monotonic``); if not, its process
    group is killed."""
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return True
    except subprocess.TimeoutExpired:
        kill_group(proc)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        return False


def tail_lines(path: Path | str, n: int = 5) -> list[str]:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    return [ln for ln in text.splitlines() if ln.strip()][-n:]


def error_line(lines: list[str]) -> str | None:
    """The line that says what went wrong: the last one naming an error, else the last."""
    for ln in reversed(lines):
        if re.search(r"error|failed|Error|Traceback|timed out|stalled", ln):
            return ln.strip()
    return lines[-1].strip() if lines else None


# ---- what a run wrote ----------------------------------------------------------------------------

def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def journal_steps(out: Path, rank: int) -> int | None:
    """The last step number in worker ``rank``'s journal (None: no step yet)."""
    last = None
    for e in read_jsonl(out / "journal" / f"rank-{rank}.jsonl"):
        if e.get("kind") == "step" and "step" in e:
            last = e["step"]
    return last


def wait_training(proc: subprocess.Popen, out: Path, ranks: Iterable[int], limit_s: float) -> float | None:
    """When every worker in ``ranks`` had written a step (unix time), or None if the run ended
    or ``limit_s`` passed first."""
    ranks, deadline = list(ranks), time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        if all(journal_steps(out, r) is not None for r in ranks):
            return time.time()
        time.sleep(0.05)
    return None


def run_events(out: Path) -> list[dict[str, Any]]:
    """The run's events: ``events.jsonl`` when it wrote its results, else the journals."""
    if (out / "events.jsonl").exists():
        return read_jsonl(out / "events.jsonl")
    return [e for p in sorted((out / "journal").glob("rank-*.jsonl")) for e in read_jsonl(p)]


def step_times(events: list[dict[str, Any]], rank: int) -> list[tuple[int, float]]:
    """(step, unix time at its end) of each of worker ``rank``'s steps, in the order written:
    the event's ``unix`` if it has one, else its clock ``t`` laid on the last event before it
    that has both (``start`` is the clock's zero; ``view``, ``resume``, ``joined`` ...)."""
    out, anchor = [], None
    for e in events:
        if e.get("rank") != rank:
            continue
        if e.get("kind") == "step" and e.get("thread", 0) == 0:
            if "unix" in e:
                out.append((e["step"], e["unix"]))
            elif anchor is not None and "t" in e:
                out.append((e["step"], anchor[1] + e["t"] - anchor[0]))
        elif "unix" in e:
            if "t" in e:
                anchor = (e["t"], e["unix"])
            elif e.get("kind") == "start":
                anchor = (0.0, e["unix"])
    return out


def stall_after(times: list[float], at: float, within_s: float = 2.0) -> dict[str, Any]:
    """How long a worker with step ends ``times`` waited after an event at ``at``: its longest
    wait between two steps that ends after ``at`` and starts before ``at + within_s`` (counted
    from ``at`` for the wait that straddles it), minus its median step time (``stall_s``); and
    when it finished its first step after ``at`` (``first_step_after_s``)."""
    gaps = [(a, b) for a, b in zip(times, times[1:])]
    if len(gaps) < 2:
        return {"stall_s": None, "why": "fewer than 3 steps"}
    median = statistics.median(b - a for a, b in gaps)
    if times[-1] <= at:
        return {"stall_s": None, "why": "no step after the event", "median_step_s": median,
                "last_step_before_s": at - times[-1]}
    near = [(b - max(a, at), b) for a, b in gaps if b > at and a < at + within_s]
    first = min(t for t in times if t > at) - at
    if not near:
        return {"stall_s": None, "why": "no step near the event", "median_step_s": median,
                "first_step_after_s": first}
    wait, end = max(near)
    return {"stall_s": max(0.0, wait - median), "median_step_s": median, "longest_wait_s": wait,
            "wait_ended_s": end - at, "first_step_after_s": first, "steps_after": sum(t > at for t in times)}


def noise_floor(events: list[dict[str, Any]], ranks: Iterable[int]) -> float | None:
    """A run without a kill: its workers' longest wait between two steps minus their median
    step time (the first 5 steps left out: start-up), the most over workers; what a stall of
    the same size in a killed run may owe to this machine rather than to the kill."""
    out = []
    for r in ranks:
        times = [u for _, u in step_times(events, r)][5:]
        gaps = [b - a for a, b in zip(times, times[1:])]
        if len(gaps) >= 2:
            out.append(max(gaps) - statistics.median(gaps))
    return max(out) if out else None


def rank_failures(out: Path, spared: set[int], only: set[int] | None = None) -> list[dict[str, Any]]:
    """Ranks (not in ``spared``; with ``only``, those alone and their logs alone) whose process
    failed: a traceback or ``error.json`` in their log (any attempt), or a mark in
    ``RUN/dropped`` (a stalled worker, ...)."""
    found = []
    for d in sorted((out / "logs").glob("*/attempt_*/*")):
        if not d.is_dir() or not d.name.isdigit() or int(d.name) in spared:
            continue
        if only is not None and int(d.name) not in only:
            continue
        err = d / "stderr.log"
        text = err.read_text(errors="replace") if err.exists() else ""
        if "Traceback" in text or (d / "error.json").exists():
            found.append({"rank": int(d.name), "attempt": d.parent.name, "line": error_line(tail_lines(err, 20))})
    for m in marks.read_marks(out, marks.DROPPED) if only is None else []:
        if m["rank"] not in spared:
            name = marks.mark_path(out, marks.DROPPED, m.get("attempt"), m["rank"]).name
            found.append({"rank": m["rank"], "attempt": m.get("attempt"), "line": f"dropped: {name} {m}"})
    return found


# ---- one run -------------------------------------------------------------------------------------
def clean_run(solver: str, workers: int, steps: int, device_ms: float, tmp: Path) -> dict[str, Any]:
    out = tmp / f"clean-{solver}-{workers}w"
    cmd = train_command(solver, workers, steps, device_ms, out)
    t0 = time.monotonic()
    proc = launch(cmd, out, str(out))
    try:
        ended = wait_end(proc, time.monotonic() + HANG_S + steps * device_ms / 1000 * 3)
    except BaseException:  # (Ctrl-C: the run goes with the harness)
        kill_group(proc)
        raise
    leftovers(str(out), set(), grace_s=5 if ended else 0)
    s = read_json(out / "summary.json") or {}
    return {"solver": solver, "workers": workers, "command": shown(cmd), "rc": proc.returncode if ended else None,
            "hang": not ended, "seconds": time.monotonic() - t0, "final_metric": s.get("final_metric"),
            "longest_wait_s": noise_floor(run_events(out), range(workers)),
            "wall_time_s": s.get("wall_time_s"), "error": None if proc.returncode == 0 else
            error_line(tail_lines(f"{out}.stderr"))}


def kill_run(i: int, spec: dict, clean: dict, steps: int, device_ms: float, tmp: Path,
             rng: random.Random, hang_s: float = HANG_S) -> dict[str, Any]:
    case, solver, workers = spec["case"], spec["solver"], spec["workers"]
    out = tmp / f"{i:03d}-{case}-{solver}"
    cmd = train_command(solver, workers, steps, device_ms, out, spec["max_restarts"], spec["checkpoint_every"])
    rec: dict[str, Any] = {"i": i, **spec, "command": shown(cmd), "steps": steps}
    # what to kill, and when (the moment drawn in the first half of the clean run's training)
    if case == "worker":
        want = [f"ds-worker-{rng.randrange(workers)}"]
    elif case == "adpsgd-passive":
        want = [f"ds-worker-{rng.choice(passive_ranks(workers))}"]
    elif case == "two-workers":
        want = [f"ds-worker-{r}" for r in rng.sample(range(workers), 2)]
    elif case == "server":
        want = [r"ds-server-\d+"]
    else:
        want = [r"ds-coordi\w*-\d+"]
    train_s = clean.get("wall_time_s") or steps * device_ms / 1000 * 1.3
    delay = rng.uniform(0.1, 0.5) * train_s
    second_after = rng.uniform(0.0, 0.02)
    rec["planned_delay_s"] = delay
    tag, ns = str(out), namespaces()
    t0 = time.monotonic()
    proc = launch(cmd, out, tag)
    kill_mono = None
    try:
        started = wait_training(proc, out, range(workers), START_S)
        rec["training_after_s"] = time.monotonic() - t0 if started else None
        if started is None:
            rec["not_killed"] = "ended before training" if proc.poll() is not None else f"no step in {START_S:g} s"
        else:
            while time.monotonic() < t0 + rec["training_after_s"] + delay and proc.poll() is None:
                time.sleep(0.01)
            if proc.poll() is not None:
                rec["not_killed"] = "ended before the kill"
            else:
                # every target found first, then killed (the two of a lost host within 20 ms)
                found = [named(tag, pattern) for pattern in want]
                if want[0].startswith(r"ds-server") and found[0]:  # (a shard of several: one drawn)
                    found = [[rng.choice(found[0])]]
                targets, kills = [], []
                for n, infos in enumerate(f for f in found if f):
                    if n:
                        time.sleep(second_after)
                    for info in infos:
                        role = info["comm"].split("-")[1]
                        info.update(rank=rank_of(info["comm"]), role="coordinator" if role == "coordi" else role)
                        kills.append(time.time())
                        try:
                            os.kill(info["pid"], signal.SIGKILL)
                            info["killed"] = True
                        except OSError as e:
                            info["killed"] = False
                            info["kill_error"] = str(e)
                        targets.append(info)
                        if kill_mono is None:
                            kill_mono = time.monotonic()
                rec["targets"] = targets
                rec["kill_unix"] = kills
                rec["kill_gap_ms"] = (max(kills) - min(kills)) * 1000 if len(kills) > 1 else None
                rec["kill_after_training_s"] = (kill_mono - t0 - rec["training_after_s"]) if kill_mono else None
                # the workers' steps at the kill (a restart's journals start again from its checkpoint)
                rec["steps_at_kill"] = {str(r): journal_steps(out, r) for r in range(workers)}
                if not any(t.get("killed") for t in targets):
                    rec["not_killed"] = f"no process named {' / '.join(want)} (of {len(marked_processes(tag))})"
        ended = wait_end(proc, kill_mono + hang_s if kill_mono else max(time.monotonic(), t0 + hang_s))
    except BaseException:
        kill_group(proc)
        raise
    rec["hang"] = not ended
    rec["rc"] = proc.returncode if ended else None
    rec["seconds"] = time.monotonic() - t0
    rec["left_processes"], rec["left_namespaces"] = leftovers(tag, ns, grace_s=5 if ended else 0)
    rec["stderr_tail"] = tail_lines(f"{out}.stderr", 5)
    rec["stdout_tail"] = tail_lines(f"{out}.stdout", 3)
    analyze(rec, out, steps)
    rec["clean_metric"] = clean.get("final_metric")
    rec["clean_longest_wait_s"] = clean.get("longest_wait_s")
    return rec


def analyze(rec: dict[str, Any], out: Path, steps: int) -> None:
    """What the run's files say about the kill, into ``rec``."""
    workers, solver = rec["workers"], rec["solver"]
    summary = read_json(out / "summary.json")
    rec["finished"] = bool(rec.get("rc") == 0 and summary and summary.get("final_metric") is not None)
    rec["final_metric"] = (summary or {}).get("final_metric")
    rec["partial"] = (summary or {}).get("partial")
    if rec.get("rc") not in (0, None):
        rec["error"] = error_line(rec["stderr_tail"])
    targets = [t for t in rec.get("targets", []) if t.get("killed")]
    killed = {t["rank"] for t in targets if t.get("rank") is not None}
    killed_workers = {t["rank"] for t in targets if t["role"] == "worker"}
    rec["survivor_failures"] = rank_failures(out, killed)
    rec["survivor_crash"] = bool(rec["survivor_failures"])
    rec["target_rank_errors"] = rank_failures(out, set(), only=killed)  # (a replacement's: SIGKILL leaves no traceback)
    events = run_events(out)
    done = {r: len({e["step"] for e in events if e.get("kind") == "step" and e.get("rank") == r and "step" in e})
            for r in range(workers)}
    rec["steps_done"] = {str(r): n for r, n in done.items()}
    survivors = [r for r in range(workers) if r not in killed_workers]
    rec["survivors_steps_lost"] = sum(max(0, steps - done[r]) for r in survivors)
    resumes = [e for e in events if e.get("kind") == "resume" and e.get("rank") in survivors]
    if resumes and rec.get("steps_at_kill"):
        at = rec["steps_at_kill"]
        back = {e["rank"]: e["step"] for e in resumes}
        rec["steps_done_again"] = sum(max(0, (at.get(str(r)) or -1) + 1 - back[r]) for r in back)
    counted = [st["updates"] for st in ((summary or {}).get("solver_stats") or {}).values()
               if isinstance(st, dict) and "updates" in st]
    want = expected_updates(solver, [done[r] for r in range(workers)], steps)
    if want is not None and counted:
        rec["updates_expected"], rec["updates_counted"] = want, counted
        rec["updates_lost"] = max(want - c for c in counted)
    if not rec.get("kill_unix"):
        return
    kill = min(rec["kill_unix"])
    stalls = {}
    for r in survivors:
        times = [u for _, u in step_times(events, r)]
        stalls[str(r)] = stall_after(times, kill)
    rec["stall_by_survivor"] = stalls
    got = [s["stall_s"] for s in stalls.values() if s.get("stall_s") is not None]
    rec["stall_s"] = max(got) if got else None
    rec["survivors_without_a_step_after"] = [r for r, s in stalls.items() if s.get("why") == "no step after the event"
                                             and done[int(r)] < steps]
    # summary.json's own record of the kill
    recovery = (summary or {}).get("recovery") or {}
    rows = [f for f in recovery.get("faults") or [] if f.get("kind") == "kill"
            and abs(f.get("unix", kill) - kill) < 5 and (f.get("rank") in killed or f.get("role") in
                                                         {t["role"] for t in targets})]
    rec["recovery_rows"] = rows
    rec["recovery_filled"] = any(any(r.get(k) is not None for k in ("went_on_s", "healed_s", "recovery_s"))
                                 for r in rows)
    dropped = [d for d in (recovery.get("dropped") or []) + (recovery.get("replaced") or [])
               if d.get("rank") in killed and d.get("unix", kill) >= kill - 1]
    rec["recovery_dropped"] = dropped
    rec["restarts"] = recovery.get("restarts")
    # from the run's own events, whatever summary.json says: the survivors' new view, a
    # replacement's join, a restart's resumption
    views = [v for v in recovery.get("views") or [] if v.get("unix", 0) >= kill
             and not killed & set(v.get("members", []))]
    if views:
        rec["view_after_s"] = min(v["unix"] for v in views) - kill
    joins = [e for e in events if e.get("kind") == "joined" and e.get("rank") in killed and e.get("unix", 0) >= kill]
    if joins:
        rec["joined_after_s"] = min(e["unix"] for e in joins) - kill
    resumed = [e for e in events if e.get("kind") == "resume" and e.get("unix", 0) >= kill]
    if resumed:
        rec["resumed_after_s"] = min(e["unix"] for e in resumed) - kill
    # a server or coordinator replaced while the workers waited: what the solvers' stats say of it
    said = {rank: {k: v for k, v in st.items() if "replac" in k and v}
            for rank, st in ((summary or {}).get("solver_stats") or {}).items() if isinstance(st, dict)}
    rec["replacement_stats"] = {rank: v for rank, v in said.items() if v}
    rec["healed"] = was_healed(rec)


def was_healed(rec: dict[str, Any]) -> bool:
    """A killed worker's replacement joined (a ``joined`` event), or a killed server or
    coordinator was replaced while the others went on (the solvers' stats say so: the
    workers count ``servers_replaced``/``coordinator_replaced``, the new one ``replacement``)."""
    if rec.get("joined_after_s") is not None:
        return True
    return any(t.get("role") != "worker" for t in rec.get("targets", []) if t.get("killed")) \
        and bool(rec.get("replacement_stats"))


# ---- tables --------------------------------------------------------------------------------------
def fmt_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f} / {max(values) * 1000:.0f}" if values else "-"


def summarize_runs(runs: list[dict]) -> dict[str, Any]:
    killed = [r for r in runs if r.get("kill_unix") and not r.get("not_killed")]
    stalls = [r["stall_s"] for r in killed if r.get("stall_s") is not None]
    metrics = [r["final_metric"] for r in killed if r.get("final_metric") is not None]
    cleans = [r["clean_metric"] for r in killed if r.get("clean_metric") is not None]
    heal = [r for r in killed if r.get("max_restarts")]
    lost_upd = [r["updates_lost"] for r in killed if r.get("updates_lost") is not None]
    floor = [r["clean_longest_wait_s"] for r in runs if r.get("clean_longest_wait_s") is not None]
    return {"kills": len(killed), "not_killed": len(runs) - len(killed), "floor": fmt_ms(floor).split(" / ")[-1],
            "finished": sum(bool(r.get("finished")) for r in killed),
            "survivor_crashes": sum(bool(r.get("survivor_crash")) for r in killed),
            "hangs": sum(bool(r.get("hang")) for r in runs),
            "stall": fmt_ms(stalls), "no_step_after": sum(bool(r.get("survivors_without_a_step_after")) for r in killed),
            "steps_lost": sum(r.get("survivors_steps_lost") or 0 for r in killed),
            "done_again": sum(r.get("steps_done_again") or 0 for r in killed),
            "updates_lost": f"{max(lost_upd)}" if lost_upd else "-",
            "recovery_rows": f"{sum(bool(r.get('recovery_rows')) for r in killed)} / "
                             f"{sum(bool(r.get('recovery_filled')) for r in killed)}",
            "dropped_listed": sum(bool(r.get("recovery_dropped")) for r in killed),
            "healed": f"{sum(was_healed(r) for r in heal)} / {len(heal)}" if heal else "-",
            "restarted": sum(r.get("resumed_after_s") is not None for r in killed),
            "accuracy": (f"{statistics.mean(cleans):.3f} → {statistics.mean(metrics):.3f}"
                         if metrics and cleans else "-")}


HEAD = ["kills", "finished", "survivor crashes", "hangs", "survivors' stall (ms, median / max)", "clean run's longest wait (ms)",
        "survivors' steps lost", "done again", "updates lost (max)", "recovery row (present / with went_on, healed or recovery s)",
        "dropped listed", "replaced (of runs with --max-restarts 1)", "restarted", "accuracy (clean → killed)"]
KEYS = ["kills", "finished", "survivor_crashes", "hangs", "stall", "floor", "steps_lost", "done_again", "updates_lost",
        "recovery_rows", "dropped_listed", "healed", "restarted", "accuracy"]


def no_tmp(text: str | None) -> str:
    """``text`` with a run folder of these scripts' temporary folders written ``RUN``."""
    return re.sub(r"/[^\s;:()'\"]*/(kill_campaign|lagging_worker)-[^/\s]+/[^/\s;:()'\"]+", "RUN", text or "")


REGIME = ("emulated devices (--device-ms: each step lasts a fixed device time, the real math inside it), "
          "loopback, on this machine's cores shared with other work")


def provenance_line(raw: dict[str, Any]) -> str:
    """Where a raw file's figures come from: command, commit (and a working tree that
    differed), machine, seed, date."""
    changed = raw.get("changed_files") or []
    src = [f for f in changed if "src/" in f]
    machine = raw.get("machine") or {}
    return (f"`{raw.get('command', '?')}` at commit {str(raw.get('commit'))[:10]}"
            + (f" (the working tree differed in {len(changed)} files, {len(src)} under src/)" if raw.get("dirty") else "")
            + f", {machine.get('cpu_count')} cores, torch {machine.get('torch')}, seed {raw.get('seed')}, "
            f"{raw.get('date') or raw.get('when', '')}")


def kills_per_case(runs: list[dict]) -> dict[str, int]:
    """Kills made per case (runs whose target was found and killed)."""
    out: dict[str, int] = {}
    for r in runs:
        if r.get("kill_unix") and not r.get("not_killed"):
            out[r["case"]] = out.get(r["case"], 0) + 1
    return out


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
    by_case = [[case, *[summarize_runs([r for r in runs if r["case"] == case])[k] for k in KEYS]]
               for case in CASES if any(r["case"] == case for r in runs)]
    lines += markdown_table(["case", *HEAD], by_case + [["**all**", *[summarize_runs(runs)[k] for k in KEYS]]])
    lines += ["", "Solvers killed, per case (kills):", ""]
    for case in CASES:
        here = [r["solver"] for r in runs if r["case"] == case]
        if here:
            lines.append(f"- {case}: " + ", ".join(f"`{s}` {here.count(s)}" for s in sorted(set(here))))
    gaps = [r["kill_gap_ms"] for r in runs if r.get("kill_gap_ms") is not None]
    if gaps:
        lines += ["", f"Two workers at once: the second kill came {statistics.median(gaps):.0f} ms (median) / "
                      f"{max(gaps):.0f} ms (max) after the first."]
    bad = [r for r in runs if r.get("not_killed") or not r.get("finished") or r.get("survivor_crash") or r.get("hang")]
    if bad:
        lines += ["", "Runs that did not finish, crashed a survivor, hung or were not killed:", ""]
        for r in bad:
            what = ", ".join(f"{t['comm']}" for t in r.get("targets", [])) or "-"
            why = r.get("not_killed") or ("hang" if r.get("hang") else r.get("error") or r.get("harness_error") or "")
            crash = "; ".join(f"rank {f['rank']} ({f['attempt']}): {f['line']}" for f in r.get("survivor_failures", []))
            lines.append(f"- {r['case']} {r['solver']} (kill {what}{', max-restarts 1' if r.get('max_restarts') else ''}): "
                         f"exit {r.get('rc')}; `{no_tmp(why)[:300]}`" + (f"; survivors: `{no_tmp(crash)[:400]}`" if crash else ""))
    clean_bad = [c for c in raw.get("clean", []) if c.get("rc") != 0]
    if clean_bad:
        lines += ["", "Clean runs (no kill) that failed:", ""]
        lines += [f"- {c['solver']} ({c['workers']} workers): exit {c.get('rc')}; `{no_tmp(c.get('error'))}`"
                  for c in clean_bad]
    return {"kill_campaign": "\n".join(lines)}


# ---- the campaign --------------------------------------------------------------------------------
def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--runs", type=int, default=100, help="kills in all (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--solvers", help="comma-separated (default: every registered solver)")
    p.add_argument("--cases", help=f"comma-separated, of {', '.join(CASES)} (default: all)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"steps per worker (default {STEPS}: about 4 s)")
    p.add_argument("--device-ms", type=float, default=20.0, help="emulated device time of a step (default 20)")
    p.add_argument("--hang-s", type=float, default=HANG_S,
                   help=f"a run not ended this long after the kill is a hang (default {HANG_S:g})")
    p.add_argument("--json", default="benchmarks/results/kill_campaign.json",
                   help="the raw results (written after every run; default: benchmarks/results/kill_campaign.json)")
    p.add_argument("--keep", action="store_true", help="keep the run folders (their path is printed)")
    args = p.parse_args()
    started = provenance("benchmarks/kill_campaign.py")
    rng = random.Random(args.seed)
    solvers = args.solvers.split(",") if args.solvers else all_solvers()
    cases = args.cases.split(",") if args.cases else list(CASES)
    specs = plan(args.runs, cases, solvers, rng)
    payload: dict[str, Any] = {"seed": args.seed,
                               "settings": {"steps": args.steps, "device_ms": args.device_ms, "timeout_s": TIMEOUT_S,
                                            "hang_s": args.hang_s, "checkpoint_every": CHECKPOINT_EVERY,
                                            "workload": "digits", "seed_of_runs": 1},
                               "clean": [], "runs": []}

    def save(partial: bool) -> None:  # (after each run: an abort keeps what was measured)
        per_case = kills_per_case(payload["runs"])
        payload.update(partial=partial, kills_per_case=per_case, repeats=min(per_case.values(), default=0))
        write_record(args.json, started, regime=REGIME, seeds=[args.seed], payload=payload, announce=not partial)
    tmp = Path(tempfile.mkdtemp(prefix="kill_campaign-"))
    t0 = time.monotonic()
    cleans: dict[tuple[str, int], dict] = {}
    print(f"{len(specs)} kills: " + ", ".join(f"{c} {sum(s['case'] == c for s in specs)}" for c in CASES
                                             if any(s["case"] == c for s in specs)) + f"; run folders in {tmp}",
          flush=True)
    try:
        for i, spec in enumerate(specs):
            key = (spec["solver"], spec["workers"])
            if key not in cleans:
                cleans[key] = clean_run(*key, args.steps, args.device_ms, tmp)
                payload["clean"].append(cleans[key])
                c = cleans[key]
                print(f"  clean {key[0]} ({key[1]} workers): exit {c['rc']}, {c['seconds']:.1f} s, "
                      f"accuracy {c['final_metric']}" + (f"; {c['error']}" if c["rc"] != 0 else ""), flush=True)
            try:
                r = kill_run(i, spec, cleans[key], args.steps, args.device_ms, tmp, rng, args.hang_s)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # (recorded: the campaign goes on)
                r = {"i": i, **spec, "harness_error": f"{type(e).__name__}: {e}", "finished": False}
            payload["runs"].append(r)
            targets = ",".join(t["comm"] for t in r.get("targets", [])) or "-"
            print(f"[{i + 1}/{len(specs)} {time.monotonic() - t0:.0f} s] {spec['case']} {spec['solver']}"
                  f"{' (max-restarts 1)' if spec['max_restarts'] else ''}: killed {targets}; "
                  f"{'finished' if r.get('finished') else 'NOT finished'}"
                  f"{', hang' if r.get('hang') else ''}{', survivor crash' if r.get('survivor_crash') else ''}"
                  f"{', stall ' + format(r['stall_s'] * 1000, '.0f') + ' ms' if r.get('stall_s') is not None else ''}"
                  f"{'; ' + r['not_killed'] if r.get('not_killed') else ''}"
                  f"{'; ' + str(r.get('error') or r.get('harness_error')) if not r.get('finished') else ''}",
                  flush=True)
            payload["seconds"] = time.monotonic() - t0
            payload["per_kill_s"] = payload["seconds"] / len(payload["runs"])
            save(partial=True)
    finally:
        if args.keep:
            print(f"run folders kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    payload["seconds"] = time.monotonic() - t0
    payload["per_kill_s"] = payload["seconds"] / max(1, len(payload["runs"]))
    save(partial=False)
    print()
    print(render(json.loads(Path(args.json).read_text()))["kill_campaign"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
