"""Ctrl-C and SIGTERM (a launcher or a scheduler stopping the run) end a run cleanly: no traceback, no half-written
folder, one line naming the last complete checkpoint and how to resume from it."""
from __future__ import annotations

import contextlib
import shutil
import signal
from pathlib import Path
from typing import Optional

from hfsplit.errors import Interrupted


@contextlib.contextmanager
def sigterm_interrupts():
    """Within: SIGTERM raises KeyboardInterrupt as Ctrl-C does, so both unwind the same way (the main thread only;
    the handler before is restored after)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        before = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: the caller's own handling stays
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def remove_partial_saves(output_dir: Optional[str]) -> None:
    """Delete the temporary folders a save interrupted mid-way left in `output_dir` (`checkpoint-N.tmp`, `model.tmp`,
    ...): every complete folder was renamed into place, so none of these holds anything to keep."""
    if output_dir is None or not Path(output_dir).is_dir():
        return
    for partial in Path(output_dir).glob("*.tmp"):
        shutil.rmtree(partial, ignore_errors=True)


def interrupted(output_dir: Optional[str], *, step: Optional[int] = None) -> Interrupted:
    """The one-line error of a stopped run: where it stopped, the last complete checkpoint, how to resume."""
    from hfsplit.training.resume import latest_checkpoint  # lazy: it loads torch; the recipe's --help loads none

    where = f"during step {step}" if step else "before the first step"
    last = latest_checkpoint(output_dir) if output_dir and Path(output_dir).is_dir() else None
    resume = (f"the last complete checkpoint is {last}: resume with --resume {last} (or --resume latest)" if last
              else "no checkpoint was saved, so a rerun starts afresh (--save-every N saves as it goes)")
    return Interrupted(f"interrupted {where}; {resume}")
