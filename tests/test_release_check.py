"""`make release-check`'s own logic (benchmarks/release_check.py): which README commands it
runs, which figures it lets stay at another commit, and how a failed step reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import figures  # noqa: E402
import release_check  # noqa: E402


def test_the_readmes_first_train_and_compare_lines_are_the_commands_it_runs():
    lines = [ln.split(" #")[0].split() for ln in (REPO / "README.md").read_text().splitlines()
             if ln.startswith("    distsync ")]
    first = {words[1]: words[1:] for words in reversed(lines)}
    assert release_check.readme_commands() == {"train": first["train"], "compare": first["compare"]}


def test_only_the_gpu_figures_and_the_test_sets_scored_once_may_stay_stale(monkeypatch):
    base = dict(script="x", args=(), quick=(), sources=(), page="docs/x.md")
    figs = [figures.Figure("gpu", needs_gpu=True, **base), figures.Figure("set", scored_once=True,
                                                                          by_name_only="scored once", **base),
            figures.Figure("soak", by_name_only="hours", **base), figures.Figure("plain", **base),
            figures.Figure("fresh", **base), figures.Figure("release_check", **base)]
    monkeypatch.setattr(figures, "FIGURES", figs)
    monkeypatch.setattr(figures, "load_raw", lambda fig: None if fig.name == "plain" else {"commit": "c"})
    monkeypatch.setattr(figures, "stale", lambda fig, raw: None if fig.name == "fresh" else "changed: a.py")
    assert release_check.stale_figures() == {
        "stale": ["soak: changed: a.py", "plain: not measured"],
        "exceptions": ["gpu: a GPU figure", "set: a test set scored once"]}


def _raw(ok_install: bool) -> dict:
    inst = {"ok": ok_install, "step": "pip install the wheel", "rc": 0 if ok_install else 1, "seconds": 40.0,
            "tail": ["ERROR: No matching distribution found for scikit-learn"], "torch_after": "2.15.0+cu132"}
    runs = [{"step": "distsync --version", "ok": True, "rc": 0, "seconds": 1.0, "tail": ["distsync 0.2.0"]}]
    return {"version": "0.2.0", "commit": "a" * 40, "dirty": False, "date": "2026-11-29T20:00:00",
            "machine": {"cpu_count": 2, "python": "3.11.7"}, "regime": "r", "ok": ok_install,
            "build": {"ok": True, "files": ["distsync-0.2.0-py3-none-any.whl"]},
            "installs": [{"torch": "2.15.0", "install": inst, "runs": runs if ok_install else [], "ok": ok_install}],
            "figures": {"stale": [], "exceptions": ["gpu: a GPU figure"]}}


@pytest.mark.parametrize("ok", [True, False])
def test_a_failed_step_reads_as_failed_with_its_last_line(ok):
    text = release_check.render(_raw(ok))
    assert ("The check: **passed**." in text) is ok and ("The check: **failed**." in text) is not ok
    if ok:
        assert "| torch 2.15.0 | wheel `[workloads]` over it | kept 2.15.0+cu132 | 40 |" in text
        assert "|  | `distsync --version` | ran | 1 |" in text
    else:
        assert ("| torch 2.15.0 | wheel `[workloads]` over it | **pip install the wheel: exit 1** ERROR: No matching "
                "distribution found for scikit-learn | 40 |") in text
    assert "- Figures not current at this commit: none." in text
    assert "- Exceptions, labelled on their pages: gpu: a GPU figure." in text
