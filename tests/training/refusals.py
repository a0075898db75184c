"""Asserting the recipe's refusals: exit 2, one `finetune: ...` line naming the culprit, no traceback, nothing written.

Most bad input is refused before any rank work, so it runs in this process through the recipe's own `main(argv)` (a
one-rank run, as `python -m hfsplit.finetune` without a launcher): seconds, not a launch. Refusals that only a
launcher can provoke (world size against the plan or the budget) run under torchrun.
"""
import contextlib
import io
import os
import re
import sys
from pathlib import Path

from hfsplit.finetune import main
from hfsplit.training.options import TINY_RECIPE
from tests.parallel.launcher import free_port, run_command

ROOT = Path(__file__).resolve().parents[2]
# tqdm bars (ours, datasets', the checkpoint writer's): "name: 40%|## | 2/5 [00:01<...]" or "name: 300 examples [...]"
PROGRESS = re.compile(r"^[\w -]+: +(\d+%\||\d+ \w+ \[)")
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def stderr_lines(text: str) -> list[str]:
    """Non-empty lines of a stderr, progress bars' carriage-return redraws split apart, progress bars left out."""
    return [line for line in re.split(r"[\r\n]+", text) if line.strip() and not PROGRESS.search(line)]


def base_flags(out: Path) -> list[str]:
    """The tiny demo's recipe on one 1 GiB device, two steps, into `out`: flags given later win."""
    return ["--config", str(TINY_RECIPE), "--max-memory", "1GiB", "--output-dir", str(out), "--max-steps", "2"]


def assert_recipe_refuses(tmp_path: Path, flags: list[str], words: list[str], *, nproc: int = 1,
                          launcher: bool = False, details: bool = False) -> str:
    """The recipe given `flags` exits 2 with one `finetune: ` line holding every one of `words` and writes nothing to
    its output folder; in this process through `main(argv)`, or under torchrun with `nproc` ranks when `launcher`
    (or `nproc` > 1). With `details`, more lines may follow the one (the planner's table of needs and fixes after
    "no split fits"). Returns the line."""
    out = tmp_path / "out"
    if launcher or nproc > 1:
        line = _refused_under_torchrun(tmp_path, [*base_flags(out), *flags], nproc=nproc)
    else:
        line = _refused_in_process([*base_flags(out), *flags], details=details)
    assert all(word in line for word in words), (words, line)
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())  # nothing half-written
    return line


def _refused_in_process(argv: list[str], *, details: bool) -> str:
    assert not any(name in os.environ for name in LAUNCHER_ENV), "an in-process refusal runs without a launcher"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)  # an unexpected exception would surface here as the test's own traceback
    lines = stderr_lines(err.getvalue())
    assert code == 2, (code, err.getvalue()[-3000:])
    assert lines and lines[0].startswith("finetune: ") and (details or len(lines) == 1), lines
    assert not any(line.startswith(("finetune: ", "Traceback")) for line in lines[1:]), lines
    return lines[0]


def _refused_under_torchrun(tmp_path: Path, argv: list[str], *, nproc: int) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), "-m", "hfsplit.finetune", *argv]
    proc = run_command(cmd, cwd=tmp_path, env=env, timeout_s=300)
    assert proc.returncode != 0 and "(exitcode: 2)" in proc.stderr, proc.stderr[-3000:]  # the recipe exits 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("finetune: ")]
    # every rank that fails says why; ranks failing alike say the same line
    assert len(set(errors)) == 1 and len(errors) <= nproc, proc.stderr[-3000:]
    assert f'File "{ROOT / "hfsplit"}' not in proc.stderr, proc.stderr[-3000:]  # no traceback of ours (torchrun's own
    # summary of a child that exited 2 is the launcher's)
    return errors[0]
