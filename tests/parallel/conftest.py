"""Multi-process tests: the shared launcher fixture (the `slow` marker is registered in pyproject.toml)."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # ranks import "tests.parallel.cases"; so does this process
    sys.path.insert(0, str(ROOT))


@pytest.fixture
def launch():
    """`launch(target, world_size=, kwargs=, timeout_s=)` → per-rank results (see tests/parallel/launcher.py)."""
    from tests.parallel.launcher import launch as run

    return run
