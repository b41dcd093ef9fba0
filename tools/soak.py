"""The whole suite again and again under load: does any test fail by chance?

Runs `make test`'s pytest command (``python -m pytest -q -n 2``) ``SOAK_RUNS`` times in a row
(default 10), beside ``SOAK_BURNERS`` plain Python busy loops (default: one per core), with
Hypothesis's saved examples (``.hypothesis/``) cleared before each run and fresh draws from a
recorded seed (``--hypothesis-profile explore --hypothesis-seed N``; the suite's own profile
draws the same examples every run) and a recorded ``PYTHONHASHSEED``. Each failing test is
printed with its short text as its run ends; at the end, how often each test failed. The record
(runs, failures per test with their messages, seeds, commit, machine, load, and the provenance
a figure's raw file carries) goes to ``SOAK_OUT`` (default ``benchmarks/results/soak.json``),
rewritten after each run, and each run's output beside it (``soak-logs/run-NN.log``; for the
published record, ``benchmarks/results/soak-logs/``). Exits 1 if any run failed.

    make test-soak                                        # hours
    SOAK_OUT=docs/benchmarks/raw/soak.json make test-soak # the published figure (docs/testing.md)
    SOAK_RUNS=1 SOAK_ARGS="tests/test_rules.py" make test-soak

A failure is reproduced with its run's seeds: ``PYTHONHASHSEED=H python -m pytest
--hypothesis-profile explore --hypothesis-seed N TEST``. The burners end with this script,
whatever ends it (they also stop on their own once it is gone).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
#: `make test`'s command, less its timing report
SUITE = ["-m", "pytest", "-q", "-n", "2"]
#: a burner: a busy loop that ends once its parent (this script, whose pid it is given: it may be
#: gone before the loop starts) is gone, even killed
BURNER = "import os, sys\nwhile os.getppid() == int(sys.argv[1]):\n    for _ in range(100000):\n        pass\n"
#: the most of a failure's text kept in the record (its end: where the assertion is)
KEEP_CHARS = 4000
#: an object's address in a failure's text
_ADDRESS = re.compile(r"0x[0-9a-f]{6,}")
#: runs when none is asked for, and the consecutive green runs a soak aims at
DEFAULT_RUNS = 10
#: where the published record goes (a figure's raw file: docs/testing.md renders it)
PUBLISHED = REPO / "docs" / "benchmarks" / "raw" / "soak.json"
#: the most of a failure's first line a rendered table shows
SHOWN_CHARS = 120


@contextmanager
def burners(count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` busy loops for the life of the block, killed and reaped when it ends."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-c", BURNER, str(os.getpid())], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=30)


def nodeid(classname: str, name: str) -> str:
    """A junit-xml test case as pytest names it (``tests/test_x.py::Class::test[param]``)."""
    parts = classname.split(".") if classname else []
    for k in range(len(parts), 0, -1):
        path = "/".join(parts[:k]) + ".py"
        if (REPO / path).is_file():
            return "::".join([path, *parts[k:], name])
    return "::".join([*parts, name])


def failures(junit: Path) -> tuple[int, dict[str, str]]:
    """(tests run, {test: its failure's short text and text}) from a pytest junit-xml file:
    failures and errors (an error in a fixture's setup or teardown included)."""
    root = ET.parse(junit).getroot()
    run, failed = 0, {}
    for case in root.iter("testcase"):
        run += 1
        for bad in [*case.findall("failure"), *case.findall("error")]:
            short = (bad.get("message") or "").strip()
            text = (bad.text or "").strip()
            key = nodeid(case.get("classname", ""), case.get("name", ""))
            if bad.tag == "error":
                key += " (error)"
            failed[key] = f"{short}\n{text[-KEEP_CHARS:]}".strip() if text else short
    return run, failed


def skipped(junit: Path) -> int:
    """The test cases a pytest junit-xml file marks skipped."""
    return sum(1 for case in ET.parse(junit).getroot().iter("testcase") if case.find("skipped") is not None)


def tally(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per failing test, over ``runs``: how many failed it, which (their indices) and the
    different messages (objects' addresses aside), most failing first."""
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        for test, message in r["failures"].items():
            row = out.setdefault(test, {"count": 0, "runs": [], "messages": []})
            row["count"] += 1
            row["runs"].append(r["index"])
            same = _ADDRESS.sub("0x?", message)  # (the same failure, another run's objects)
            if same not in (_ADDRESS.sub("0x?", m) for m in row["messages"]):
                row["messages"].append(message)
    return dict(sorted(out.items(), key=lambda kv: (-kv[1]["count"], kv[0])))


def short(message: str) -> str:
    """A failure's first line, as the report prints it."""
    return message.splitlines()[0] if message else "(no message)"


def report(runs: list[dict[str, Any]]) -> list[str]:
    """The closing lines: how often each test failed over the runs."""
    failed_runs = sum(1 for r in runs if r["failures"])
    lines = [f"soak: {len(runs)} runs, {failed_runs} failed"]
    for test, row in tally(runs).items():
        lines.append(f"  {row['count']}/{len(runs)}  {test}  (runs {', '.join(map(str, row['runs']))})")
    return lines


def run_suite(cmd: list[str], env: dict[str, str], log: Path, cwd: Path) -> int:
    """One run of the suite, its output to ``log``; its exit status."""
    with open(log, "w") as out:
        return subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode


def command(runs: int, burner_count: int, pytest_args: list[str], out: Path) -> str:
    """This soak as one command line, whatever set its options (arguments or ``SOAK_*``): the
    burners only where they are not one per core, the record's place from the repository's root."""
    burners_given = ["--burners", str(burner_count)] if burner_count != (os.cpu_count() or 1) else []
    place = out.relative_to(REPO) if out.is_relative_to(REPO) else out
    return shlex.join(["python", "tools/soak.py", "--runs", str(runs), *burners_given, *pytest_args,
                       "--json", str(place)])


def regime(burner_count: int, pytest_args: list[str]) -> str:
    """What the runs tested, and beside what load: the record's regime."""
    what = shlex.join(pytest_args) if pytest_args else "the whole suite"
    return f"{what}, pytest -n 2, beside {burner_count} busy loops on {os.cpu_count()} cores"


def soak(runs: int, burner_count: int, pytest_args: list[str], out: Path,
         runner: Callable[[list[str], dict[str, str], Path, Path], int] = run_suite,
         seeds: random.Random | None = None, say: Callable[[str], None] = print, root: Path = REPO,
         logs: Path | None = None, resume: bool = False) -> int:
    """Run the suite in ``root`` ``runs`` times beside ``burner_count`` busy loops; write the
    record to ``out`` after each run (with ``logs``, each run's output: by default beside it);
    1 if any run failed, else 0. ``resume``: go on from the runs the record at ``out`` holds,
    made at this commit (a soak longer than a machine is kept), up to ``runs`` in all."""
    seeds = seeds or random.SystemRandom()
    logs = logs or out.parent / f"{out.stem}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    # (a run's own seeds are its record's python_hash_seed and hypothesis_seed)
    suite_command = " ".join(["PYTHONHASHSEED=H python", *SUITE, "--hypothesis-profile=explore --hypothesis-seed=N",
                              shlex.join(pytest_args)]).rstrip()
    started = _provenance(out)
    record: dict[str, Any] = {"command": command(runs, burner_count, pytest_args, out), **started,
                              "regime": regime(burner_count, pytest_args), "seeds": [], "repeats": 0,
                              "suite_command": suite_command, "runs_asked": runs, "burners": burner_count,
                              "runs": [], "failures": {}}
    if resume:
        record = resumed(out, started, runs, record["regime"], say)
    # (the record as it grows lies beside the logs: a suite under test that reads the published
    # path, its figure's raw file, must not see it change while it runs; it is published at the
    # end, however the soak ends)
    working = logs / "record.json"
    try:
        _soak_runs(runs, burner_count, pytest_args, runner, seeds, say, root, logs, record, started, out, working)
    finally:
        if record["runs"]:
            _write(out, record)
    for line in report(record["runs"]):
        say(line)
    say(f"soak: record in {out}")
    return 1 if record["failures"] else 0


def _soak_runs(runs: int, burner_count: int, pytest_args: list[str], runner, seeds: random.Random,
               say: Callable[[str], None], root: Path, logs: Path, record: dict[str, Any], started: dict[str, Any],
               out: Path, working: Path) -> None:
    """(:func:`soak`) The runs, each added to ``record``, which is written to ``working``
    after each."""
    with burners(burner_count):
        for i in range(len(record["runs"]) + 1, runs + 1):
            shutil.rmtree(root / ".hypothesis", ignore_errors=True)
            hypothesis_seed, hash_seed = seeds.randrange(2**32), seeds.randrange(2**32)
            junit = logs / f"run-{i:02d}.xml"
            junit.unlink(missing_ok=True)
            cmd = [sys.executable, *SUITE, f"--junitxml={junit}",
                   "--hypothesis-profile=explore", f"--hypothesis-seed={hypothesis_seed}", *pytest_args]
            env = dict(os.environ, PYTHONHASHSEED=str(hash_seed))
            load_before, began, at = os.getloadavg(), time.monotonic(), _head()
            code = runner(cmd, env, logs / f"run-{i:02d}.log", root)
            seconds = round(time.monotonic() - began, 1)
            tests, failed = failures(junit) if junit.is_file() else (0, {})
            skips = skipped(junit) if junit.is_file() else 0
            if code != 0 and not failed:  # (pytest itself failed: collection, a worker lost, no tests)
                tail = (logs / f"run-{i:02d}.log").read_text(errors="replace")[-KEEP_CHARS:]
                failed = {"(the run itself)": f"pytest exited {code}\n{tail}".strip()}
            record["runs"].append({"index": i, "commit": at, "hypothesis_seed": hypothesis_seed,
                                   "python_hash_seed": hash_seed, "exit_code": code, "seconds": seconds,
                                   "tests": tests, "skipped": skips,
                                   "load_average_before": list(load_before),
                                   "load_average_after": list(os.getloadavg()),
                                   "failures": failed})
            record["failures"] = tally(record["runs"])
            record["seeds"].append({"hypothesis": hypothesis_seed, "python_hash": hash_seed})
            record["repeats"] = len(record["runs"])
            _moved(record, started, out)
            _write(working, record)
            say(f"run {i}/{runs}: {tests} tests, {len(failed)} failed, {seconds} s "
                f"(--hypothesis-seed={hypothesis_seed}, PYTHONHASHSEED={hash_seed}, "
                f"load {load_before[0]:.1f})")
            for test, message in failed.items():
                say(f"  FAILED {test}: {short(message)}")


def resumed(out: Path, started: dict[str, Any], runs: int, regime_now: str,
            say: Callable[[str], None]) -> dict[str, Any]:
    """The record at ``out`` to go on from: made at this commit, the tree the same but for the
    record itself, the same tests beside the same load (what the earlier runs tested is what the
    later ones test)."""
    if not out.is_file():
        raise SystemExit(f"soak: error: nothing to resume: no record at {out}")
    record = json.loads(out.read_text())
    if record.get("commit") != started["commit"] or started["dirty"] or record.get("dirty"):
        raise SystemExit(f"soak: error: the record at {out} was made at {str(record.get('commit'))[:10]}"
                         f"{' with changes' if record.get('dirty') else ''}; this tree is "
                         f"{str(started['commit'])[:10]}{' with changes' if started['dirty'] else ''}: "
                         f"a soak resumes only at its own commit, unchanged")
    if record.get("regime") != regime_now:
        raise SystemExit(f"soak: error: the record at {out} ran {record.get('regime')!r}; this soak would run "
                         f"{regime_now!r}")
    if len(record["runs"]) >= runs:
        raise SystemExit(f"soak: error: the record at {out} holds {len(record['runs'])} runs already "
                         f"(asked: {runs})")
    record["runs_asked"] = runs
    record.setdefault("resumed", []).append({"after_run": len(record["runs"]), "date": started["date"],
                                             "machine": started["machine"]})
    say(f"soak: going on after run {len(record['runs'])} of {out}")
    return record


def _provenance(out: Path) -> dict[str, Any]:
    """The commit and machine, as a benchmark's raw file records them; the record ``out`` is not
    counted a change to the working tree (a soak rewrites its committed record as it goes)."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    from common import provenance

    got = provenance("")
    got.pop("command", None)
    own = str(out.relative_to(REPO)) if out.is_relative_to(REPO) else None
    got["changed_files"] = [p for p in got["changed_files"] if p != own]
    if got["dirty"] is not None:
        got["dirty"] = bool(got["changed_files"])
    return got


def _head() -> str | None:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
    return done.stdout.strip() if done.returncode == 0 else None


def _moved(record: dict[str, Any], started: dict[str, Any], out: Path) -> None:
    """Note in ``record`` a commit or working tree that changed since the soak began (what its
    later runs tested is then not its commit) and the load now, as a raw file's record does."""
    now = _provenance(out)
    if (now["commit"], now["changed_files"]) != (started["commit"], started["changed_files"]):
        record["changed_during_run"] = {"commit": now["commit"], "changed_files": now["changed_files"]}
    record["machine"]["load_average_at_end"] = now["machine"]["load_average_at_start"]


def green(run: dict[str, Any]) -> bool:
    return run["exit_code"] == 0 and not run["failures"]


def _cell(text: str) -> str:
    """``text`` as a table cell: a code span, cut at :data:`SHOWN_CHARS`."""
    text = text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 1] + "…"
    return "`" + text.replace("`", "'").replace("|", "\\|") + "`"


def render(raw: dict[str, Any]) -> str:
    """docs/testing.md's block: the runs, the failures per test, the green runs at the end."""
    runs = raw["runs"]
    machine = raw["machine"]
    dirty = ", with uncommitted changes" if raw.get("dirty") else ""
    lines = [f"`{raw['command']}` at commit {raw['commit'][:10]}{dirty}, {machine['cpu_count']} cores, "
             f"torch {machine['torch']}, {raw['date']}; {len(runs)} of {raw['runs_asked']} runs. "
             f"Regime: {raw['regime']}."
             + "".join(f" Resumed after run {r['after_run']} on {r['date'][:16]}." for r in raw.get("resumed", [])),
             "",
             "| run | commit | `--hypothesis-seed` | `PYTHONHASHSEED` | passed | failed | minutes | "
             "load before / after |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        tests = {t.removesuffix(" (error)") for t in r["failures"] if t != "(the run itself)"}
        failed = str(len(tests)) if "(the run itself)" not in r["failures"] else \
            f"the run (pytest exited {r['exit_code']})"
        before, after = r["load_average_before"][0], r["load_average_after"][0]
        lines.append(f"| {r['index']} | {(r.get('commit') or raw['commit'])[:10]} | {r['hypothesis_seed']} | "
                     f"{r['python_hash_seed']} | {r['tests'] - r.get('skipped', 0) - len(tests)} | {failed} | "
                     f"{r['seconds'] / 60:.1f} | {before:.1f} / {after:.1f} |")
    lines.append("")
    if raw["failures"]:
        lines += ["| test | runs failed in | first line of its failure |", "|---|---|---|"]
        for test, row in raw["failures"].items():
            lines.append(f"| `{test}` | {row['count']} of {len(runs)} (runs {', '.join(map(str, row['runs']))}) | "
                         f"{_cell(short(row['messages'][0]))} |")
    else:
        lines.append("No test failed in any run.")
    at_end = 0
    for r in reversed(runs):
        if not green(r):
            break
        at_end += 1
    lines += ["", f"{at_end} consecutive green runs at the end (target {DEFAULT_RUNS})."]
    return "\n".join(lines) + "\n"


def _write(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "")
    try:
        return int(text) if text.strip() else default
    except ValueError:
        raise SystemExit(f"soak: error: {name} must be a whole number, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=_env_int("SOAK_RUNS", DEFAULT_RUNS))
    parser.add_argument("--burners", type=int, default=_env_int("SOAK_BURNERS", os.cpu_count() or 1))
    parser.add_argument("--out", "--json", type=Path,  # (--json: as figures.py runs a figure)
                        default=Path(os.environ.get("SOAK_OUT") or REPO / "benchmarks" / "results" / "soak.json"))
    parser.add_argument("--resume", action="store_true", default=os.environ.get("SOAK_RESUME", "") not in ("", "0"),
                        help="go on from the runs of the record at --out, made at this commit (default: SOAK_RESUME)")
    parser.add_argument("pytest_args", nargs="*", default=shlex.split(os.environ.get("SOAK_ARGS", "")),
                        help="passed on to pytest (default: SOAK_ARGS, else the whole suite)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.burners < 0:
        parser.error(f"needs --runs >= 1 and --burners >= 0, got {args.runs} and {args.burners}")
    # A stop (make's SIGTERM, a closed terminal) unwinds like Ctrl-C, so the burners are killed.
    stopped_by = [signal.SIGINT]

    def stop(signum, frame):
        stopped_by[0] = signum
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        out = args.out.resolve()
        # (the published record's logs stay out of the committed folder)
        logs = REPO / "benchmarks" / "results" / "soak-logs" if out == PUBLISHED else None
        return soak(args.runs, args.burners, args.pytest_args, out, logs=logs, resume=args.resume)
    except KeyboardInterrupt:
        print("soak: stopped; the record holds the runs that ended", file=sys.stderr)
        return 128 + stopped_by[0]


if __name__ == "__main__":
    sys.exit(main())
