"""The one table of pipeline schedules: what the planner may choose and how the runtime builds it.

Plain data, read by the planner (virtual stages, stage → rank layout, micro-batch minimum),
the mesh (layout checks) and the pipeline (the torch class). torch.distributed.pipelining
places stage i of a looped schedule on rank i % pp, and stage i of a V-shaped one on rank
i for the first lap and 2·pp-1-i for the second.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduleInfo:
    """One torch.distributed.pipelining schedule.

    Args:
        name: the name a Plan and `--schedule` use.
        torch_class: its class in `torch.distributed.pipelining`.
        stages_per_rank: stages each pipeline rank runs (virtual stages) when pp > 1.
        v_shaped: stages sit on ranks in a V (rank r holds stages r and 2p-1-r).
        zero_bubble: backward split into input and weight gradients, filling the warm-up/cool-down idle time.
        min_micro_batches_per_stage: torch refuses fewer micro-batches than this × pp (GPipe: any number).
        plannable: the planner's time and memory model covers it (the others plan only when named, never under
            auto, with every micro-batch in flight on each stage: an upper bound).
    """

    name: str
    torch_class: str
    stages_per_rank: int
    v_shaped: bool = False
    zero_bubble: bool = False
    min_micro_batches_per_stage: int = 1
    plannable: bool = True


TABLE: dict[str, ScheduleInfo] = {s.name: s for s in (
    ScheduleInfo("1F1B", "Schedule1F1B", 1),
    ScheduleInfo("GPipe", "ScheduleGPipe", 1, min_micro_batches_per_stage=0),
    ScheduleInfo("Interleaved1F1B", "ScheduleInterleaved1F1B", 2),
    ScheduleInfo("ZBVZeroBubble", "ScheduleZBVZeroBubble", 2, v_shaped=True, zero_bubble=True),
    # DualPipeV needs at least one micro-batch per stage (2 · pp); torch checks it.
    ScheduleInfo("DualPipeV", "ScheduleDualPipeV", 2, v_shaped=True, zero_bubble=True, min_micro_batches_per_stage=2),
    ScheduleInfo("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", 2, zero_bubble=True, plannable=False),
    ScheduleInfo("LoopedBFS", "ScheduleLoopedBFS", 2, plannable=False),
)}
AUTO = "auto"
# What `--schedule auto` compares, where this torch offers them. DualPipeV is left out: by the planner's
# model it has ZBVZeroBubble's bubble and holds more micro-batches in flight, so it never wins, and
# searching it costs a quarter of the planning time. `--schedule DualPipeV` still plans and runs it.
AUTO_CANDIDATES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
PLANNABLE = tuple(name for name, s in TABLE.items() if s.plannable)


def info(name: str) -> ScheduleInfo:
    """The table's entry for `name` (KeyError for an unknown name: callers check with `known`)."""
    return TABLE[name]


def available(name: str) -> bool:
    """Whether the installed torch has the schedule's class."""
    import torch.distributed.pipelining as pipelining

    return hasattr(pipelining, TABLE[name].torch_class)


def virtual_stages(name: str, pp: int) -> int:
    """Stages per pipeline rank: the table's, or 1 without a pipeline."""
    return TABLE[name].stages_per_rank if pp > 1 else 1


def pp_rank_of_stage(name: str, *, pp: int, index: int) -> int:
    """The pipeline rank torch's schedule `name` runs stage `index` on: looped (i % pp) or V-shaped."""
    lap, offset = divmod(index, pp)
    if TABLE[name].v_shaped and lap % 2 == 1:
        return pp - 1 - offset
    return offset


def min_micro_batches(name: str, pp: int) -> int:
    """The fewest micro-batches torch runs `name` with on `pp` ranks."""
    if pp == 1:
        return 1
    return max(1, TABLE[name].min_micro_batches_per_stage * pp)
