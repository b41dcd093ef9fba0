import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _no_import_record_left_behind(monkeypatch):
    """A benchmark's provenance taken inside a test starts a record of the files its runs
    import (an environment variable its jobs inherit); it ends with the test."""
    monkeypatch.setenv("DISTSYNC_RECORD_IMPORTS", "")
