"""How fast `distsync recommend` answers, how often it goes silent, and whether the same command
gives the same first pick beside other work.

Regime: this machine's CPU (the answer is simulated; its cost is this machine's).

    python benchmarks/recommend_speed.py [--repeats 5] [--loaded 2] [--lstm-repeats 3] [--json PATH]

Method, raw results and figures: docs/benchmarks/recommend.md.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import argument_parser, finish, provenance

from distsync.experiments.report import markdown_table
from distsync.metrics.repeats import shown

REPO = Path(__file__).resolve().parent.parent
REGIME = "this machine's CPU, quiet unless marked loaded (the answers are simulated; their cost is this machine's)"
CASES = {
    "digits16": ["--workload", "digits", "--workers", "16", "--link", "1gbit", "--slow-fraction", "0.25"],
    "charlstm8": ["--workload", "benchmarks/workloads/charlstm.py:make_workload", "--workers", "8", "--link",
                  "1gbit"],
}
#: the targets: seconds to answer (quiet), the longest silence, the runs with the modal pick
TARGET_S = {"digits16": 60.0, "charlstm8": 120.0}
SILENCE_S = 10.0
SAME_PICK = (4, 5)


def run_once(case: str, loaded: bool) -> dict[str, Any]:
    """One `distsync recommend` of ``case`` (``loaded``: beside a busy loop, one core's worth):
    its wall time, longest silence and answer."""
    out = Path(tempfile.mkdtemp(prefix=f"recommend-speed-{case}-"))
    cmd = [str(Path(sys.executable).parent / "distsync"), "recommend", *CASES[case], "--out", str(out / "r")]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if loaded else None
    try:
        time.sleep(0.5 if loaded else 0)  # (the busy loop running before the run starts)
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "COLUMNS": "200"})
        stamps, lines = [0.0], []
        for line in proc.stdout:  # (each line stamped as it comes: the silences between them)
            stamps.append(time.monotonic() - t0)
            lines.append(line.rstrip("\n"))
        rc = proc.wait()
        stamps.append(time.monotonic() - t0)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    if rc != 0:
        raise SystemExit(f"error: {' '.join(cmd)} exited {rc}:\n" + "\n".join(lines[-20:]))
    result = json.loads((out / "r" / "recommend.json").read_text())
    return {"loaded": loaded, "wall_s": stamps[-1], "answer_s": result["answer_seconds"],
            "longest_silence_s": max(b - a for a, b in zip(stamps, stamps[1:])),
            "compute_ms": result["compute_s"] * 1000,
            "compute_p10_p90_ms": [v * 1000 for v in result["compute_p10_p90_s"] or []],
            "first_pick": result["ranked"][0]["label"], "within_uncertainty": result.get("within_uncertainty", []),
            "judged_to_target": sum(r["time_to_target_s"] is not None for r in result["ranked"]),
            "candidates": len(result["ranked"]), "train_plan": result.get("train_plan", "")}


def stability(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The modal first pick, how many runs gave it, and how many of the others said the
    first pick was not settled with the modal pick within their uncertainty."""
    picks = collections.Counter(r["first_pick"] for r in runs)
    modal, same = picks.most_common(1)[0]
    owned = sum(r["first_pick"] != modal and modal in r["within_uncertainty"] for r in runs)
    return {"modal": modal, "same": same, "runs": len(runs), "others_said_unsettled": owned,
            "met": same >= SAME_PICK[0] * len(runs) / SAME_PICK[1] or same + owned == len(runs)}


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def render(raw: dict[str, Any]) -> str:
    runs_table, goals = [], []
    for case, runs in raw["cases"].items():
        for i, r in enumerate(runs, 1):
            spread = r["compute_p10_p90_ms"]
            runs_table.append([case, i, "yes" if r["loaded"] else "no", f"{r['wall_s']:.1f}",
                               f"{r['longest_silence_s']:.1f}",
                               f"{r['compute_ms']:.3g}" + (f" ({spread[0]:.3g}-{spread[1]:.3g})" if spread else ""),
                               r["first_pick"], ", ".join(r["within_uncertainty"]) or "-",
                               f"{r['judged_to_target']} / {r['candidates']}", r["train_plan"] or "-"])
        quiet = [r["wall_s"] for r in runs if not r["loaded"]]
        silence = max(r["longest_silence_s"] for r in runs)
        st = stability(runs)
        fast = bool(quiet) and max(quiet) <= TARGET_S[case]
        goals.append([case, shown(quiet, "{:.1f}"), f"<= {TARGET_S[case]:g}: {_met(fast)}",
                      f"{silence:.1f}", f"<= {SILENCE_S:g}: {_met(silence <= SILENCE_S)}",
                      f"{st['same']} of {st['runs']} ({st['modal']}; {st['others_said_unsettled']} other(s) said "
                      f"unsettled)", f"{SAME_PICK[0]} of {SAME_PICK[1]}, or said unsettled: {_met(st['met'])}"])
    return "\n".join([
        f"Regime: {raw['regime']}. Each row one run of the command (stdout not a terminal: progress as lines).", "",
        *markdown_table(["case", "run", "beside a busy loop", "answered in (s)", "longest silence (s)",
                         "compute a step, p10-p90 (ms)", "first pick", "within its uncertainty",
                         "to target / candidates", "plan"], runs_table), "",
        *markdown_table(["case", "answered in, quiet (s)", "target", "longest silence (s)", "target",
                         "same first pick", "target"], goals)])


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--repeats", type=int, default=5, help="runs of digits16 (default: 5)")
    p.add_argument("--loaded", type=int, default=2, help="of them, the last N beside a busy loop (default: 2)")
    p.add_argument("--lstm-repeats", type=int, default=3, help="runs of charlstm8 (default: 3)")
    p.add_argument("--json", default="benchmarks/results/recommend_speed.json", help="where to write the raw results")
    args = p.parse_args()
    if args.repeats < 1 or args.lstm_repeats < 0 or not 0 <= args.loaded <= args.repeats:
        p.error("--repeats >= 1, --lstm-repeats >= 0 and 0 <= --loaded <= --repeats")
    started = provenance("benchmarks/recommend_speed.py")
    cases: dict[str, list[dict[str, Any]]] = {"digits16": [], "charlstm8": []}
    plan = [("digits16", i >= args.repeats - args.loaded) for i in range(args.repeats)]
    plan += [("charlstm8", False)] * args.lstm_repeats
    for case, loaded in plan:
        r = run_once(case, loaded)
        cases[case].append(r)
        print(f"{case}{' (loaded)' if loaded else ''}: {r['wall_s']:.1f} s, longest silence "
              f"{r['longest_silence_s']:.1f} s, first pick {r['first_pick']}", flush=True)
    cases = {k: v for k, v in cases.items() if v}
    payload = {"cases": cases, "commands": {k: ["distsync", "recommend", *CASES[k]] for k in cases}}
    seeds = list(range(1, max(len(v) for v in cases.values()) + 1))
    return finish(args.json, started, lambda raw: {"recommend_speed": render(raw)}, payload, regime=REGIME,
                  seeds=seeds)


if __name__ == "__main__":
    sys.exit(main())
