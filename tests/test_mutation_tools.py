"""The mutation probe's own bookkeeping (tests/mutation_probe.py), with the suite's runs
played by the test: a failure counts only when it is the mutant's, and a test that fails
only under load is set aside with the output it failed with."""

from pathlib import Path

import mutation_probe as mp


def test_a_test_that_passes_alone_is_set_aside_as_flaky_with_its_output(monkeypatch):
    mutant, pristine = Path("mutant"), Path("pristine")
    runs = []

    def run_suite(src_root, timeout_s, suite=None, deselect=()):
        runs.append((src_root, suite, tuple(deselect)))
        if suite is None:  # the whole suite on the mutant: first a.py fails (load), then b.py (the mutant)
            failing = "t.py::a" if not deselect else "t.py::b"
            return {"passed": False, "timeout": False, "failing_test": failing, "seconds": 1.0,
                    "tail": f"E   assert ... ({failing})"}
        # alone: a passes on both copies; b fails on the mutant and passes on the pristine copy
        passed = suite == ["t.py::a"] or src_root == pristine
        return {"passed": passed, "timeout": False, "failing_test": None if passed else suite[0], "seconds": 1.0,
                "tail": ""}

    monkeypatch.setattr(mp, "run_suite", run_suite)
    row = mp.probe(mp.MUTATIONS[0], mutant, pristine, 60.0, None)
    assert (row["caught"], row["confirmed"], row["failing_test"]) == (True, True, "t.py::b")
    assert row["flaky_tests"] == ["t.py::a"]
    assert row["flaky_output"] == {"t.py::a": "E   assert ... (t.py::a)"}
    assert runs[2] == (pristine, ["t.py::a"], ())  # a, alone on the unmutated copy, passed: not the mutant's
    assert runs[3] == (mutant, None, ("t.py::a",))  # the suite again, without it
