import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _no_import_record_left_behind(monkeypatch):
    """No record of the files a job imports (a benchmark's provenance starts one, in an
    environment variable every job inherits): set empty, none is started inside a test."""
    monkeypatch.setenv("DISTSYNC_RECORD_IMPORTS", "")
