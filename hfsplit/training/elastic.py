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
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from hfsplit.errors import HfsplitError, RankIdle, RegroupStop
from hfsplit.plan import coordinates_of_rank
from hfsplit.parallel.mesh import World, backend_for, joined_world, launcher_world
from hfsplit.training.resume import checkpoint_to_resume, complete_checkpoints, latest_checkpoint, small_state_file
from hfsplit.training.trainer_state import read_small_state

STOPPED = "stopped"  # the metrics key of a run ended at a step boundary for a membership change


def restart_count() -> int:
    """How many times torchrun restarted this worker group after a failure (0 on a first launch)."""
    return launcher_world().restart_count


def run_id() -> Optional[str]:
    """torchrun's --rdzv-id: the same for every launch of one elastic job."""
    return launcher_world().run_id


@dataclass
class LaunchState:
    """What this launch is: a first launch, a restart, or a regrouping; and what it resumes from."""

    resume_from: Optional[Path] = None
    reason: Optional[str] = None  # why an elastic launch resumes: "restart" | "membership change" | None
    previous: Optional[list] = None  # the metrics.jsonl records of the runs before this launch
    last_write: float = 0.0  # when the run before wrote its last record (metrics.jsonl's mtime)

    auto: bool = False  # an elastic launch (--resume auto or a torchrun restart): keeps the checkpoint's batch
    growth: Optional[dict] = None  # a regrouping onto more ranks: the time model's verdict (`growth_decision`)

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
    return int(read_small_state(small_state_file(Path(folder), 0))["rows_per_step"])


def check_global_batch(plan, *, rows_then: Optional[int], micro_batch_size: int) -> None:
    """The re-planned split must make steps of the checkpoint's rows, or the loss curve changes."""
    rows_now = plan.micro_batches * plan.dp * micro_batch_size
    if rows_then is not None and rows_now != rows_then:
        raise HfsplitError(
            f"the checkpoint was trained with {rows_then} rows per step; under dp={plan.dp} × micro-batch size "
            f"{micro_batch_size} that is no whole number of micro-batches; resume with a --micro-batch-size "
            f"that divides {rows_then // plan.dp or 1}")


def plan_summary(plan) -> dict:
    """The part of a plan a restart report compares (with the time model's estimate of its step)."""
    return {"pp": plan.pp, "tp": plan.tp, "dp": plan.dp, "schedule": plan.schedule,
            "micro_batches": plan.micro_batches, "world_size": plan.world_size, "step_time_s": plan.step_time_s}


def node_of_rank() -> str:
    """Where this rank runs: the host, and under torchrun its launcher's pid (the agent is the worker's
    parent), so two launchers on one host are two machines and a restarted worker keeps its machine."""
    return f"{socket.gethostname()}:{os.getppid()}" if run_id() else socket.gethostname()


def nodes_of_ranks() -> list:
    """Collective: `node_of_rank` of every rank, in rank order."""
    if not dist.is_initialized():
        return [node_of_rank()]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, node_of_rank())
    return out


def plan_record(plan, *, step: int, micro_batch_size: int, seq_len: int, nodes: Optional[list] = None) -> dict:
    """The metrics record each launch starts with: its plan and each rank's machine, so the next restart
    can say what changed and which ranks went away."""
    record = {"step": step, "plan": plan_summary(plan), "run_id": run_id(), "restart_count": restart_count(),
              "tokens_per_step": plan.micro_batches * plan.dp * micro_batch_size * seq_len, "nodes": nodes}
    if plan.offload_bytes:  # what each step's `activation_offload_bytes` is to be, rank by rank
        record["activation_offload_planned"] = planned_offload_per_rank(plan)
    return record


def planned_offload_per_rank(plan) -> list[int]:
    """Per global rank, the host bytes the plan's activation offload holds there at its peak."""
    def mine(rank: int) -> int:
        return sum(s.memory.offload for s in plan.stages_of_rank(coordinates_of_rank(plan, rank=rank).pp))

    return [mine(rank) for rank in range(plan.world_size)]


def last_plan(records: Optional[list]) -> Optional[dict]:
    """The plan record of the launch before this one."""
    plans = [r for r in records or [] if "plan" in r]
    return plans[-1] if plans else None


def ranks_changed(old_nodes: Optional[list], nodes: list) -> dict:
    """The old ranks whose machine is gone and the new ranks on machines the old run did not have."""
    if not old_nodes:
        return {"ranks_lost": None, "hosts_lost": None, "ranks_added": None, "hosts_added": None}
    lost = [r for r, node in enumerate(old_nodes) if node not in set(nodes)]
    added = [r for r, node in enumerate(nodes) if node not in set(old_nodes)]
    return {"ranks_lost": lost, "hosts_lost": sorted({old_nodes[r] for r in lost}),
            "ranks_added": added, "hosts_added": sorted({nodes[r] for r in added})}


def restart_record(launch: LaunchState, plan, *, step: int, started: float, nodes: list) -> Optional[dict]:
    """What the restart cost: ranks lost or added (and their machines), old and new plan, steps redone,
    seconds lost.

    Seconds lost = the time from the last record the old run wrote to this run being ready again
    (failure detection, rendezvous, re-plan, reload), plus the old run's time for the steps redone.
    """
    if launch.previous is None or launch.reason is None:
        return None
    old = last_plan(launch.previous)
    done = [r["step"] for r in launch.previous if "loss" in r]
    redone = max(0, max(done, default=step) - step)
    steps_s = [r["step_s"] for r in launch.previous if "step_s" in r][-5:]  # (tokens_per_s counts real tokens)
    step_s = sum(steps_s) / len(steps_s) if old and steps_s else 0.0
    waited = started - launch.last_write
    spawned = process_started()
    return {"step": step, "restart": launch.reason, "restart_count": restart_count(),
            **ranks_changed(old.get("nodes") if old else None, nodes), "world_size": len(nodes),
            "old_plan": old["plan"] if old else None, "new_plan": plan_summary(plan),
            "steps_redone": redone, "restart_s": waited, "reload_s": time.time() - started,
            # restart_s in two: the old run's last record -> this worker process started (torchrun noticing
            # the failure, stopping the workers, the rendezvous round), then -> build_run (imports)
            "detect_and_rendezvous_s": spawned - launch.last_write if spawned else None,
            "worker_import_s": started - spawned if spawned else None,
            "seconds_lost": time.time() - launch.last_write + redone * step_s}


def process_started() -> Optional[float]:
    """When this process started (the ctime of its /proc entry, on Linux; None elsewhere)."""
    try:
        return os.stat(f"/proc/{os.getpid()}").st_ctime
    except OSError:
        return None


def describe(record: dict) -> str:
    """The one log line of a restart."""
    old, new = record["old_plan"] or {}, record["new_plan"]
    lost, added = record["ranks_lost"], record["ranks_added"]
    change = f"lost rank(s) {', '.join(map(str, lost))} ({', '.join(record['hosts_lost'])})" if lost else \
        f"gained rank(s) {', '.join(map(str, added))} ({', '.join(record['hosts_added'])})" if added else \
        "same machines" if lost is not None else "machines not recorded"
    return (f"elastic {record['restart']}: {change}; re-planned {plan_text(old)} -> {plan_text(new)}; resumed at "
            f"step {record['step']}, {record['steps_redone']} step(s) redone, {record['seconds_lost']:.1f} s lost")


def plan_text(p: dict) -> str:
    return f"pp={p.get('pp')} tp={p.get('tp')} dp={p.get('dp')} {p.get('schedule')} on {p.get('world_size')} ranks"


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


def stop_for_regroup(stopper: StopAtBoundary, metrics, *, step: int, checkpoint: Path) -> None:
    """After the boundary checkpoint: mark the stop (the regrouped launch resumes by itself) and leave."""
    metrics.write({"step": step, STOPPED: "membership change", "run_id": run_id(), "checkpoint": str(checkpoint)})
    metrics.close()
    dist.barrier()
    stopper.wait_for_own_signal()
    raise RegroupStop(f"stopped after step {step} with {checkpoint} for torchrun to regroup the ranks; "
                      "the restarted workers resume from it by themselves")


def growth_decision(launch: LaunchState, plan, *, step: int) -> Optional[dict]:
    """A regrouping onto more ranks: is `plan` (the planner's best on the larger device set) faster than
    the layout the run had? Both are the calibrated time model's estimates for the same global batch.

    None when this launch is no growth (a first launch, a restart after a loss, the same world).
    """
    old = last_plan(launch.previous)
    if launch.reason != "membership change" or old is None or plan.world_size <= old["plan"]["world_size"]:
        return None
    tokens = old["tokens_per_step"]
    current_s = old["plan"].get("step_time_s")
    current = tokens / current_s if current_s else 0.0  # a plan record without an estimate: grow
    larger = tokens / plan.step_time_s
    return {"step": step, "growth": "re-planned upward" if larger > current else "kept the current layout",
            "faster": larger > current, "tokens_per_s_current": current, "tokens_per_s_larger": larger,
            "current_plan": old["plan"], "larger_plan": plan_summary(plan)}


def describe_growth(record: dict) -> str:
    """The one log line of the time model's verdict on a larger layout."""
    first, last = record["current_plan"]["world_size"], record["larger_plan"]["world_size"] - 1
    idle = f"rank {first} idles" if first == last else f"ranks {first}-{last} idle"
    verdict = "faster: re-planned upward" if record["faster"] else \
        f"not faster: kept {plan_text(record['current_plan'])}, {idle} to the end of the run"
    return (f"elastic growth: {plan_text(record['larger_plan'])} is estimated at {record['tokens_per_s_larger']:.0f} "
            f"tokens/s against {record['tokens_per_s_current']:.0f} of {plan_text(record['current_plan'])}; {verdict}")


def settle_growth(launch: LaunchState, plan, *, replan, timeout_s: float):
    """The plan this launch runs: `plan`, unless it is a growth the time model says is not faster; then
    the ranks beyond the old world leave the group (raising `RankIdle`: exit 0, their launcher waits at
    torchrun's exit barrier) and the others form a group of the old size and re-plan on it (`replan(world)`, with
    the regrouped World), which gives the old layout again. torchrun cannot be told to leave a joined machine out, so its
    ranks idle rather than run a layout the model says is slower."""
    decision = growth_decision(launch, plan, step=0)
    launch.growth = decision
    if decision is None or decision["faster"]:
        return plan
    keep = decision["current_plan"]["world_size"]
    rank = dist.get_rank()
    if rank == 0:
        print(describe_growth(decision), flush=True)
    world = shrink_group(keep, timeout_s=timeout_s)
    if world is None:
        raise RankIdle(f"rank {rank} idles: {describe_growth(decision)}")
    return replan(world)


def shrink_group(keep: int, *, timeout_s: float) -> Optional[World]:
    """Leave the default process group; ranks below `keep` join a new one of `keep` ranks on the same
    store (rank 0 serves it and stays). The new group's World, None on a rank that leaves."""
    from datetime import timedelta

    store = dist.distributed_c10d._get_default_store()  # held: rank 0's server must outlive the old group
    rank = dist.get_rank()
    dist.barrier()  # every rank knows the verdict before rank 0 tears its side down
    dist.destroy_process_group()
    if rank >= keep:
        return None
    given = launcher_world()  # the launcher's local rank picks the device, as at the first join
    dist.init_process_group(backend=backend_for(given.device), store=dist.PrefixStore(f"hfsplit-keep-{keep}/", store),
                            rank=rank, world_size=keep, timeout=timedelta(seconds=timeout_s))
    return joined_world()
