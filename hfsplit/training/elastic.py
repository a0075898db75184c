"""Elastic runs: restart after a lost machine, grow back when it returns, keep the loss curve.

torchrun (`--nnodes MIN:MAX --max-restarts N --rdzv-backend c10d`) does the membership part: when a
worker fails, every surviving agent restarts its workers (TORCHELASTIC_RESTART_COUNT goes up) and
they meet again with whoever is left; when a node joins a running group, the agents stop their
workers with SIGTERM and restart them in a larger group (the restart count does *not* go up).

This module is the worker side of both:
- `LaunchState.decide`: which checkpoint a launch resumes from (after a restart: the latest complete
  one, found by itself), and the refusal of a first launch that would overwrite a run;
- the global batch (rows per step) of the checkpoint is passed to the planner, which sets
  micro-batches for the new data-parallel degree, so the same rows make each step;
- `StopAtBoundary`: SIGTERM (torchrun's membership change) ends the run after the current step
  with a checkpoint, so the larger group loses no step;
- `restart_record`: what each restart cost, appended to metrics.jsonl.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import HfsplitError
from .resume import STATE, complete_checkpoints, latest_checkpoint

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
STOPPED = "stopped"  # the metrics key of a run ended at a step boundary for a membership change


def restart_count() -> int:
    """How many times torchrun restarted this worker group after a failure (0 on a first launch)."""
    return int(os.environ.get(RESTART_COUNT, "0") or 0)


def run_id() -> Optional[str]:
    """torchrun's --rdzv-id: the same for every launch of one elastic job."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


@dataclass
class LaunchState:
    """What this launch is: a first launch, a restart, or a regrouping; and what it resumes from."""

    resume_from: Optional[Path] = None
    reason: Optional[str] = None  # why an elastic launch resumes: "restart" | "membership change" | None
    previous: Optional[list] = None  # the metrics.jsonl records of the runs before this launch
    last_write: float = 0.0  # when the run before wrote its last record (metrics.jsonl's mtime)

    auto: bool = False  # an elastic launch (--resume auto or a torchrun restart): keeps the checkpoint's batch

    @property
    def rows_per_step(self) -> Optional[int]:
        """The global batch an elastic resume keeps (None: the options' own, as an explicit --resume has)."""
        return saved_rows_per_step(self.resume_from) if self.auto else None

    @property
    def append(self) -> bool:
        """metrics.jsonl continues (a restart, a resume) instead of starting over."""
        return self.previous is not None

    @classmethod
    def decide(cls, resume: Optional[str], output_dir: str) -> "LaunchState":
        """Made on rank 0 and shared, so every rank resumes from the same folder."""
        box = [None]
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                box[0] = ("ok", cls._decide_here(resume, output_dir))
            except HfsplitError as exc:
                box[0] = ("error", str(exc))
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        if box[0][0] == "error":
            raise HfsplitError(box[0][1])
        return box[0][1]

    @classmethod
    def _decide_here(cls, resume: Optional[str], output_dir: str) -> "LaunchState":
        from .resume import checkpoint_to_resume

        previous = read_metrics(output_dir)
        metrics = Path(output_dir) / "metrics.jsonl"
        last_write = metrics.stat().st_mtime if metrics.is_file() else 0.0
        reason = "restart" if restart_count() > 0 else \
            "membership change" if stopped_for_regroup(previous) else None
        if resume == "auto" or reason:  # after a restart the newest checkpoint wins over the one named
            last = latest_checkpoint(output_dir)
            if last is None and resume not in (None, "auto", "latest"):
                last = checkpoint_to_resume(resume, output_dir)  # a first launch resumed from elsewhere
            return cls(resume_from=last, reason=reason, previous=previous if (last or reason) else None,
                       last_write=last_write, auto=True)
        if resume is None:
            found = complete_checkpoints(output_dir)
            if found:
                raise HfsplitError(
                    f"--output-dir {output_dir} already holds a run (checkpoints up to {found[-1].name}); "
                    "pass --resume auto to continue it, or choose another --output-dir")
            return cls()
        return cls(resume_from=checkpoint_to_resume(resume, output_dir), previous=previous)


def read_metrics(output_dir: str) -> Optional[list]:
    """The records of `output_dir/metrics.jsonl`, None when there is none (a torn last line is dropped)."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the line a killed rank 0 was writing
            continue
    return records


def stopped_for_regroup(records: Optional[list]) -> bool:
    """The last run of this elastic job stopped itself at a step boundary for torchrun's regrouping."""
    if not records or run_id() is None:
        return False
    last = records[-1]
    return STOPPED in last and last.get("run_id") == run_id()


def saved_rows_per_step(folder: Optional[Path]) -> Optional[int]:
    """The global batch (rows per optimizer step) the checkpoint was trained with."""
    if folder is None:
        return None
    small = torch.load(Path(folder) / STATE / "rank00000.pt", map_location="cpu", weights_only=False)
    return int(small["rows_per_step"])


def check_global_batch(plan, *, rows_then: Optional[int], micro_batch_size: int) -> None:
    """The re-planned split must make steps of the checkpoint's rows, or the loss curve changes."""
    rows_now = plan.micro_batches * plan.dp * micro_batch_size
    if rows_then is not None and rows_now != rows_then:
        raise HfsplitError(
            f"the checkpoint was trained with {rows_then} rows per step; under dp={plan.dp} × micro-batch size "
            f"{micro_batch_size} that is no whole number of micro-batches; resume with a --micro-batch-size "
            f"that divides {rows_then // plan.dp or 1}")


def plan_summary(plan) -> dict:
    """The part of a plan a restart report compares."""
    return {"pp": plan.pp, "tp": plan.tp, "dp": plan.dp, "schedule": plan.schedule,
            "micro_batches": plan.micro_batches, "world_size": plan.world_size}


def plan_record(plan, *, step: int, micro_batch_size: int, seq_len: int) -> dict:
    """The metrics record each launch starts with: its plan, so the next restart can say what changed."""
    return {"step": step, "plan": plan_summary(plan), "run_id": run_id(), "restart_count": restart_count(),
            "tokens_per_step": plan.micro_batches * plan.dp * micro_batch_size * seq_len}


def restart_record(launch: LaunchState, plan, *, step: int, started: float) -> Optional[dict]:
    """What the restart cost: ranks lost or added, old and new plan, steps redone, seconds lost.

    Seconds lost = the time from the last record the old run wrote to this run being ready again
    (failure detection, rendezvous, re-plan, reload), plus the old run's time for the steps redone.
    """
    if launch.previous is None or launch.reason is None:
        return None
    plans = [r for r in launch.previous if "plan" in r]
    old = plans[-1] if plans else None
    done = [r["step"] for r in launch.previous if "loss" in r]
    redone = max(0, max(done, default=step) - step)
    speeds = [r["tokens_per_s"] for r in launch.previous if "tokens_per_s" in r][-5:]
    step_s = old["tokens_per_step"] / (sum(speeds) / len(speeds)) if old and speeds else 0.0
    waited = started - launch.last_write
    old_world = old["plan"]["world_size"] if old else None
    return {"step": step, "restart": launch.reason, "restart_count": restart_count(),
            "ranks_lost": max(0, old_world - plan.world_size) if old else None,
            "ranks_added": max(0, plan.world_size - old_world) if old else None,
            "old_plan": old["plan"] if old else None, "new_plan": plan_summary(plan),
            "steps_redone": redone, "restart_s": waited, "reload_s": time.time() - started,
            "seconds_lost": time.time() - launch.last_write + redone * step_s}


def describe(record: dict) -> str:
    """The one log line of a restart."""
    old, new = record["old_plan"] or {}, record["new_plan"]

    def text(p: dict) -> str:
        return f"pp={p.get('pp')} tp={p.get('tp')} dp={p.get('dp')} {p.get('schedule')} on {p.get('world_size')} ranks"

    change = f"lost {record['ranks_lost']} rank(s)" if record["ranks_lost"] else \
        f"gained {record['ranks_added']} rank(s)" if record["ranks_added"] else "same ranks"
    return (f"elastic {record['restart']}: {change}; re-planned {text(old)} -> {text(new)}; resumed at step "
            f"{record['step']}, {record['steps_redone']} step(s) redone, {record['seconds_lost']:.1f} s lost")


class StopAtBoundary:
    """SIGTERM (torchrun stopping the workers to regroup) ends the run after the current step.

    Every rank learns it at the same step (one all-reduce per step), saves a checkpoint there and
    then waits for its own SIGTERM, so an agent that has not yet seen the joining node does not
    take an early exit for success.
    """

    def __init__(self) -> None:
        self.asked = False
        self._flag = torch.zeros((), dtype=torch.int32)
        self._before = signal.signal(signal.SIGTERM, self._on_term) if run_id() else None

    def _on_term(self, signum, frame) -> None:
        self.asked = True

    def now(self) -> bool:
        """Collective: whether any rank was asked to stop."""
        if self._before is None:
            return False
        self._flag.fill_(int(self.asked))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        return bool(self._flag)

    def wait_for_own_signal(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.asked and time.monotonic() < deadline:
            time.sleep(0.05)

    def restore(self) -> None:
        if self._before is not None:
            signal.signal(signal.SIGTERM, self._before)


def stop_for_regroup(stopper: StopAtBoundary, metrics, *, step: int, checkpoint: Path) -> None:
    """After the boundary checkpoint: mark the stop (the regrouped launch resumes by itself) and leave."""
    from ..errors import RegroupStop

    metrics.write({"step": step, STOPPED: "membership change", "run_id": run_id(), "checkpoint": str(checkpoint)})
    metrics.close()
    dist.barrier()
    stopper.wait_for_own_signal()
    raise RegroupStop(f"stopped after step {step} with {checkpoint} for torchrun to regroup the ranks; "
                      "the restarted workers resume from it by themselves")
