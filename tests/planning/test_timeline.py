"""The pipeline timeline: torch's action order per rank, timed by the plan's time model, gives the bubble the
planner's formula gives where stages take equal time, and every action waits for what it needs."""
from types import SimpleNamespace

import pytest

from hfsplit.planning.stage_costs import bubble_fraction
from hfsplit.planning.reference import forward_fraction
from hfsplit.planning.timeline import action_order, action_seconds, plan_timeline, simulate
from hfsplit.schedules import virtual_stages
from tests.planning.byte_plans import byte_plan

SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")


def equal_seconds(schedule: str, pp: int) -> dict[int, dict[str, float]]:
    """Every stage's actions: a forward 1 unit, a backward 2 (its input and weight gradients 1 each), the
    rank's work split evenly over its stages."""
    v = virtual_stages(schedule, pp)
    return {s: {"F": 1 / v, "B": 2 / v, "I": 1 / v, "W": 1 / v} for s in range(pp * v)}


@pytest.mark.parametrize("schedule", ("1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble"))
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16)])
def test_equal_stages_idle_as_the_planners_bubble(schedule, pp, m):
    v = virtual_stages(schedule, pp)
    actions = simulate(action_order(schedule, pp=pp, micro_batches=m), equal_seconds(schedule, pp))
    step = max(a.end for a in actions)
    idle = 1 - sum(a.end - a.start for a in actions) / (pp * step)
    assert idle == pytest.approx(bubble_fraction(schedule, pp, m, v), abs=1e-9)
    assert step == pytest.approx(3 * m / (1 - idle))  # each rank's 3m units of work plus its idle time


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_action_runs_once_after_what_it_needs(schedule):
    pp, m = 4, 8
    actions = simulate(action_order(schedule, pp=pp, micro_batches=m), equal_seconds(schedule, pp))
    end = {(a.stage, a.kind, a.micro_batch): a.end for a in actions}
    start = {(a.stage, a.kind, a.micro_batch): a.start for a in actions}
    assert len(end) == len(actions)  # none twice
    stages = pp * virtual_stages(schedule, pp)
    for s in range(stages):
        for i in range(m):
            backward = (s, "B", i) if (s, "B", i) in end else (s, "I", i)
            assert (s, "F", i) in end and backward in end
            assert end[(s, "F", i)] <= start[backward]
            if s:
                assert end[(s - 1, "F", i)] <= start[(s, "F", i)]
            if s < stages - 1:
                later = (s + 1, "B", i) if (s + 1, "B", i) in end else (s + 1, "I", i)
                assert end[later] <= start[backward]
            if backward[1] == "I":
                assert end[backward] <= start[(s, "W", i)]
    for rank in range(pp):  # a rank runs one action at a time, in its order
        mine = [a for a in actions if a.rank == rank]
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))


def test_1f1b_runs_torchs_runtime_loop_not_its_display_table():
    """Schedule1F1B._step_microbatches: rank r warms up with min(m, p - r) forwards, then a backward and a forward in
    turn (its `pipeline_order` starts the last rank at micro-batch 1: not what runs)."""
    order = action_order("1F1B", pp=4, micro_batches=6)
    assert [k + str(i) for _, k, i in order[3]] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5",
                                                    "B5"]
    assert [k + str(i) for _, k, i in order[0][:6]] == ["F0", "F1", "F2", "F3", "B0", "F4"]


def test_interleaved_order_is_torchs_pipeline_order():
    order = action_order("Interleaved1F1B", pp=2, micro_batches=4)
    assert {s for s, _, _ in order[0]} == {0, 2} and {s for s, _, _ in order[1]} == {1, 3}
    assert order[0][:4] == [(0, "F", 0), (0, "F", 1), (2, "F", 0), (2, "F", 1)]


@pytest.mark.parametrize("method,checkpointing", [("lora", "off"), ("lora", "on"), ("full", "off"), ("full", "offload")])
def test_a_stages_forward_takes_the_time_models_share(method, checkpointing):
    plan = byte_plan(method=method, checkpointing=checkpointing, times=(6.0, 6.0))
    seconds = action_seconds(plan, plan.stages[0])
    assert seconds["F"] / 6.0 == pytest.approx(forward_fraction(SimpleNamespace(spec=plan.spec)))
    assert seconds["F"] + seconds["B"] == pytest.approx(6.0)
    assert seconds["I"] + seconds["W"] == pytest.approx(seconds["B"])


def test_the_slowest_stage_sets_the_pace_and_the_others_wait():
    plan = byte_plan(pp=2, micro_batches=4, times=(1.0, 3.0), method="full")  # F : B = 1 : 2
    timeline = plan_timeline(plan)
    assert timeline.step_s == pytest.approx(1 / 3 + 4 * 3.0 + 2 / 3)  # rank 0's first forward, rank 1's 4 steps, a backward
    assert timeline.idle_fraction == pytest.approx(1 - (4 * 1.0 + 4 * 3.0) / (2 * timeline.step_s))


def test_an_interleaved_plan_against_1f1b_on_the_same_ranks():
    plan = byte_plan(schedule="Interleaved1F1B", pp=2, micro_batches=4, times=(0.5, 0.5, 0.5, 0.5), method="full")
    ours, one_stage = plan_timeline(plan), plan_timeline(plan, "1F1B")
    assert {a.stage for a in one_stage.actions} == {0, 1}
    busy = {r: sum(a.end - a.start for a in t.of_rank(r)) for t in (ours, one_stage) for r in range(2)}
    assert busy[0] == pytest.approx(4.0) and busy[1] == pytest.approx(4.0)
    assert ours.idle_fraction == pytest.approx(bubble_fraction("Interleaved1F1B", 2, 4, 2))
    assert one_stage.idle_fraction == pytest.approx(bubble_fraction("1F1B", 2, 4))
    assert ours.step_s < one_stage.step_s
    with pytest.raises(ValueError, match="2 stages a rank"):
        plan_timeline(byte_plan(pp=2), "Interleaved1F1B")
