"""A training step's pipeline timeline as the ranks ran it: each rank's forward and backward actions of one step,
stamped around its stages' chunk calls (`StageTimer`: perf_counter, after a GPU's queued kernels while recording;
no number changes), put on one clock, and written to the run's folder beside the plan's own timeline (issue 33).

The clocks: ranks on rank 0's host read the same monotonic clock (perf_counter is CLOCK_MONOTONIC on Linux,
mach_absolute_time on macOS), so their stamps need no correction. A rank on another host reads its clock right after
a barrier all ranks leave together; its offset to rank 0's is the difference of the two readings (the median over
its host's ranks), as exact as the barrier's release is even. The step's first action starts at 0.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from hfsplit.planning.timeline import Action, Timeline

TIMELINE_JSON = "timeline.json"


def recorded_step(timeline_step: Optional[int], *, total_steps: int) -> int:
    """The step whose actions are recorded: `--timeline-step`, or the last one when unset (0: none)."""
    return total_steps if timeline_step is None else timeline_step


def measured_timeline(model, raw: list[tuple]) -> Optional[Timeline]:
    """The step every rank recorded in `raw` (`SplitModel.step(record=)`), on rank 0's clock; on rank 0, else None.
    Collective: every rank calls it after the same step. One rank per pipeline rank is kept (tp and dp index 0): the
    others run the same actions on their own shards or rows."""
    dist.barrier()
    stamp = time.perf_counter()
    coords = model.ctx.coords
    mine = (coords.pp, coords.tp == 0 and coords.dp == 0, socket.gethostname(), stamp, raw)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    offsets = clock_offsets([host for _, _, host, _, _ in gathered], [s for _, _, _, s, _ in gathered])
    actions = [Action(pp, stage, kind, mb, start - offset, end - offset)
               for (pp, kept, _, _, rows), offset in zip(gathered, offsets) if kept
               for stage, kind, mb, start, end in rows]
    return Timeline(model.plan.schedule, model.plan.pp, model.plan.micro_batches, from_zero(actions))


def clock_offsets(hosts: list[str], stamps: list[float]) -> list[float]:
    """Each rank's clock minus rank 0's: 0 on rank 0's host (one clock), else the median over the host's ranks of
    its reading after a common barrier minus rank 0's (`stamps`, in rank order)."""
    by_host: dict[str, list[float]] = {}
    for host, stamp in zip(hosts, stamps):
        by_host.setdefault(host, []).append(stamp - stamps[0])
    return [0.0 if host == hosts[0] else statistics.median(by_host[host]) for host in hosts]


def from_zero(actions: list[Action]) -> tuple[Action, ...]:
    """`actions` shifted so that the first starts at 0, by rank, then in the order they ran."""
    zero = min(a.start for a in actions)
    moved = [Action(a.rank, a.stage, a.kind, a.micro_batch, a.start - zero, a.end - zero) for a in actions]
    return tuple(sorted(moved, key=lambda a: (a.rank, a.start)))


def write_timeline(timeline: Timeline, plan, output_dir: str, *, step: int) -> Path:
    """`timeline.json`: the Timeline's fields, the step's number and the run's plan (what the recipe draws it beside,
    `hfsplit.cli.charts.run_timeline_chart`), written atomically. Its path."""
    path = Path(output_dir) / TIMELINE_JSON
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({"step": step, **timeline.to_dict(), "plan": json.loads(plan.to_json())}, indent=1)
                   + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    return path


def read_timeline(output_dir: str) -> tuple[int, Timeline]:
    """(step, Timeline) of a run's `timeline.json`."""
    data = json.loads((Path(output_dir) / TIMELINE_JSON).read_text())
    return data["step"], Timeline.from_dict(data)
