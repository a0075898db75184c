"""Ctrl-C and SIGTERM stop a run cleanly (issue 33, item 6): one line naming the last complete checkpoint and how to
resume, exit 130, no traceback, no half-written `checkpoint-N.tmp`; and the resume it names works.

Real runs of the tiny recipe in a subprocess (one process, and two ranks under torchrun), signalled while they save a
checkpoint every step, so that the signal often lands inside a save."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfsplit.training.options import TINY_RECIPE
from tests.parallel.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^finetune: interrupted during step (\d+); the last complete checkpoint is (\S+): "
                  r"resume with --resume (\S+) \(or --resume latest\)$")


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
            "HFSPLIT_NO_CALIBRATION": "1"}


def recipe(out: Path, *extra: str) -> list[str]:
    return ["-m", "hfsplit.finetune", "--config", str(TINY_RECIPE), "--output-dir", str(out), "--save-every", "1",
            "--max-steps", "400", "--seq-len", "64", *extra]


def signalled(cmd: list[str], out: Path, sig: int, *, after: str = "checkpoint-2", timeout_s: float = 240) -> tuple:
    """Start `cmd`, send `sig` once `out/after` exists, and wait; (exit code, stderr). Times out instead of hanging."""
    proc = subprocess.Popen(cmd, cwd=out.parent, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    try:
        while not (out / after).is_dir():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, f"no {after} within {timeout_s} s"
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


def lines(text: str) -> list[str]:
    return [line for line in re.split(r"[\r\n]+", text) if line.strip()]


def assert_clean_stop(out: Path, err: str) -> Path:
    """One interrupted line naming a complete checkpoint; no traceback of ours; no temporary folder. The checkpoint."""
    ours = [line for line in lines(err) if line.startswith("finetune: ")]
    assert ours and len(set(ours)) == 1, err[-3000:]
    match = LINE.match(ours[0])
    assert match, ours[0]
    assert f'File "{ROOT / "hfsplit"}' not in err, err[-3000:]
    assert not list(out.glob("*.tmp*")), sorted(p.name for p in out.iterdir())
    last = Path(match.group(2))
    assert last.is_dir() and (last / "trainer_state").is_dir() and match.group(3) == str(last)
    return last


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signalled_run_stops_in_one_line_naming_the_checkpoint_that_resumes(tmp_path, sig):
    out = tmp_path / "run"
    code, err = signalled([sys.executable, *recipe(out, "--max-memory", "1GiB")], out, sig)
    assert code == 130, err[-3000:]
    last = assert_clean_stop(out, err)
    step = int(last.name.split("-")[1])
    resumed = subprocess.run([sys.executable, *recipe(out, "--max-memory", "1GiB", "--resume", str(last),
                                                      "--max-steps", str(step + 1), "--save-every", "1000")],
                             cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {last}" in resumed.stdout + resumed.stderr or (out / "model").is_dir()


@pytest.mark.slow
def test_ctrl_c_under_torchrun_stops_every_rank_cleanly(tmp_path):
    """torchrun passes the stop on to its ranks (SIGTERM): each ends with the same line, nothing half-written."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           *recipe(out)]
    code, err = signalled(cmd, out, signal.SIGINT)
    assert code != 0
    assert_clean_stop(out, err)
