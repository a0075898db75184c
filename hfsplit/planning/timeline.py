"""A step's pipeline timeline: every rank's forward and backward actions in the order torch's schedule runs them,
timed by the planner's own time model, so a picture can show where the bubble is.

The order is torch's. A multi-stage schedule (Interleaved1F1B, ZBVZeroBubble, DualPipeV) runs its `pipeline_order`,
the schedule's own table of actions per rank, which this module asks the schedule class for (built on stand-in
stages: the table depends only on the ranks, stages and micro-batches). A single-stage schedule runs the loop of its
`_step_microbatches`, written out here: its `pipeline_order` is for display only and, for 1F1B, starts the last
rank's forwards at micro-batch 1 (torch 2.13).

The times are the plan's: each stage's `time_s` (forward + backward of one micro-batch, its sends and TP
all-reduces included), cut into forward and backward as the planner's `reference.forward_fraction` cuts it (a
backward costs one forward with a frozen base, two under full fine-tuning, plus the recompute under checkpointing).
Zero-bubble schedules split a backward into its input gradient (with the recompute) and its weight gradient. An
action starts when its rank is free and what it needs has finished: the previous stage's forward of its
micro-batch, the next stage's backward of it, its own forward, and for a weight gradient its input gradient.
"""
from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Optional

from hfsplit.plan import Plan, Stage
from hfsplit.schedules import TABLE, pp_rank_of_stage, virtual_stages

FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = "F", "B", "I", "W"
_GRADIENT_SENT = "gradient sent"  # a stage's input gradient is ready, by a full backward or an input-gradient pass


@dataclass(frozen=True)
class Action:
    """One compute action of a step: `kind` ("F", "B", or a zero-bubble backward's "I" and "W") of `micro_batch`
    on `stage`, run by pipeline rank `rank` from `start` to `end` seconds into the step."""

    rank: int
    stage: int
    kind: str
    micro_batch: int
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """The actions of one step of `schedule` over `pp` ranks, as timed."""

    schedule: str
    pp: int
    micro_batches: int
    actions: tuple[Action, ...]

    @property
    def step_s(self) -> float:
        return max(a.end for a in self.actions)

    @property
    def idle_fraction(self) -> float:
        """The share of `pp` × the step that ranks spend waiting: the bubble, as this timeline has it."""
        busy = sum(a.end - a.start for a in self.actions)
        return 1.0 - busy / (self.pp * self.step_s)

    def of_rank(self, rank: int) -> tuple[Action, ...]:
        return tuple(a for a in self.actions if a.rank == rank)

    def to_dict(self) -> dict:
        """Plain data for JSON: the fields, each action as a dict of its own."""
        return {"schedule": self.schedule, "pp": self.pp, "micro_batches": self.micro_batches,
                "actions": [dataclasses.asdict(a) for a in self.actions]}

    @classmethod
    def from_dict(cls, data: dict) -> "Timeline":
        """The timeline `to_dict` gave (keys it does not know, such as a measured step's number, are left)."""
        return cls(data["schedule"], data["pp"], data["micro_batches"], tuple(Action(**a) for a in data["actions"]))


def action_order(schedule: str, *, pp: int, micro_batches: int) -> dict[int, list[tuple[int, str, int]]]:
    """Per pipeline rank, its compute actions `(stage, kind, micro_batch)` in the order torch's `schedule` runs them."""
    if virtual_stages(schedule, pp) == 1:
        return {rank: _single_stage_order(schedule, pp=pp, rank=rank, m=micro_batches) for rank in range(pp)}
    return _multi_stage_order(schedule, pp=pp, m=micro_batches)


def _single_stage_order(schedule: str, *, pp: int, rank: int, m: int) -> list[tuple[int, str, int]]:
    """GPipe: every forward, then every backward. 1F1B (`Schedule1F1B._step_microbatches`): `min(m, pp - rank)`
    forwards, then a backward and a forward in turn, then the backwards left."""
    if schedule == "GPipe" or pp == 1:
        return [(rank, FORWARD, i) for i in range(m)] + [(rank, BACKWARD, i) for i in range(m)]
    warmup = min(m, pp - rank)
    order = [(rank, FORWARD, i) for i in range(warmup)]
    for i in range(m):
        order.append((rank, BACKWARD, i))
        if warmup + i < m:
            order.append((rank, FORWARD, warmup + i))
    return order


def _multi_stage_order(schedule: str, *, pp: int, m: int) -> dict[int, list[tuple[int, str, int]]]:
    """The `pipeline_order` torch's multi-stage schedule computes for every rank, compute actions only (an
    overlapped forward-backward pair as its two actions)."""
    import torch.distributed.pipelining as pipelining  # lazy: torch only where a timeline is drawn

    v = virtual_stages(schedule, pp)
    stages = [_stand_in(schedule, pp=pp, v=v, index=i) for i in range(pp * v) if pp_rank_of_stage(
        schedule, pp=pp, index=i) == 0]
    torch_schedule = getattr(pipelining, TABLE[schedule].torch_class)(stages, m, loss_fn=_no_loss)
    return {rank: [step for action in actions if action is not None for step in _compute_steps(action)]
            for rank, actions in torch_schedule.pipeline_order.items()}


def _stand_in(schedule: str, *, pp: int, v: int, index: int) -> types.SimpleNamespace:
    """What a schedule's constructor reads of a `PipelineStage`: its place in the pipeline."""
    return types.SimpleNamespace(stage_index=index, num_stages=pp * v, group_size=pp,
                                 group_rank=pp_rank_of_stage(schedule, pp=pp, index=index), is_first=index == 0,
                                 is_last=index == pp * v - 1, submod=None)


def _no_loss(output, target):  # the schedule only needs to know that there is a backward
    return output


def _compute_steps(action) -> list[tuple[int, str, int]]:
    if action.sub_actions is not None:
        return [step for sub in action.sub_actions for step in _compute_steps(sub)]
    kind = action.computation_type.value
    return [(action.stage_index, kind, action.microbatch_index)] if kind in "FBIW" else []


def backward_units(plan: Plan, stage: Stage) -> tuple[int, int]:
    """(input-gradient part, weight-gradient part) of a backward, in forwards: the recompute (checkpointing) and
    the input gradient in the first, the weight gradient in the second (as heavy as a forward under full
    fine-tuning; a frozen base's adapters' are left out, as `reference.forward_fraction` leaves them)."""
    recompute = plan.checkpointing_of(stage) != "off"
    return 1 + recompute, 1 if plan.spec.method == "full" else 0


def action_seconds(plan: Plan, stage: Stage) -> dict[str, float]:
    """Seconds of each kind of action of one micro-batch on `stage`: its `time_s` cut in the time model's
    shares."""
    inputs, weights = backward_units(plan, stage)
    unit = stage.time_s / (1 + inputs + weights)
    return {FORWARD: unit, BACKWARD: unit * (inputs + weights), INPUT_GRAD: unit * inputs,
            WEIGHT_GRAD: unit * weights}


def plan_timeline(plan: Plan, schedule: Optional[str] = None) -> Timeline:
    """One step of `plan` as its schedule runs it, or as `schedule` would run the same ranks: under a
    single-stage schedule each rank's stages run as one (their seconds added up)."""
    schedule = schedule or plan.schedule
    seconds = {s.index: action_seconds(plan, s) for s in plan.stages}
    if virtual_stages(schedule, plan.pp) == 1 and plan.virtual_stages > 1:
        seconds = {rank: {kind: sum(seconds[s.index][kind] for s in plan.stages_of_rank(rank)) for kind in
                          seconds[0]} for rank in range(plan.pp)}
    elif virtual_stages(schedule, plan.pp) != plan.virtual_stages:
        raise ValueError(f"{schedule} runs {virtual_stages(schedule, plan.pp)} stages a rank; the plan has "
                         f"{plan.virtual_stages}")
    order = action_order(schedule, pp=plan.pp, micro_batches=plan.micro_batches)
    return Timeline(schedule, plan.pp, plan.micro_batches, simulate(order, seconds))


def simulate(order: dict[int, list[tuple[int, str, int]]], seconds: dict[int, dict[str, float]]) -> tuple[Action, ...]:
    """Time every rank's actions: each starts when its rank is free and the actions it needs have ended.

    Args:
        order: per rank, `(stage, kind, micro_batch)` in run order (`action_order`).
        seconds: per stage, the seconds of each kind of action (`action_seconds`).
    """
    last = max(stage for actions in order.values() for stage, _, _ in actions)
    ends: dict[tuple[int, str, int], float] = {}
    clock, nxt, out = {rank: 0.0 for rank in order}, {rank: 0 for rank in order}, []
    while any(nxt[r] < len(order[r]) for r in order):
        progressed = False
        for rank, actions in order.items():
            while nxt[rank] < len(actions):
                stage, kind, mb = actions[nxt[rank]]
                needs = [ends.get(key) for key in _needs(stage, kind, mb, last)]
                if any(t is None for t in needs):
                    break
                start = max([clock[rank], *needs])
                clock[rank] = start + seconds[stage][kind]
                ends.update(dict.fromkeys(_done(stage, kind, mb), clock[rank]))
                out.append(Action(rank, stage, kind, mb, start, clock[rank]))
                nxt[rank], progressed = nxt[rank] + 1, True
        if not progressed:
            raise ValueError(f"the action order deadlocks: {[order[r][nxt[r]] for r in order if nxt[r] < len(order[r])]}")
    return tuple(out)


def _needs(stage: int, kind: str, mb: int, last: int) -> list[tuple[int, str, int]]:
    """The actions that must end before `kind` of micro-batch `mb` on `stage` starts (`last`: the last stage)."""
    if kind == FORWARD:
        return [(stage - 1, FORWARD, mb)] if stage else []
    if kind == WEIGHT_GRAD:
        return [(stage, INPUT_GRAD, mb)]
    return [(stage, FORWARD, mb)] + ([(stage + 1, _GRADIENT_SENT, mb)] if stage < last else [])


def _done(stage: int, kind: str, mb: int) -> list[tuple[int, str, int]]:
    """What the end of an action makes ready: itself, and after a backward or an input gradient, the gradient
    the previous stage waits for."""
    return [(stage, kind, mb)] + ([(stage, _GRADIENT_SENT, mb)] if kind in (BACKWARD, INPUT_GRAD) else [])
