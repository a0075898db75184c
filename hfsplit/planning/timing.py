"""The time model's figures: the planner's FLOP/s unit, datasheet peaks of known GPUs, and how a run's measured
times compare with the plan's estimate.

The planner's step estimate is FLOPs / throughput. A datasheet peak misleads by orders of magnitude on CPU
ranks (and by 2-3× on GPUs, where attention and elementwise kernels run far below the matmul peak), so a
launched run measures its devices (`hfsplit.load.probes`); `hfsplit plan` on a machine without the target GPUs
uses the bundled table of GPU kinds (`hfsplit.gpu_kinds`, `hfsplit.planning.kind_rates`). The link between ranks is `hfsplit.planning.links`.
"""
from __future__ import annotations

import statistics
from typing import Optional

from hfsplit.gpu_kinds import gpu_kind, is_gpu_kind, kind_of_device_name
from hfsplit.plan import coordinates_of_rank

# Effective dense throughput of a device of speed 1 (the planner's unit). Only
# ratios between plans matter for the choice; absolute step times are rough estimates.
DEVICE_FLOPS = 100e12 * 0.4


def known_flops(name: str) -> Optional[float]:
    """Expected FLOP/s of a GPU named like `name` ("H100", "NVIDIA A100-SXM4-80GB") from the bundled table
    (`hfsplit.gpu_kinds`: peak dense bf16 × the kind's efficiency); None for a GPU the table lacks."""
    kind = gpu_kind(name) if is_gpu_kind(name) else kind_of_device_name(name)
    return kind.expected_flops if kind is not None else None


def time_report(plan, step_times_s: list[float], busy_s: list[float]) -> str:
    """The plan's step estimate beside the measured median step, and per pipeline rank the estimated busy
    time per step (its stages' forward + backward × micro-batches) beside the measured one.

    Args:
        plan: the run's Plan.
        step_times_s: measured wall time of every step (the first, which builds the schedule, is not timed).
        busy_s: per global rank, seconds its schedule spent in its stages' work over the timed steps.
    """
    if not step_times_s:
        return "time model: no step was timed"
    measured = statistics.median(step_times_s)
    lines = [f"time model: estimated step {plan.step_time_s * 1e3:.1f} ms, measured median {measured * 1e3:.1f} ms "
             f"(× {measured / plan.step_time_s:.2f})"]
    for pp_rank, estimate, busy in pipeline_busy(plan, step_times_s, busy_s):
        layers = ", ".join(f"{s.layers[0]}-{s.layers[1] - 1}" for s in plan.stages_of_rank(pp_rank))
        lines.append(f"  pipeline rank {pp_rank} (layers {layers}): estimated busy {estimate * 1e3:.1f} ms, "
                     f"measured {busy * 1e3:.1f} ms per step")
    return "\n".join(lines)


def pipeline_busy(plan, step_times_s: list[float], busy_s: list[float]) -> list[tuple[int, float, float]]:
    """(pipeline rank, estimated busy seconds per step, measured busy seconds per timed step), one per
    pipeline rank (replicas and TP peers run the same stages)."""
    timed = max(len(step_times_s) - 1, 1)  # Metrics leaves the first step out of the busy total
    rows = []
    for rank, busy in enumerate(busy_s):
        c = coordinates_of_rank(plan, rank=rank)
        if not (c.dp or c.tp):
            rows.append((c.pp, sum(s.time_s for s in plan.stages_of_rank(c.pp)) * plan.micro_batches, busy / timed))
    return rows
