"""The release check (docs/release.md): the package as users get it, not the source tree.

    python benchmarks/release_check.py [--torch 2.13.0,2.15.0] [--reuse-venvs] [--json docs/benchmarks/raw/release_check.json]

1. Builds the sdist and the wheel (``python -m build``) and runs ``twine check`` on them.
2. For each torch: a fresh venv with that torch alone (the user's), then the wheel with its
   ``workloads`` extra over it; pip must leave that torch as it was (no downgrade).
3. From a folder outside the source tree, with nothing of it on the path: ``distsync
   --version`` (the sources' version), ``distsync list``, and the README's first ``distsync
   train`` and ``distsync compare`` commands.
4. Every published figure current at this commit but the labelled exceptions (the GPU
   figures, measured where a GPU was lent, and the test sets scored once at their own commit).

Exits 1 when any step fails. Installing a torch from PyPI downloads its CUDA build (several
GB) once; pip's cache keeps it. ``--reuse-venvs`` keeps each venv's torch from the last check.
Regime: one machine, real CPU runs on loopback (the README's commands as they are).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import argument_parser, provenance, write_results
from distsync.experiments.report import markdown_table

REPO = Path(__file__).resolve().parent.parent
TORCHES = ("2.13.0", "2.15.0")
WORK = REPO / "build" / "release"
#: the longest one step may take before it counts as failed (a hang)
STEP_TIMEOUT_S = 900
#: the longest a torch's install may take (its first download is several GB)
INSTALL_TIMEOUT_S = 3600
REGIME = "one machine, real CPU runs on loopback (the README's commands as they are)"


def _run(cmd: list[str], cwd: Path, timeout: float = STEP_TIMEOUT_S,
         env: dict[str, str] | None = None, whole: bool = False) -> dict[str, Any]:
    """``cmd``'s exit status (124: timed out), its last lines of output and its seconds
    (``whole``: its whole output too, as ``output``)."""
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "") + "\n(timed out)"
    except OSError as e:
        rc, out = 127, str(e)
    return {"command": " ".join(shlex.quote(c) for c in cmd), "rc": rc, "seconds": round(time.monotonic() - t0, 1),
            "tail": out.strip().splitlines()[-12:], **({"output": out} if whole else {})}


def source_version() -> str:
    text = (REPO / "src" / "distsync" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


def readme_commands() -> dict[str, list[str]]:
    """The README's first ``distsync train`` and ``distsync compare`` lines of its quick start
    (an indented block), as argument lists without the ``distsync``."""
    found: dict[str, list[str]] = {}
    for line in (REPO / "README.md").read_text().splitlines():
        words = shlex.split(line.split(" #")[0], posix=True) if line.startswith("    distsync ") else []
        if len(words) > 1 and words[1] in ("train", "compare") and words[1] not in found:
            found[words[1]] = words[1:]
    missing = {"train", "compare"} - set(found)
    if missing:
        raise SystemExit(f"error: README.md has no indented `distsync {' / '.join(sorted(missing))}` line to run")
    return found


def build(dist: Path, python: str) -> dict[str, Any]:
    """The sdist and the wheel, and ``twine check`` on both."""
    shutil.rmtree(dist, ignore_errors=True)
    made = _run([python, "-m", "build", "--sdist", "--wheel", "--outdir", str(dist), str(REPO)], REPO)
    files = sorted(p.name for p in dist.glob("*")) if dist.exists() else []
    twine = _run([python, "-m", "twine", "check", "--strict", *map(str, sorted(dist.glob("*")))], REPO) if files \
        else {"rc": 1, "tail": ["nothing was built"], "seconds": 0.0, "command": "twine check"}
    return {"build": made, "files": files, "twine": twine, "ok": made["rc"] == 0 and twine["rc"] == 0
            and any(f.endswith(".whl") for f in files) and any(f.endswith(".tar.gz") for f in files)}


def _torch_of(python: Path) -> str | None:
    got = _run([str(python), "-c", "import torch; print(torch.__version__)"], WORK, 300)
    return got["tail"][-1] if got["rc"] == 0 and got["tail"] else None


def install(torch: str, venv: Path, wheel: Path, reuse: bool) -> dict[str, Any]:
    """A venv with torch ``torch`` alone, then the wheel (``[workloads]``) over it."""
    python = venv / "bin" / "python"
    if not reuse or (_torch_of(python) or "").split("+")[0] != torch:
        shutil.rmtree(venv, ignore_errors=True)
        made = _run([sys.executable, "-m", "venv", str(venv)], WORK, 300)
        if made["rc"] != 0:
            return {"ok": False, "step": "venv", **made}
        got = _run([str(python), "-m", "pip", "install", "--quiet", f"torch=={torch}"], WORK, INSTALL_TIMEOUT_S)
        if got["rc"] != 0:
            return {"ok": False, "step": f"pip install torch=={torch}", **got}
    else:
        _run([str(python), "-m", "pip", "uninstall", "--yes", "distsync"], WORK, 300)
    before = _torch_of(python)
    got = _run([str(python), "-m", "pip", "install", f"{wheel}[workloads]"], WORK, INSTALL_TIMEOUT_S, whole=True)
    after = _torch_of(python)
    output = got.pop("output")
    touched = [ln.strip() for ln in output.splitlines() if re.search(r"(Uninstalling|Attempting uninstall): torch\b", ln)]
    return {"ok": got["rc"] == 0 and before == after and not touched, "step": "pip install the wheel",
            "torch_before": before, "torch_after": after, "pip_touched_torch": touched, **got}


def outside(venv: Path, commands: dict[str, list[str]], version: str) -> list[dict[str, Any]]:
    """The installed command, run from an empty folder with nothing of the source tree on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    exe = str(venv / "bin" / "distsync")
    rows = []
    with tempfile.TemporaryDirectory(prefix="distsync-release-") as tmp:
        where = _run([str(venv / "bin" / "python"), "-c", "import distsync; print(distsync.__file__)"], Path(tmp),
                     env=env)
        from_venv = where["rc"] == 0 and where["tail"][-1].startswith(str(venv))
        rows.append({"step": "imported from the venv", **where, "ok": from_venv})
        got = _run([exe, "--version"], Path(tmp), env=env)
        rows.append({"step": "distsync --version", **got,
                     "ok": got["rc"] == 0 and got["tail"] == [f"distsync {version}"]})
        got = _run([exe, "list"], Path(tmp), env=env)
        rows.append({"step": "distsync list", **got, "ok": got["rc"] == 0})
        for name in ("train", "compare"):
            got = _run([exe, *commands[name]], Path(tmp), env=env)
            rows.append({"step": "distsync " + " ".join(commands[name]), **got, "ok": got["rc"] == 0})
    return rows


def stale_figures() -> dict[str, list[str]]:
    """The figures not current at this commit, and the exceptions (labelled on their pages)."""
    import figures

    out: dict[str, list[str]] = {"stale": [], "exceptions": []}
    for fig in figures.FIGURES:
        if fig.name == "release_check":
            continue
        raw = figures.load_raw(fig)
        why = "not measured" if raw is None else figures.stale(fig, raw)
        if why is None:
            continue
        label = "a GPU figure" if fig.needs_gpu else "a test set scored once" if fig.scored_once else ""
        out["exceptions" if label else "stale"].append(f"{fig.name}: {label or why}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--torch", default=",".join(TORCHES), help="the torch releases to install beside")
    parser.add_argument("--reuse-venvs", action="store_true",
                        help="keep each venv's torch from the last check (the wheel is installed afresh)")
    parser.add_argument("--json", default=str(REPO / "docs" / "benchmarks" / "raw" / "release_check.json"))
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)
    torches = [t.strip() for t in args.torch.split(",") if t.strip()]
    if not torches or not all(re.fullmatch(r"\d+\.\d+\.\d+", t) for t in torches):
        parser.error(f"--torch {args.torch!r}: give releases, e.g. 2.13.0,2.15.0")
    record = provenance("benchmarks/release_check.py", argv)
    version, commands = source_version(), readme_commands()
    WORK.mkdir(parents=True, exist_ok=True)
    print("-- building the sdist and the wheel")
    built = build(WORK / "dist", sys.executable)
    installs = []
    wheels = sorted((WORK / "dist").glob("distsync-*.whl"))
    for torch in torches if wheels else []:
        print(f"-- torch {torch}: a fresh venv, the wheel over it, the README's commands from outside the tree")
        inst = install(torch, WORK / f"venv-torch-{torch}", wheels[-1], args.reuse_venvs)
        runs = outside(WORK / f"venv-torch-{torch}", commands, version) if inst["ok"] else []
        installs.append({"torch": torch, "install": inst, "runs": runs,
                         "ok": inst["ok"] and bool(runs) and all(r["ok"] for r in runs)})
    figures_state = stale_figures()
    ok = built["ok"] and len(installs) == len(torches) and all(i["ok"] for i in installs) \
        and not figures_state["stale"]
    payload = {**record, "regime": REGIME, "seeds": [0], "repeats": 1, "version": version, "ok": ok,
               "build": built, "installs": installs, "figures": figures_state}
    print(render(payload))
    write_results(args.json, payload)
    return 0 if ok else 1


def _word(ok: bool) -> str:
    return "passed" if ok else "**failed**"


def render(raw: dict[str, Any]) -> str:
    built, figs = raw["build"], raw["figures"]
    lines = [f"distsync {raw['version']}, checked at `{raw['commit'][:10]}`{' (a tree that differed)' if raw['dirty'] else ''}"
             f" on {raw['date'][:10]} ({raw['machine']['cpu_count']} cores, Python {raw['machine']['python']}). "
             f"Regime: {raw['regime']}. The check: **{_word(raw['ok']).strip('*')}**.", ""]
    lines.append(f"- Build (`python -m build`, `twine check --strict`): {_word(built['ok'])}: "
                 f"{', '.join(f'`{f}`' for f in built['files']) or 'nothing built'}.")
    rows = []
    for i in raw["installs"]:
        inst = i["install"]
        kept = (f"kept {inst['torch_after']}" if inst["ok"] else
                f"**{inst.get('step')}: exit {inst['rc']}** {(inst.get('tail') or [''])[-1][:160]}")
        rows.append([f"torch {i['torch']}", "wheel `[workloads]` over it", kept, f"{inst['seconds']:.0f}"])
        for r in i["runs"]:
            rows.append(["", f"`{r['step']}`", "ran" if r["ok"] else f"**exit {r['rc']}**: "
                         f"{(r['tail'] or [''])[-1][:160]}", f"{r['seconds']:.0f}"])
    lines += ["", *markdown_table(["venv", "step (from a folder outside the source tree)", "result", "s"], rows), ""]
    stale = "; ".join(figs["stale"]) or "none"
    lines.append(f"- Figures not current at this commit: {stale}.")
    if figs["exceptions"]:
        lines.append(f"- Exceptions, labelled on their pages: {'; '.join(figs['exceptions'])}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
