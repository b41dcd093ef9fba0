import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Property tests draw the same examples on every run and every machine, and keep none between
# runs (no .hypothesis/ database: a draw that failed once in one checkout, or under a mutant of
# a mutation tool run from it, is not replayed there later): the suite fails for the code, never
# for a draw. `--hypothesis-profile explore` draws afresh, from `--hypothesis-seed N` when given
# (which reproduces them), as `make test-soak` does. (A test's own settings(derandomize=True)
# keeps its fixed draws in either.)
settings.register_profile("fixed", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False, database=None)
settings.load_profile("fixed")


@pytest.fixture(autouse=True)
def _no_import_record_left_behind(monkeypatch):
    """No record of the files a job imports (a benchmark's provenance starts one, in an
    environment variable every job inherits): set empty, none is started inside a test."""
    monkeypatch.setenv("DISTSYNC_RECORD_IMPORTS", "")
