"""The README's "try it on the tiny model" snippet runs as printed, in one process and under torchrun, and both give
the same greedy continuation (issue 33, item 5)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]
SNIPPET = re.search(r"Try it on the built-in tiny model.*?```python\n(.*?)```", (ROOT / "README.md").read_text(),
                    re.S).group(1)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def run(tmp_path: Path, *launcher: str) -> str:
    (tmp_path / "try_tiny.py").write_text(SNIPPET)
    done = subprocess.run([*launcher, "try_tiny.py"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_snippet_is_three_lines():
    assert len(SNIPPET.strip().splitlines()) == 3


def test_the_snippet_runs_in_one_process(tmp_path):
    out = run(tmp_path, sys.executable)
    assert re.fullmatch(r"tensor\(\[\[ *1, +2, +3(, +\d+){8}\]\]\)\n", out), out
    assert (tmp_path / "tiny-llama" / "config.json").is_file()


@pytest.mark.slow
def test_the_snippet_runs_under_torchrun_and_continues_as_one_process_does(tmp_path):
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    alone = run(tmp_path / "one", sys.executable)
    split = run(tmp_path / "two", sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()))
    assert split.splitlines() == alone.splitlines() * 2  # each rank prints the same tokens
