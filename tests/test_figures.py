"""The published figures: every rendered block in the docs is what its committed raw results
render, every raw file says how it was made and has repeats, no table in the benchmark pages
stands outside a rendered block, and a figure is stale exactly when a file its run imported
changed what it does (its blocks then say so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import figures  # noqa: E402
from distsync.metrics.repeats import ratios, shown, spread, verdict
from helpers import run_cli  # noqa: E402


def test_committed_docs_render_from_committed_raw_results():
    problems = figures.check(with_staleness=False)
    assert problems == []


def test_every_figure_has_a_committed_raw_file_and_a_block_on_its_page():
    for fig in figures.FIGURES:
        page = (REPO / fig.page).read_text()
        if not fig.raw_path().exists():  # (only one run by name only, or on a GPU, its block saying so)
            assert fig.by_name_only or fig.needs_gpu, fig.name
            assert f"<!-- figure: {fig.name} -->\n{figures.NOT_MEASURED}" in page, fig.name
            continue
        blocks = fig.renderer()(json.loads(fig.raw_path().read_text()))
        for block in blocks:
            assert f"<!-- figure: {block} -->" in page, (fig.name, block)


def test_a_figure_run_by_name_only_without_raw_results_says_it_is_not_measured_yet(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("<!-- figure: once -->\n<!-- /figure: once -->\n")
    (tmp_path / "README.md").write_text("# r\n")
    once = figures.Figure("once", "x", ("--runs", "10"), (), ("a.py",), "page.md", by_name_only="hours")
    other = figures.Figure("every", "x", (), (), ("a.py",), "page.md")
    monkeypatch.setattr(figures, "REPO", tmp_path)
    monkeypatch.setattr(figures, "RAW", tmp_path / "raw")
    monkeypatch.setattr(figures, "FIGURES", [once])
    monkeypatch.setitem(sys.modules, "which_solver", SimpleNamespace(render=lambda raws: None))
    assert figures.check() == ["page.md: block(s) once differ from what the raw results render "
                               "(python benchmarks/figures.py render)"]
    assert figures.render_docs(write=True) == [] and figures.check() == []
    assert page.read_text() == ("<!-- figure: once -->\n> Not measured yet: no raw results (raw/once.json). Run by "
                                "name only (hours): `python benchmarks/figures.py run once`.\n<!-- /figure: once -->\n")
    monkeypatch.setattr(figures, "FIGURES", [once, other])  # (one that make figures runs: its raw file is due)
    assert figures.check() == ["every: no raw results (raw/every.json); run: python benchmarks/figures.py run every"]


SOAK_RAW = {"command": "python tools/soak.py --runs 10 --json docs/benchmarks/raw/soak.json", "commit": "a" * 40,
            "dirty": False, "date": "D", "machine": {"cpu_count": 2, "torch": "T"}, "runs_asked": 10,
            "regime": "the whole suite, pytest -n 2, beside 2 busy loops on 2 cores"}


def _soak_run(index, commit, exit_code, seconds, tests, skipped, load, failures):
    return {"index": index, "commit": commit * 40, "hypothesis_seed": 10 + index, "python_hash_seed": 20 + index,
            "exit_code": exit_code, "seconds": seconds, "tests": tests, "skipped": skipped,
            "load_average_before": [load[0], 0.0, 0.0], "load_average_after": [load[1], 0.0, 0.0],
            "failures": failures}


def test_the_soaks_tables_by_hand():
    long = "OSError: " + "p" * 121  # (130 characters: cut at 120)
    runs = [_soak_run(1, "a", 1, 1500.0, 100, 3, (3.9, 4.2), {"tests/test_a.py::test_x": "assert `a` | b == 2\nE  more",
                                                              "tests/test_a.py::test_y (error)": long + "\nmore"}),
            _soak_run(2, "b", 0, 1470.0, 100, 3, (4.2, 4.0), {}),
            _soak_run(3, "b", 5, 6.0, 0, 0, (4.0, 4.04), {"(the run itself)": "pytest exited 5\ntail"}),
            _soak_run(4, "b", 0, 1530.0, 100, 3, (4.0, 4.1), {})]
    failures = {"(the run itself)": {"count": 1, "runs": [3], "messages": ["pytest exited 5\ntail"]},
                "tests/test_a.py::test_x": {"count": 1, "runs": [1], "messages": ["assert `a` | b == 2\nE  more"]},
                "tests/test_a.py::test_y (error)": {"count": 1, "runs": [1], "messages": [long + "\nmore"]}}
    render = figures.BY_NAME["soak"].renderer()
    assert render({**SOAK_RAW, "runs": runs, "failures": failures})["soak"].split("\n") == [
        "`python tools/soak.py --runs 10 --json docs/benchmarks/raw/soak.json` at commit aaaaaaaaaa, 2 cores, "
        "torch T, D; 4 of 10 runs. Regime: the whole suite, pytest -n 2, beside 2 busy loops on 2 cores.", "",
        "| run | commit | `--hypothesis-seed` | `PYTHONHASHSEED` | passed | failed | minutes | load before / after |",
        "|---|---|---|---|---|---|---|---|",
        "| 1 | aaaaaaaaaa | 11 | 21 | 95 | 2 | 25.0 | 3.9 / 4.2 |",
        "| 2 | bbbbbbbbbb | 12 | 22 | 97 | 0 | 24.5 | 4.2 / 4.0 |",
        "| 3 | bbbbbbbbbb | 13 | 23 | 0 | the run (pytest exited 5) | 0.1 | 4.0 / 4.0 |",
        "| 4 | bbbbbbbbbb | 14 | 24 | 97 | 0 | 25.5 | 4.0 / 4.1 |", "",
        "| test | runs failed in | first line of its failure |", "|---|---|---|",
        "| `(the run itself)` | 1 of 4 (runs 3) | `pytest exited 5` |",
        "| `tests/test_a.py::test_x` | 1 of 4 (runs 1) | `assert 'a' \\| b == 2` |",
        "| `tests/test_a.py::test_y (error)` | 1 of 4 (runs 1) | `OSError: " + "p" * 110 + "…` |", "",
        "1 consecutive green runs at the end (target 10).", ""]
    green = render({**SOAK_RAW, "dirty": True, "runs": [runs[1], runs[3]], "failures": {}})["soak"].split("\n")
    assert green[0].startswith("`python tools/soak.py --runs 10 --json docs/benchmarks/raw/soak.json` at commit "
                               "aaaaaaaaaa, with uncommitted changes, 2 cores, torch T, D; 2 of 10 runs.")
    assert green[-4:] == ["No test failed in any run.", "", "2 consecutive green runs at the end (target 10).", ""]


def test_a_soak_of_the_whole_suite_as_make_runs_it_is_the_registrys_command():
    sys.path.insert(0, str(REPO / "tools"))
    import soak

    fig = figures.BY_NAME["soak"]
    made = soak.command(soak.DEFAULT_RUNS, os.cpu_count(), [], soak.PUBLISHED)
    assert made == "python tools/soak.py --runs 10 --json docs/benchmarks/raw/soak.json"
    raw = {**SOAK_RAW, "command": made, "seeds": [{"hypothesis": 1, "python_hash": 2}] * 3, "repeats": 3}
    assert figures.provenance_problems(fig, raw) == []
    assert figures.provenance_problems(fig, {**raw, "command": soak.command(10, 2, ["tests/test_rules.py"],
                                                                             soak.PUBLISHED)}) == [
        "soak: made by `python tools/soak.py --runs 10 tests/test_rules.py --json docs/benchmarks/raw/soak.json`, "
        "not by the registry's `python tools/soak.py --runs 10 --json docs/benchmarks/raw/soak.json`"]


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


def _git_in(folder):
    """``git ARGS`` in ``folder`` (its output), with a committer of its own."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              check=True, capture_output=True, text=True).stdout.strip()

    return git


def _repo(tmp_path, monkeypatch):
    """A git repository standing in for this one (figures reads REPO at each call)."""
    git = _git_in(tmp_path)
    monkeypatch.setattr(figures, "REPO", tmp_path)
    git("init", "-q")
    return git


CODE = 'def f(x):\n    """Twice x."""\n    return 2 * x  # doubled\n'


def test_syntax_hash_counts_what_the_code_does_not_its_comments_or_docstrings():
    from common import syntax_hash

    base = syntax_hash(CODE, "a.py")
    assert syntax_hash('"""A module."""\n\n\ndef f(x):\n    # no docstring\n    return 2 * x\n', "a.py") == base
    assert syntax_hash(CODE.replace("2 * x", "3 * x"), "a.py") != base
    assert syntax_hash(CODE.replace("2 * x", "(2 * x)"), "a.py") == base  # (the same tree)
    assert syntax_hash(CODE, "a.txt") != syntax_hash(CODE + "# more\n", "a.txt")  # (not Python: its bytes)


def test_a_figure_is_stale_only_when_a_file_its_run_imported_changed_what_it_does(tmp_path, monkeypatch):
    from common import source_hash

    git = _repo(tmp_path, monkeypatch)
    (tmp_path / "a.py").write_text(CODE)
    (tmp_path / "b.py").write_text("y = 1\n")
    git("add", ".")
    git("commit", "-qm", "one")
    c1 = git("rev-parse", "HEAD")
    fig = figures.Figure("probe", "x", (), (), ("a.py", "b.py"), "README.md")
    raw = {"commit": c1, "changed_files": [], "imported": {"a.py": source_hash(tmp_path / "a.py")}}
    (tmp_path / "a.py").write_text('"""Now documented."""\n' + CODE.replace("# doubled", "# twice"))
    (tmp_path / "b.py").write_text("y = 2\n")  # (not imported by its run)
    assert figures.stale(fig, raw) is None
    (tmp_path / "a.py").write_text(CODE.replace("2 * x", "x + x"))
    assert figures.stale(fig, raw) == f"measured at {c1[:10]}; changed since: a.py"
    (tmp_path / "a.py").unlink()
    assert figures.stale(fig, raw) == f"measured at {c1[:10]}; changed since: a.py"
    moving = {**raw, "changed_during_run": {"commit": c1, "changed_files": ["a.py"]}}
    assert figures.stale(fig, moving) == f"measured at {c1[:10]} while these changed: a.py"
    assert figures.stale(fig, {"commit": "0" * 40}).startswith("measured commit 0000000000")
    assert figures.stale(fig, {}) == "records no commit"


def test_a_raw_file_without_its_imports_is_judged_by_its_declared_sources_at_its_commit(tmp_path, monkeypatch):
    git = _repo(tmp_path, monkeypatch)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text(CODE)
    (tmp_path / "other.py").write_text("z = 1\n")
    git("add", ".")
    git("commit", "-qm", "one")
    c1 = git("rev-parse", "HEAD")
    fig = figures.Figure("probe", "x", (), (), ("src",), "README.md")
    raw = {"commit": c1, "changed_files": []}
    (tmp_path / "src" / "a.py").write_text(CODE.replace("# doubled", "# twice"))
    (tmp_path / "other.py").write_text("z = 2\n")
    git("commit", "-qam", "a comment, and a file it does not declare")
    assert figures.stale(fig, raw) is None
    (tmp_path / "src" / "b.py").write_text("new = 1\n")  # (a file added under its sources)
    assert figures.stale(fig, raw) == f"measured at {c1[:10]}; changed since: src/b.py"
    (tmp_path / "src" / "b.py").unlink()
    dirty = {**raw, "changed_files": ["src/a.py"]}
    assert figures.stale(fig, dirty) == f"measured at {c1[:10]} with uncommitted changes to: src/a.py"
    assert figures.stale(fig, {**raw, "changed_files": ["other.py"]}) is None


def test_a_stale_figures_blocks_say_so_and_the_check_compares_them_less_that_note(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("<!-- figure: probe -->\nold\n<!-- /figure: probe -->\n")
    fig = figures.Figure("probe", "x", (), (), ("a.py",), "page.md")
    monkeypatch.setattr(figures, "REPO", tmp_path)
    monkeypatch.setattr(figures, "FIGURES", [fig])
    monkeypatch.setattr(figures, "load_raw", lambda f, quick=False: {"commit": "c"})
    monkeypatch.setattr(figures.Figure, "renderer", lambda self: lambda raw: {"probe": "| a |\n|---|\n"})
    monkeypatch.setattr(figures, "stale", lambda f, raw: "measured at c; changed since: a.py")
    monkeypatch.setitem(sys.modules, "which_solver", SimpleNamespace(render=lambda raws: None))
    assert figures.render_docs(write=True) == []
    assert page.read_text() == ("<!-- figure: probe -->\n| a |\n|---|\n\n> Stale: measured at c; changed since: a.py.\n"
                                "<!-- /figure: probe -->\n")
    assert figures.render_docs(write=False) == [] and figures.render_docs(write=False, notes=False) == []
    monkeypatch.setattr(figures, "stale", lambda f, raw: None)  # (a fix since: the note is out of date)
    assert figures.render_docs(write=False) == ["page.md: block(s) probe differ from what the raw results render "
                                                "(python benchmarks/figures.py render)"]
    assert figures.render_docs(write=False, notes=False) == []
    page.write_text(page.read_text().replace("| a |", "| b |"))  # (a hand edit is a difference either way)
    assert len(figures.render_docs(write=False, notes=False)) == 1


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
    from common import source_hash

    raws = {"fresh": {"commit": _git("rev-parse", "HEAD"), "changed_files": [],
                      "imported": {"benchmarks/figures.py": source_hash(REPO / "benchmarks" / "figures.py")}},
            "old": None}
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
    assert _recommend({**raw, "set": "test2"}) == _recommend(raw)
    assert "hit" not in _recommend({**raw, "set": "dev"}) and "hit" not in _recommend(None)


def test_the_readme_quotes_auto_from_the_third_test_set_only():
    from which_solver import _auto

    rule = "async-easgd if any worker is slow, else ad-psgd"
    choosers = {"auto": {"geomean": 1.08, "worst": 1.25}, "recommend's first pick": {"geomean": 1.21},
                rule: {"geomean": 1.3}}
    raw = {"set": "test3", "summary": {"choosers": choosers, "best_rule": rule, "scenarios": 8}}
    assert _auto(raw).endswith("its time to target, the short runs counted, 1.08x the best in hindsight by geometric "
                               "mean (worst 1.25x) over 8 drawn scenarios; recommend's first pick 1.21x, the rule "
                               f"\"{rule}\" 1.30x (out of sample, emulated devices and links, one seed each)")
    assert "not scored yet" in _auto(None) and "not scored yet" in _auto({**raw, "set": "test2"})


def test_provenance_compares_the_working_tree_with_head_not_the_index(tmp_path):
    from common import provenance

    git = _git_in(tmp_path)
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


def test_a_jobs_processes_record_the_package_files_they_imported(tmp_path, monkeypatch):
    """Every process of a job appends the package files it imported to the file
    DISTSYNC_RECORD_IMPORTS names (as a benchmark's provenance sets it), and the raw file's
    record of its imports takes them with their hashes. The package's files are wherever
    this process imported it from (the job's processes inherit its path): this checkout's
    src/, or a copy of it, as a mutation tool makes."""
    import distsync
    from common import imported_sources, source_hash

    package = Path(distsync.__file__).resolve().parent
    record = tmp_path / "imports.txt"
    monkeypatch.setenv("DISTSYNC_RECORD_IMPORTS", str(record))
    proc = run_cli("train", "--solver", "ma", "--workers", "2", "--steps", "3", "--out", str(tmp_path / "run"),
                   fresh_process=True)
    assert proc.returncode == 0, proc.stderr
    files = set(record.read_text().split())
    for mine in ("solvers/model_averaging.py", "runtime/process.py", "workloads/digits.py"):
        assert str(package / mine) in files, mine
    assert str(package / "runtime" / "launch.py") in files  # (the command's own process)
    assert not any("/sim/" in f for f in files)  # (training never imports the simulator)
    sources = imported_sources(repo=package.parent.parent)  # (the tree that holds src/distsync)
    assert sources["src/distsync/solvers/model_averaging.py"] == source_hash(package / "solvers" / "model_averaging.py")
    assert "torch" in sys.modules and not any("site-packages" in f for f in sources)  # (installed, not the repository's)


def test_a_raw_file_records_what_processes_without_a_record_measured(tmp_path):
    from common import provenance, source_hash, write_record

    out = write_record(tmp_path / "raw.json", provenance("x.py", []), regime="r", seeds=[1], payload={},
                       announce=False, measured=["src/distsync/solvers/rules.py", "no/such/file.py"])
    imported = json.loads(out.read_text())["imported"]
    assert imported["src/distsync/solvers/rules.py"] == source_hash(REPO / "src/distsync/solvers/rules.py")
    assert "no/such/file.py" not in imported and "benchmarks/common.py" in imported


def test_every_figure_is_registered_once():
    names = [f.name for f in figures.FIGURES]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_the_published_sweep_is_the_one_its_raw_file_records():
    """docs/sweep/ is what the sweep figure's run wrote: its rows are the raw file's, and the
    raw file names the command that wrote them there."""
    raw = json.loads(figures.BY_NAME["sweep"].raw_path().read_text())
    assert raw["sweep"].startswith("distsync sweep ") and raw["sweep"].endswith(" --out docs/sweep")
    assert json.loads((REPO / "docs" / "sweep" / "sweep.json").read_text()) == raw["rows"]


def test_the_sweeps_tables_by_hand():
    from sweep import render

    def row(workers, ratio, solver, t):
        return {"solver": solver, "workers": workers, "ratio": ratio, "slow_share": 0.0, "time_to_target_s": t}

    rows = [row(4, 1.0, "allreduce", 2.0), row(4, 1.0, "ripples", 1.5), row(4, 1.0, "local", None),
            row(4, 3.0, "allreduce", 1.0), row(4, 3.0, "ripples", 1.0), row(4, 3.0, "local", None),  # (a tie)
            row(16, 1.0, "allreduce", None), row(16, 1.0, "ripples", 3.0), row(16, 1.0, "local", None),
            row(16, 3.0, "allreduce", None), row(16, 3.0, "ripples", None), row(16, 3.0, "local", None)]
    text = render({"rows": rows, "sweep": "distsync sweep --out docs/sweep", "command": "python benchmarks/sweep.py",
                   "commit": "c" * 40, "machine": {"cpu_count": 2, "torch": "T"}, "date": "D", "seconds": 90,
                   "regime": "simulated"})
    assert text.split("\n")[0] == ("`distsync sweep --out docs/sweep` (through `python benchmarks/sweep.py`) at "
                                   "commit cccccccccc, 2 cores, torch T, D; 1.5 minutes of wall time. Regime: "
                                   "simulated.")
    assert "; `local` never reached the target):" in text
    assert text.split("\n")[3:] == ["", "**4 workers**", "| slow share | 1 | 3 |", "|---|---|---|",
                                    "| 0% | ripples 1.50 (allreduce 2.00) | allreduce 1.00 |",
                                    "", "**16 workers**", "| slow share | 1 | 3 |", "|---|---|---|",
                                    "| 0% | ripples 3.00 (allreduce not reached) | none |"]


def test_the_live_recovery_tables_and_their_targets_by_hand():
    from live_recovery import render

    def run(went, lost, restarts, metric, load=None, healed=None, missed=None):
        return {"finished": True, "went_on_s": went, "steps_lost": lost, "restarts": restarts, "final_metric": metric,
                "load_before": load, "healed_s": healed, "replaced_rank_steps_lost": missed}

    raw = {"command": "python benchmarks/live_recovery.py --runs 2", "commit": "a" * 40, "dirty": False, "date": "D",
           "machine": {"cpu_count": 2, "torch": "T", "load_average_at_start": 1.0, "load_average_at_end": 3.0},
           "seed": 0, "runs": 2, "workers": 3, "steps": 120, "regimes": {"re-form": "R", "healing": "H"},
           "solvers": [{"solver": "allreduce", "clean_metric": 0.9,
                        "runs": [run(0.010, 0, 0, 0.88, 2.0), run(0.030, 2, 0, 0.86, 4.0)]},
                       {"solver": "local", "clean_metric": 0.8,
                        "runs": [{"finished": False, "hung": True, "load_before": 1.5}, run(None, 0, 1, 0.8, 2.5)]}],
           "healing": [{"solver": "async-ps", "clean_metric": 0.95,
                        "runs": [run(None, 0, 0, 0.95, healed=0.5, missed=0), run(None, 0, 0, 0.93)]}]}
    blocks = render(raw)
    head = ("`python benchmarks/live_recovery.py --runs 2` at commit aaaaaaaaaa, 2 cores, torch T, seed 0, D; "
            "1-minute load average 1.0 at the start, 3.0 at the end, 1.5-4.0 before the runs.")
    assert blocks["live_recovery"].split("\n") == [
        head, "", "Regime: R. 2 kills per solver, the killed rank and step drawn with seed 0; digits, 3 workers, "
        "120 steps.", "",
        "| solver | kills | finished | went on (ms, median / max) | survivors' steps lost | restarts | "
        "accuracy (clean → killed, mean) |", "|---|---|---|---|---|---|---|",
        "| allreduce | 2 | 2 | 20 / 30 | 2 | 0 | 0.900 → 0.870 |",
        "| local | 2 | 1 | n/a (nothing to re-form) | 0 | 1 | 0.800 → 0.800 |", "",
        "Targets: every run finishes: **missed** (3 of 4); the others go on in under 1 s: **met** (20-20 ms median "
        "per solver, 30 ms the worst); no step lost for the survivors: **missed** (2 in all); no restart: "
        "**missed** (1). The accuracy after a kill is within 0.030 of the run without one (the largest gap of a "
        "solver's mean: `allreduce`)."]
    assert blocks["live_recovery_healing"].split("\n")[2:] == [
        "Regime: H. 2 kills per solver, the killed rank and step drawn with seed 0; digits, 3 workers, 120 steps. "
        "Each run with `--max-restarts 1`.", "",
        "| solver (healing) | kills | finished | replaced | healed after (s, median / max) | replaced rank's steps "
        "missed (median) | survivors' steps lost | accuracy (clean → healed, mean) |",
        "|---|---|---|---|---|---|---|---|",
        "| async-ps | 2 | 2 | 1 | 0.50 / 0.50 | 0 | 0 | 0.950 → 0.940 |", "",
        "Healed: 1 of 2 kills (2 runs finished); a replacement trained again 0.50-0.50 s after the kill "
        "(0.50-0.50 s median per solver); survivors' steps lost: 0. The accuracy after a kill is within 0.010 of "
        "the run without one (the largest gap of a solver's mean: `async-ps`)."]
    assert set(render({**raw, "healing": []})) == {"live_recovery"}  # (a run of one part renders that part)
