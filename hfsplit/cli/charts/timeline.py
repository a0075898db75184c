"""One step of the plan's pipeline as each rank runs it: forward and backward actions over time, the idle time between
them (the bubble) shaded, the plan's schedule above 1F1B on the same ranks (`hfsplit.planning.timeline`); and a
training step as the ranks ran it above those (`measured_timeline_chart`)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from hfsplit.cli.charts.style import figure, save, split_title
from hfsplit.plan import Plan
from hfsplit.planning.timeline import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Timeline, plan_timeline

KIND_COLORS = {FORWARD: "#4C72B0", BACKWARD: "#DD8452", INPUT_GRAD: "#DD8452", WEIGHT_GRAD: "#C9A227"}
KIND_NAMES = {FORWARD: "forward", BACKWARD: "backward", INPUT_GRAD: "backward, input gradient",
              WEIGHT_GRAD: "backward, weight gradient"}
IDLE = "#F6D6D6"
TIMELINE_PNG = "timeline.png"  # beside the run's timeline.json
WIDTH_IN = 11.0


def compared_schedules(plan: Plan) -> list[str]:
    """The plan's schedule, and 1F1B on the same ranks when the plan chose another (with a pipeline)."""
    return [plan.schedule] + (["1F1B"] if plan.schedule != "1F1B" and plan.pp > 1 else [])


def plan_timeline_chart(plan: Plan, path: str | Path) -> Path:
    """Draw one step of `plan` per rank into the PNG `path`: its schedule's actions timed by the plan's time model,
    and under it 1F1B on the same ranks when the plan chose another schedule, on one time axis."""
    timelines = [plan_timeline(plan, s) for s in compared_schedules(plan)]
    height = 0.9 + sum(0.42 * t.pp + 0.9 for t in timelines)
    fig, axes = figure(width=WIDTH_IN, height=height, rows=len(timelines), sharex=True)
    scale, unit = (1.0, "s") if max(t.step_s for t in timelines) >= 2 else (1e3, "ms")
    for ax, timeline in zip(axes, timelines):
        _draw(ax, timeline, plan, scale=scale)
        ax.set_title(_panel_title(timeline, plan, scale=scale, unit=unit), fontsize=8.5, loc="left")
    axes[-1].set_xlabel(f"time into the step ({unit}), as the plan's time model has it")
    fig.suptitle(split_title(plan), fontsize=9)
    _legend(fig, timelines)
    return save(fig, path)


def measured_timeline_chart(plan: Plan, measured: Timeline, path: str | Path, *, step: int) -> Path:
    """Draw training step `step` as the ranks ran it (`measured`, `hfsplit.training.timeline`) above the same plan's
    timelines as the time model has them (`plan_timeline_chart`'s panels), into the PNG `path`. Each panel keeps its
    own time axis: a model's measured and planned seconds may be far apart (a CPU run, an uncalibrated device)."""
    timelines = [measured] + [plan_timeline(plan, s) for s in compared_schedules(plan)]
    height = 0.9 + sum(0.42 * t.pp + 0.9 for t in timelines)
    fig, axes = figure(width=WIDTH_IN, height=height, rows=len(timelines))
    for index, (ax, timeline) in enumerate(zip(axes, timelines)):
        scale, unit = (1.0, "s") if timeline.step_s >= 2 else (1e3, "ms")
        _draw(ax, timeline, plan, scale=scale)
        title = _measured_title(timeline, step=step, scale=scale, unit=unit) if index == 0 else \
            _panel_title(timeline, plan, scale=scale, unit=unit)
        ax.set_title(title, fontsize=8.5, loc="left")
        ax.set_xlabel(f"time into the step ({unit})" + (", measured" if index == 0 else ", as the plan's time model "
                                                       "has it"), fontsize=7)
    fig.suptitle(split_title(plan), fontsize=9)
    _legend(fig, timelines)
    return save(fig, path)


def run_timeline_chart(timeline_json: str | Path) -> Path:
    """Draw a training run's recorded step (its `timeline.json`, `hfsplit.training.timeline`) beside its plan's
    timelines into `timeline.png` in the same folder, written atomically (the recipe does, at the end of a run). Its
    path."""
    source = Path(timeline_json)
    data = json.loads(source.read_text())
    chart = source.with_name(TIMELINE_PNG)
    tmp = chart.with_name(f"{chart.stem}.tmp{os.getpid()}.png")
    measured_timeline_chart(Plan.from_json(json.dumps(data["plan"])), Timeline.from_dict(data), tmp, step=data["step"])
    os.replace(tmp, chart)
    return chart


def _measured_title(timeline: Timeline, *, step: int, scale: float, unit: str) -> str:
    return (f"{timeline.schedule} as it ran, training step {step}: {timeline.step_s * scale:.1f} {unit} from the "
            f"first forward to the last backward, idle {100 * timeline.idle_fraction:.1f}% of the ranks' time")


def _draw(ax, timeline: Timeline, plan: Plan, *, scale: float) -> None:
    """Rank rows top to bottom: the step shaded as idle, each action over it, its micro-batch written where it fits."""
    step = timeline.step_s * scale
    for rank in range(timeline.pp):
        ax.barh(rank, step, left=0, height=0.8, color=IDLE, linewidth=0)
        for action in timeline.of_rank(rank):
            width = (action.end - action.start) * scale
            second = action.stage >= timeline.pp  # a multi-stage rank's later stage: a lighter shade
            ax.barh(rank, width, left=action.start * scale, height=0.8, color=KIND_COLORS[action.kind],
                    alpha=0.55 if second else 1.0, edgecolor="white", linewidth=0.4)
            if width / step * WIDTH_IN > 0.16:
                ax.text((action.start * scale) + width / 2, rank, str(action.micro_batch), ha="center",
                        va="center", fontsize=6, color="black" if second else "white")
    ax.set_yticks(range(timeline.pp), [_rank_label(plan, r) for r in range(timeline.pp)], fontsize=7)
    ax.set_ylim(timeline.pp - 0.4, -0.6)
    ax.tick_params(axis="x", labelsize=7)


def _rank_label(plan: Plan, rank: int) -> str:
    devices = ", ".join(plan.stages_of_rank(rank)[0].devices[0])
    return f"rank {rank} (GPU {devices})" if devices[0].isdigit() else f"rank {rank} ({devices})"


def _panel_title(timeline: Timeline, plan: Plan, *, scale: float, unit: str) -> str:
    ours = timeline.schedule == plan.schedule
    what = "the plan's schedule" if ours else "the same ranks under 1F1B, each rank's stages run as one"
    line = (f"{timeline.schedule} ({what}): step {timeline.step_s * scale:.1f} {unit}, "
            f"idle {100 * timeline.idle_fraction:.1f}% of the ranks' time")
    if ours:
        line += f"  (the plan: step {plan.step_time_s * scale:.1f} {unit}, bubble {100 * plan.bubble_fraction:.1f}%)"
    return line


def _legend(fig, timelines: list[Timeline]) -> None:
    from matplotlib.patches import Patch

    kinds = dict.fromkeys(a.kind for t in timelines for a in t.actions)
    handles = [Patch(color=KIND_COLORS[k], label=KIND_NAMES[k]) for k in kinds]
    handles.append(Patch(color=IDLE, label="idle (the bubble)"))
    if any(a.stage >= t.pp for t in timelines for a in t.actions):
        handles.append(Patch(color="#999999", alpha=0.55, label="lighter: the rank's second stage"))
    fig.legend(handles=handles, fontsize=7, loc="outside lower center", ncol=len(handles), frameon=False)
