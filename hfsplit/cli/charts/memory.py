"""The plan's memory as one bar per GPU: the stages a GPU runs stacked by what they hold, against its budget, with the
host RAM their activation offload takes beside it.

A GPU that runs several stages (interleaved and V schedules) holds their weights, gradients, optimizer states and
kept activations together, but one reserve and one stage's transient workspace at a time (`plan.rank_total`): the bar
counts them so, and its top is the figure the plan table's "per device" line gives.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hfsplit.budget import format_bytes
from hfsplit.cli.charts.style import GIB, PART_COLORS, figure, save, split_title
from hfsplit.plan import Plan, Stage

PARTS = ("weights", "gradients", "optimizer", "activations")


@dataclass(frozen=True)
class Segment:
    """Bytes of one kind (`PARTS`, or "reserve") that `stage` (None for the device's one reserve) holds."""

    stage: Stage | None
    part: str
    bytes: int


@dataclass(frozen=True)
class DeviceBar:
    """One GPU of replica 0: what its stages hold, bottom to top, its budget and its stages' host offload bytes."""

    device: str
    budget: int
    segments: tuple[Segment, ...]
    offload: int

    @property
    def total(self) -> int:
        return sum(s.bytes for s in self.segments)

    @property
    def stages(self) -> tuple[Stage, ...]:
        return tuple(dict.fromkeys(s.stage for s in self.segments if s.stage is not None))


def device_bars(plan: Plan) -> list[DeviceBar]:
    """One bar per device of replica 0 (a TP group's devices each hold their stage's per-rank bytes), by device."""
    devices = sorted({d for s in plan.stages for d in s.devices[0]}, key=_device_order)
    return [_bar(d, [s for s in plan.stages if d in s.devices[0]]) for d in devices]


def _device_order(device: str) -> tuple[int, str]:
    return (int(device), "") if device.isdigit() else (1 << 30, device)


def _bar(device: str, stages: list[Stage]) -> DeviceBar:
    """A device's segments: each stage's state and kept activations, the largest workspace counted once, one
    reserve on top."""
    widest = max(stages, key=lambda s: s.memory.workspace)
    segments = []
    for stage in stages:
        m = stage.memory
        kept = m.activations - (0 if stage is widest else m.workspace)
        segments += [Segment(stage, part, value) for part, value in
                     zip(PARTS, (m.weights, m.gradients, m.optimizer, kept))]
    segments.append(Segment(None, "reserve", stages[0].memory.reserve))
    return DeviceBar(device, min(s.budget for s in stages), tuple(segments), sum(s.memory.offload for s in stages))


def plan_memory_chart(plan: Plan, path: str | Path) -> Path:
    """Draw the plan's memory per GPU (replica 0) into the PNG `path`: stacked bars by what each stage holds, the
    budget and the room left marked, host offload beside each GPU that offloads."""
    bars = device_bars(plan)
    offloads = any(b.offload for b in bars)
    fig, (ax,) = figure(width=max(7.0, 2.2 * len(bars) + 1.5), height=5.2)
    top = max(max(b.budget, b.total, b.offload) for b in bars) / GIB
    ax.set_ylim(0, top * 1.22)
    for x, bar in enumerate(bars):
        _draw_bar(ax, x, bar, pad=top * 0.04)
        if offloads:
            _draw_host(ax, x, bar)
    ax.set_xlim(-0.7, len(bars) - 0.3 + (0.35 if offloads else 0))
    ax.set_xticks(range(len(bars)), [_device_label(b) for b in bars], fontsize=8)
    ax.set_ylabel("GiB")
    fig.suptitle(split_title(plan), fontsize=9)
    _legend(ax, multi=any(len(b.stages) > 1 for b in bars), offloads=offloads)
    return save(fig, path)


def _draw_bar(ax, x: float, bar: DeviceBar, *, pad: float) -> None:
    """The bar, its budget line, and above both its total, share of the budget and the room left."""
    bottom, seen = 0.0, []
    for segment in bar.segments:
        if segment.stage is not None and segment.stage not in seen:
            seen.append(segment.stage)
            if len(seen) > 1:  # a thin line where the next stage's bytes begin
                ax.hlines(bottom, x - 0.3, x + 0.3, colors="white", linewidth=2)
        hatch = "//" if len(seen) > 1 and segment.stage is not None else None
        ax.bar(x, segment.bytes / GIB, bottom=bottom, width=0.6, color=PART_COLORS[segment.part], hatch=hatch,
               edgecolor="white", linewidth=0)
        bottom += segment.bytes / GIB
    budget, free = bar.budget / GIB, bar.budget - bar.total
    if free > 0:  # the room left under the budget, outlined
        ax.bar(x, free / GIB, bottom=bottom, width=0.6, fill=False, edgecolor="#888888", linestyle=":", linewidth=0.8)
    ax.hlines(budget, x - 0.4, x + 0.4, colors="black", linestyles="--", linewidth=1.2)
    room = f"{format_bytes(free)} free" if free >= 0 else f"over by {format_bytes(-free)}"
    ax.text(x, max(bottom, budget) + pad, f"{format_bytes(bar.total)} ({100 * bar.total / bar.budget:.0f}%)\n"
            f"{room}", ha="center", va="bottom", fontsize=7, fontweight="bold")


def _draw_host(ax, x: float, bar: DeviceBar) -> None:
    if not bar.offload:
        return
    ax.bar(x + 0.45, bar.offload / GIB, width=0.18, color=PART_COLORS["host"], hatch="..", edgecolor="#555555",
           linewidth=0.5)
    ax.text(x + 0.45, bar.offload / GIB, f"host\n{format_bytes(bar.offload)}", ha="center", va="bottom", fontsize=6)


def _device_label(bar: DeviceBar) -> str:
    name = f"GPU {bar.device}" if bar.device.isdigit() else bar.device
    stages = "\n".join(f"stage {s.index}: {_layers(s)}" for s in bar.stages)
    return f"{name}\n{stages}"


def _layers(stage: Stage) -> str:
    span = [f"layers {stage.layers[0]}-{stage.layers[1] - 1}"] if stage.num_layers else []
    return ", ".join((["embed"] if stage.has_embed else []) + span + (["head"] if stage.has_head else [])) or "-"


def _legend(ax, *, multi: bool, offloads: bool) -> None:
    from matplotlib.patches import Patch
    from matplotlib.lines import Line2D

    handles = [Patch(color=PART_COLORS[p], label=p) for p in (*PARTS, "reserve")]
    handles.append(Line2D([0], [0], color="black", linestyle="--", label="budget"))
    handles.append(Patch(fill=False, edgecolor="#888888", linestyle=":", label="room left"))
    if multi:
        handles.append(Patch(facecolor="white", edgecolor="#555555", hatch="//", label="second stage on the GPU"))
    if offloads:
        handles.append(Patch(facecolor=PART_COLORS["host"], edgecolor="#555555", hatch="..",
                             label="host RAM (activation offload)"))
    ax.figure.legend(handles=handles, fontsize=7, loc="outside lower center", ncol=5, frameon=False)
