"""The whole suite again and again under load: does any test fail by chance?

Runs `make test`'s pytest command (``python -m pytest -q -n 2``) ``SOAK_RUNS`` times in a row
(default 10), beside ``SOAK_BURNERS`` plain Python busy loops (default: one per core), with
Hypothesis's saved examples (``.hypothesis/``) cleared before each run and fresh draws from a
recorded seed (``--hypothesis-profile explore --hypothesis-seed N``; the suite's own profile
draws the same examples every run) and a recorded ``PYTHONHASHSEED``. Each failing test is
printed with its short text as its run ends; at the end, how often each test failed. The record
(runs, failures per test with their messages, seeds, commit, machine, load) goes to
``SOAK_OUT`` (default ``benchmarks/results/soak.json``), rewritten after each run, and each
run's output beside it (``soak-logs/run-NN.log``). Exits 1 if any run failed.

    make test-soak                                        # hours
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


def soak(runs: int, burner_count: int, pytest_args: list[str], out: Path,
         runner: Callable[[list[str], dict[str, str], Path, Path], int] = run_suite,
         seeds: random.Random | None = None, say: Callable[[str], None] = print, root: Path = REPO) -> int:
    """Run the suite in ``root`` ``runs`` times beside ``burner_count`` busy loops; write the
    record to ``out`` after each run; 1 if any run failed, else 0."""
    seeds = seeds or random.SystemRandom()
    logs = out.parent / f"{out.stem}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    # (a run's own seeds are its record's python_hash_seed and hypothesis_seed)
    command = " ".join(["PYTHONHASHSEED=H python", *SUITE, "--hypothesis-profile=explore --hypothesis-seed=N",
                        shlex.join(pytest_args)]).rstrip()
    record: dict[str, Any] = {"command": command, "runs_asked": runs, "burners": burner_count, **_provenance(),
                              "runs": [], "failures": {}}
    with burners(burner_count):
        for i in range(1, runs + 1):
            shutil.rmtree(root / ".hypothesis", ignore_errors=True)
            hypothesis_seed, hash_seed = seeds.randrange(2**32), seeds.randrange(2**32)
            junit = logs / f"run-{i:02d}.xml"
            junit.unlink(missing_ok=True)
            cmd = [sys.executable, *SUITE, f"--junitxml={junit}",
                   "--hypothesis-profile=explore", f"--hypothesis-seed={hypothesis_seed}", *pytest_args]
            env = dict(os.environ, PYTHONHASHSEED=str(hash_seed))
            load_before, began = os.getloadavg(), time.monotonic()
            code = runner(cmd, env, logs / f"run-{i:02d}.log", root)
            seconds = round(time.monotonic() - began, 1)
            tests, failed = failures(junit) if junit.is_file() else (0, {})
            if code != 0 and not failed:  # (pytest itself failed: collection, a worker lost, no tests)
                tail = (logs / f"run-{i:02d}.log").read_text(errors="replace")[-KEEP_CHARS:]
                failed = {"(the run itself)": f"pytest exited {code}\n{tail}".strip()}
            record["runs"].append({"index": i, "hypothesis_seed": hypothesis_seed, "python_hash_seed": hash_seed,
                                   "exit_code": code, "seconds": seconds, "tests": tests,
                                   "load_average_before": list(load_before),
                                   "load_average_after": list(os.getloadavg()),
                                   "failures": failed})
            record["failures"] = tally(record["runs"])
            _write(out, record)
            say(f"run {i}/{runs}: {tests} tests, {len(failed)} failed, {seconds} s "
                f"(--hypothesis-seed={hypothesis_seed}, PYTHONHASHSEED={hash_seed}, "
                f"load {load_before[0]:.1f})")
            for test, message in failed.items():
                say(f"  FAILED {test}: {short(message)}")
    for line in report(record["runs"]):
        say(line)
    say(f"soak: record in {out}")
    return 1 if record["failures"] else 0


def _provenance() -> dict[str, Any]:
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    from common import provenance  # (the commit and machine, as a benchmark's raw file records them)

    got = provenance("")
    got.pop("command", None)
    return got


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
    parser.add_argument("--runs", type=int, default=_env_int("SOAK_RUNS", 10))
    parser.add_argument("--burners", type=int, default=_env_int("SOAK_BURNERS", os.cpu_count() or 1))
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ.get("SOAK_OUT") or REPO / "benchmarks" / "results" / "soak.json"))
    parser.add_argument("pytest_args", nargs="*", default=shlex.split(os.environ.get("SOAK_ARGS", "")),
                        help="passed on to pytest (default: SOAK_ARGS, else the whole suite)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.burners < 0:
        parser.error(f"needs --runs >= 1 and --burners >= 0, got {args.runs} and {args.burners}")
    # A stop (make's SIGTERM, a closed terminal) unwinds like Ctrl-C, so the burners are killed.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    try:
        return soak(args.runs, args.burners, args.pytest_args, args.out.resolve())
    except KeyboardInterrupt:
        print("soak: stopped; the record holds the runs that ended", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
