"""The published figures: every rendered block in the docs is what its committed raw results
render, every raw file says how it was made and has repeats, no table in the benchmark pages
stands outside a rendered block, and the staleness test finds a changed source."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import figures  # noqa: E402
from common import ratios, shown, spread, verdict  # noqa: E402


def test_committed_docs_render_from_committed_raw_results():
    problems = figures.check(with_staleness=False)
    assert problems == []


def test_every_figure_has_a_committed_raw_file_and_a_block_on_its_page():
    for fig in figures.FIGURES:
        assert fig.raw_path().exists(), fig.name
        blocks = fig.renderer()(json.loads(fig.raw_path().read_text()))
        page = (REPO / fig.page).read_text()
        for block in blocks:
            assert f"<!-- figure: {block} -->" in page, (fig.name, block)


def test_rendering_replaces_a_hand_edited_block(tmp_path):
    fig = figures.FIGURES[0]
    page = tmp_path / "page.md"
    body = next(iter(fig.renderer()(json.loads(fig.raw_path().read_text())).values()))
    block = next(iter(fig.renderer()(json.loads(fig.raw_path().read_text()))))
    page.write_text(f"# p\n\n<!-- figure: {block} -->\n{body}\n<!-- /figure: {block} -->\n")
    assert figures.apply(page.read_text(), {block: body}) == page.read_text()
    edited = page.read_text().replace(body.splitlines()[-1], body.splitlines()[-1] + " typed by hand")
    assert figures.apply(edited, {block: body}) == page.read_text()


def test_a_table_outside_a_block_is_a_stray():
    text = ("intro\n\n<!-- figure: x -->\n| a | b |\n|---|---|\n| 1 | 2 |\n<!-- /figure: x -->\n\n"
            "| typed | table |\n|---|---|\n")
    assert figures.stray_tables(text) == [9, 10]


def test_a_raw_file_without_provenance_or_with_one_run_is_refused():
    fig = figures.FIGURES[0]
    raw = json.loads(fig.raw_path().read_text())
    assert figures.provenance_problems(fig, raw) == []
    one = dict(raw, repeats=1)
    assert figures.provenance_problems(fig, one) == [
        f"{fig.name}: 1 repeat(s); a published figure needs at least 3"]
    other = dict(raw, command="python benchmarks/elsewhere.py --seeds 1")
    assert figures.provenance_problems(fig, other) == [
        f"{fig.name}: made by `python benchmarks/elsewhere.py --seeds 1`, not by the registry's "
        f"`python {' '.join(fig.command()[1:])}`"]
    elsewhere = dict(raw, command=f"python {' '.join(fig.command()[1:])}".replace(
        f"--json {fig.raw_path().relative_to(REPO)}", "--json /tmp/out/x.json"))
    assert elsewhere["command"] != raw["command"]
    assert figures.provenance_problems(fig, elsewhere) == []  # (where it wrote its file is not what it measured)
    runs_elsewhere = dict(elsewhere, command=elsewhere["command"] + " --out /tmp/runs")
    assert figures.provenance_problems(fig, runs_elsewhere) == []  # (nor where its runs' folders went)
    more_seeds = dict(raw, command=raw["command"] + " --seeds 9")
    assert figures.provenance_problems(fig, more_seeds) != []  # (an argument that changes what it measures counts)
    bare = {k: v for k, v in raw.items() if k not in ("commit", "machine")}
    assert figures.provenance_problems(fig, bare) == [f"{fig.name}: raw results lack 'commit'",
                                                      f"{fig.name}: raw results lack 'machine'"]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_a_raw_file_measured_before_a_change_to_its_sources_is_stale():
    head = _git("rev-parse", "HEAD")
    first = _git("log", "--format=%H", "--diff-filter=A", "--", "benchmarks/figures.py").splitlines()[-1]
    before = _git("rev-parse", f"{first}~1")
    fig = figures.Figure("probe", "heterogeneity_devices", (), (), ("benchmarks/figures.py",), "README.md")
    assert figures.stale(fig, {"commit": head, "changed_files": []}) is None
    why = figures.stale(fig, {"commit": before, "changed_files": []})
    assert why is not None and "changed what it measures" in why
    dirty = figures.stale(fig, {"commit": head, "changed_files": ["benchmarks/figures.py", "README.md"]})
    assert dirty == "measured uncommitted or changing code: benchmarks/figures.py"
    assert figures.stale(fig, {"commit": head, "changed_files": ["README.md"]}) is None
    assert figures.stale(fig, {"commit": "0" * 40}).startswith("measured commit 0000000000")


def test_a_figure_that_measures_a_gpu_is_skipped_in_one_line_without_one(monkeypatch, capsys):
    monkeypatch.setattr(figures, "_has_gpu", lambda: False)
    monkeypatch.setattr(figures.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    assert figures.run(["allreduce_vs_ddp-gpu"], quick=True) == 0
    assert capsys.readouterr().out == ("== allreduce_vs_ddp-gpu: skipped: it measures a CUDA GPU and none is "
                                       "visible here (make gpu)\n")


def test_run_stale_goes_on_where_a_run_stopped_and_a_by_name_figure_runs_only_when_named(monkeypatch, capsys):
    fresh, old, once = (figures.Figure(n, "heterogeneity_devices", (), (), ("benchmarks/figures.py",), "README.md",
                                       by_name_only="scored once" if n == "once" else "")
                        for n in ("fresh", "old", "once"))
    raws = {"fresh": {"commit": _git("rev-parse", "HEAD"), "changed_files": []}, "old": None}
    ran = []
    monkeypatch.setattr(figures, "FIGURES", [fresh, old, once])
    monkeypatch.setattr(figures, "BY_NAME", {f.name: f for f in (fresh, old, once)})
    monkeypatch.setattr(figures, "load_raw", lambda fig: raws.get(fig.name))
    monkeypatch.setattr(figures, "render_docs", lambda write: [])
    real_run = subprocess.run

    def fake_run(cmd, **kw):  # (git answers; a benchmark is only noted)
        if cmd[0] != sys.executable:
            return real_run(cmd, **kw)
        ran.append(cmd[-1])
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(figures.subprocess, "run", fake_run)
    assert figures.run([], quick=False, stale_only=True) == 0
    out = capsys.readouterr().out
    assert ran == ["docs/benchmarks/raw/old.json"]  # (no raw file: missing counts as stale)
    assert f"== fresh: current ({raws['fresh']['commit'][:10]}): not run" in out
    assert "== once: skipped: scored once (figures.py run once)" in out
    ran.clear()
    assert figures.run(["once"], quick=False) == 0 and ran == ["docs/benchmarks/raw/once.json"]
    ran.clear()
    assert figures.run([], quick=False) == 0  # (make figures: every one but those run by name)
    assert ran == ["docs/benchmarks/raw/fresh.json", "docs/benchmarks/raw/old.json"]


def test_spread_and_verdict_by_hand():
    assert spread([3.0, None, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert shown([1.0, 2.0, 4.0], "{:.1f}", "x") == "2.0x (1.0-4.0)"
    assert shown([2.0, None, 4.0], "{:.1f}") == "3.0 (2.0-4.0), 2 of 3"
    assert shown([None]) == "-"
    assert ratios({"1": 10.0, "2": 6.0, "3": None}, {"1": 5.0, "2": 4.0, "3": 1.0}) == [2.0, 1.5, None]
    assert verdict([1.2, 1.5]) == "above"
    assert verdict([0.8, 0.95]) == "below"
    assert verdict([0.9, 1.1]) == "within the spread"


@pytest.mark.slow
def test_quick_figures_run_writes_provenance_and_renders(tmp_path):
    """A smoke run of one figure (2 workers, one seed): the raw file says how it was made."""
    done = subprocess.run([sys.executable, "benchmarks/figures.py", "run", "--quick", "heterogeneity_devices"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    fig = figures.BY_NAME["heterogeneity_devices"]
    raw = json.loads(fig.raw_path(quick=True).read_text())
    assert set(figures.PROVENANCE) <= set(raw)
    assert raw["repeats"] == 1 and raw["seeds"] == [1]
    assert raw["commit"] == _git("rev-parse", "HEAD")
    assert raw["machine"]["cpu_count"] >= 1 and raw["machine"]["torch"]
    table = fig.renderer()(raw)["heterogeneity_devices"]
    assert "| 2 | one 3x slow | `ripples:smart` |" in table


def test_the_readme_quotes_recommend_only_from_a_test_set():
    from which_solver import _recommend

    summary = {"hits": 7, "scenarios": 10, "hit_share": 0.7, "best_fixed": "ad-psgd",
               "always": {"ad-psgd": {"hits": 6}}}
    raw = {"set": "test", "tolerance": 0.1, "seeds": [1, 2], "summary": summary, "declared": {"workers": [4, 8]}}
    assert _recommend(raw).endswith("hit (within the measured best's spread or 10%) in 7 of 10 drawn scenarios "
                                    "of 4-8 workers (70%; out of sample, emulated devices and links, 2 seeds "
                                    "each), always-ad-psgd with its defaults in 6")
    assert "hit" not in _recommend({**raw, "set": "dev"}) and "hit" not in _recommend(None)


def test_provenance_compares_the_working_tree_with_head_not_the_index(tmp_path):
    from common import provenance

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("one\n")
    git("add", "a.py")
    git("commit", "-qm", "one")
    (tmp_path / "a.py").write_text("two\n")
    (tmp_path / "b.py").write_text("new\n")
    git("add", "a.py", "b.py")
    git("commit", "-qm", "two")
    git("read-tree", "HEAD~1")  # (an index older than HEAD, as a copy of the tree at HEAD may carry)
    clean = provenance("x.py", [], repo=tmp_path)
    assert (clean["dirty"], clean["changed_files"]) == (False, [])
    (tmp_path / "a.py").write_text("three\n")
    dirty = provenance("x.py", [], repo=tmp_path)
    assert (dirty["dirty"], dirty["changed_files"]) == (True, ["a.py"])
