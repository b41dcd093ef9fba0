"""distsync beside another torch than the one `make` pins (docs/torch-versions.md).

    python benchmarks/torch_versions.py --torch 2.15.0 --json docs/benchmarks/raw/torch_versions-2.15.json

Method, raw results and figures: docs/torch-versions.md.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from common import argument_parser, provenance, write_results
from distsync.experiments.report import markdown_table

REPO = Path(__file__).resolve().parent.parent

#: one solver of each family (docs/solvers.md), each as a short train of 2 workers on digits
FAMILIES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("gradient all-reduce", "allreduce", ()),
    ("torch's DDP", "ddp", ()),
    ("model averaging", "diloco", ()),
    ("synchronous elastic", "sync-easgd", ()),
    ("parameter servers", "async-ps", ()),
    ("elastic with a center", "ea-wild", ()),
    ("decentralized", "ad-psgd", ()),
    ("decentralized", "ripples", ()),
    ("ShadowSync", "shadow-ma", ()),
    ("embedding servers", "async-ps", ("--workload", "ctr", "--embedding-servers", "1", "-w", "rows=4000")),
)
TRAIN_STEPS = 40
#: the longest a short train may take before it counts as a failure (a hang)
TRAIN_TIMEOUT_S = 180
SUITE_TIMEOUT_S = 1800


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """``cmd``'s exit status (124: timed out), its output (both streams) and its seconds."""
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
        return done.returncode, done.stdout + done.stderr, time.monotonic() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out, time.monotonic() - t0


def _torch_of(python: Path) -> str | None:
    rc, out, _ = _run([str(python), "-c", "import torch; print(torch.__version__)"], 300)
    return out.strip().splitlines()[-1] if rc == 0 and out.strip() else None


def install(version: str, venv: Path) -> dict[str, Any]:
    """torch ``version`` in ``venv``, then distsync over it through constraints.txt less the
    lines that pin torch itself (the user's torch stays); what pip did to torch."""
    python = venv / "bin" / "python"
    if not python.exists():
        rc, out, _ = _run([sys.executable, "-m", "venv", str(venv)], 300)
        if rc != 0:
            raise SystemExit(f"error: could not make the venv {venv}: {out.strip()[-500:]}")
    before = _torch_of(python)
    if before != version and (before or "").split("+")[0] != version:
        print(f"-- installing torch=={version} into {venv} (PyPI's build: several GB)")
        rc, out, secs = _run([str(python), "-m", "pip", "install", "--quiet", f"torch=={version}"], 3600)
        if rc != 0:
            raise SystemExit(f"error: pip could not install torch=={version}: {out.strip().splitlines()[-1:]}")
        before = _torch_of(python)
    print(f"-- torch {before}: installing distsync over it (pip install -c constraints.txt less torch -e .[test,workloads])")
    with tempfile.TemporaryDirectory() as tmp:
        cons = Path(tmp) / "constraints-without-torch.txt"
        lines = (REPO / "constraints.txt").read_text().splitlines()
        cons.write_text("\n".join(ln for ln in lines if not re.match(r"\s*torch\s*(==|$)", ln)) + "\n")
        rc, out, secs = _run([str(python), "-m", "pip", "install", "-c", str(cons), "-e", ".[test,workloads]"], 3600)
    after = _torch_of(python)
    touched = [ln.strip() for ln in out.splitlines() if re.search(r"(Uninstalling|Attempting uninstall): torch\b", ln)]
    return {"torch_before": before, "torch_after": after, "pip_rc": rc, "pip_touched_torch": touched,
            "kept": rc == 0 and before == after and not touched, "pip_seconds": round(secs, 1)}


def private_names(python: Path) -> dict[str, Any]:
    """Which of distsync's private names of torch this torch has, and the start check's word."""
    code = ("import json, torch; from distsync import torch_private as tp; "
            "print(json.dumps({'missing': tp.missing(), 'refusal': tp.start_refusal(), "
            "'supported': tp.SUPPORTED}))")
    rc, out, _ = _run([str(python), "-c", code], 300)
    if rc != 0:
        return {"error": out.strip().splitlines()[-1] if out.strip() else f"exit {rc}"}
    return json.loads(out.strip().splitlines()[-1])


def fast_suite(python: Path, junit: Path) -> dict[str, Any]:
    """The tests not marked slow or cuda, as ``make test`` runs them (two processes)."""
    print("-- the fast suite (pytest -m 'not slow and not cuda')")
    rc, out, secs = _run([str(python), "-m", "pytest", "-q", "-n", "2", "-m", "not slow and not cuda",
                          "-p", "no:cacheprovider", "--junitxml", str(junit)], SUITE_TIMEOUT_S)
    result: dict[str, Any] = {"rc": rc, "seconds": round(secs, 1)}
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        total, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        failed = [f"{case.get('classname', '')}::{case.get('name')}" for case in suite.iter("testcase")
                  if case.find("failure") is not None or case.find("error") is not None]
        result.update(passed=total - failures - errors - skipped, failed=failures + errors, skipped=skipped,
                      failed_tests=failed)
    else:
        result["tail"] = out[-2000:]
    return result


def short_trains(python: Path, out_dir: Path) -> list[dict[str, Any]]:
    """``distsync train --workers 2 --steps 40`` of one solver of each family."""
    rows = []
    for family, solver, extra in FAMILIES:
        run_dir = out_dir / f"{solver}{'-ctr' if 'ctr' in extra else ''}"
        cmd = [str(python), "-m", "distsync.cli", "train", "--solver", solver, "--workers", "2", "--steps",
               str(TRAIN_STEPS), *extra, "--out", str(run_dir), "--overwrite"]
        rc, out, secs = _run(cmd, TRAIN_TIMEOUT_S)
        summary = run_dir / "summary.json"
        metric = json.loads(summary.read_text()).get("final_metric") if rc == 0 and summary.exists() else None
        warnings = sorted({m.group(1) for m in re.finditer(r"(\w*Warning): ", out)})
        rows.append({"family": family, "solver": solver, "args": " ".join(extra), "rc": rc,
                     "seconds": round(secs, 1), "final_metric": metric, "warnings": warnings,
                     "error": "" if rc == 0 else (out.strip().splitlines() or [""])[-1][:300]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--torch", required=True, help="the torch version to install beside (e.g. 2.15.0)")
    parser.add_argument("--venv", default=None, help="its venv (default: .venv-torch-VERSION)")
    parser.add_argument("--json", default=None, help="the raw results file (default: "
                                                     "docs/benchmarks/raw/torch_versions-MAJOR.MINOR.json)")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?", args.torch):
        parser.error(f"--torch {args.torch!r}: give a release, e.g. 2.15.0")
    major_minor = ".".join(args.torch.split(".")[:2])
    venv = Path(args.venv or REPO / f".venv-torch-{args.torch}")
    raw_path = Path(args.json or REPO / "docs" / "benchmarks" / "raw" / f"torch_versions-{major_minor}.json")
    record = provenance("benchmarks/torch_versions.py", argv)
    inst = install(args.torch, venv)
    python = venv / "bin" / "python"
    names = private_names(python)
    with tempfile.TemporaryDirectory(prefix="distsync-torch-") as tmp:
        suite = fast_suite(python, Path(tmp) / "junit.xml")
        print(f"-- a short train per family ({TRAIN_STEPS} steps, 2 workers)")
        trains = short_trains(python, Path(tmp) / "runs")
    record["machine"]["torch"] = inst["torch_after"]
    payload = {**record, "regime": "real CPU run, loopback (2 workers)", "seeds": [0], "repeats": 1,
               "torch": args.torch, "install": inst, "private_names": names, "suite": suite, "trains": trains}
    print(render(payload))
    write_results(raw_path, payload)
    ok = inst["kept"] and all(t["rc"] == 0 for t in trains) and suite.get("failed") == 0
    return 0 if ok else 1


def render(raw: dict[str, Any]) -> str:
    inst, names, suite, trains = raw["install"], raw["private_names"], raw["suite"], raw["trains"]
    lines = [f"torch {inst['torch_after']}, measured at `{raw['commit'][:10]}` on {raw['date'][:10]} "
             f"({raw['machine']['cpu_count']} cores, Python {raw['machine']['python']}). "
             f"Regime: {raw['regime']}.", ""]
    kept = ("kept: pip changed nothing of it" if inst["kept"]
            else f"**changed**: {inst['torch_before']} became {inst['torch_after']} {inst['pip_touched_torch']}")
    lines.append(f"- `pip install -e .[test,workloads]` over torch {inst['torch_before']}: {kept}.")
    if "error" in names:
        lines.append(f"- Private names: could not be read ({names['error']}).")
    else:
        gone = ", ".join(f"`{n}`" for n in names["missing"]) or "none"
        lines.append(f"- Private names this torch lacks: {gone}; the start check: "
                     f"{'refused: ' + names['refusal'] if names['refusal'] else 'runs'}.")
    if "passed" in suite:
        failed = "; ".join(f"`{t}`" for t in suite["failed_tests"][:8])
        lines.append(f"- Fast suite (`-m 'not slow and not cuda'`): {suite['passed']} passed, {suite['failed']} "
                     f"failed, {suite['skipped']} skipped, {suite['seconds']:.0f} s{': ' + failed if failed else ''}.")
    else:
        lines.append(f"- Fast suite: exit {suite['rc']} without a report.")
    rows = [[t["family"], f"`{t['solver']}{' ' + t['args'] if t['args'] else ''}`",
             "ran" if t["rc"] == 0 else f"**exit {t['rc']}**: {t['error']}",
             f"{t['final_metric']:.3f}" if isinstance(t["final_metric"], (int, float)) else "-",
             f"{t['seconds']:.0f}", ", ".join(t["warnings"]) or "-"] for t in trains]
    lines += ["", *markdown_table(["family", "solver", f"train ({TRAIN_STEPS} steps, 2 workers)", "final metric", "s",
                                   "warnings"], rows)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
