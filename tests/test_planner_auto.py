"""What `auto` chooses by the time model beyond the schedule: how a given global batch is cut into micro-batches."""
from dataclasses import replace

import pytest
from transformers import LlamaConfig

from hfsplit.costs import TrainingSpec
from hfsplit.errors import PlanError
from hfsplit.links import Link
from hfsplit.planner import make_plan

CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=64)
SPEC = TrainingSpec(method="full", seq_len=32, micro_batch_size=2, dtype="float32", reserve_bytes=0)
SPEEDS = {"0": 1e-3, "1": 1e-3}


def _cut(plan) -> tuple[int, int]:
    return plan.spec.micro_batch_size, plan.micro_batches


def _forced(plan, link: Link, budget: str = "2x1GiB"):
    """The same split planned with its cut given by hand."""
    b, m = _cut(plan)
    return make_plan(CONFIG, budget, spec=replace(SPEC, micro_batch_size=b), pp=2, micro_batches=m,
                     schedule=plan.schedule, device_speeds=SPEEDS, link=link)


FREE = Link(bandwidth=1e12, measured=True)  # no cost per micro-batch: the smallest micro-batches, least bubble
COSTLY = Link(bandwidth=1e12, action_s=1.0, measured=True)  # a second per action: the fewest micro-batches


def test_auto_cuts_a_global_batch_by_the_time_model_within_memory_and_the_plan_stays_true():
    common = dict(spec=SPEC, pp=2, global_batch=16, micro_batches="auto", device_speeds=SPEEDS)
    free = make_plan(CONFIG, "2x1GiB", link=FREE, **common)
    costly = make_plan(CONFIG, "2x1GiB", link=COSTLY, **common)
    assert _cut(free) == (1, 16) and _cut(costly) == (2, 8)
    for plan, link in ((free, FREE), (costly, COSTLY)):
        b, m = _cut(plan)
        note = next(n for n in plan.notes if n.startswith("micro-batches auto cut 16 rows per replica"))
        assert f"as {b} × {m}:" in note and all(c in note for c in ("1 × 16", "2 × 8"))
        forced = _forced(plan, link)  # memory and time are those of the chosen cut, exactly
        assert [s.memory for s in forced.stages] == [s.memory for s in plan.stages]
        assert forced.step_time_s == pytest.approx(plan.step_time_s)
    # a budget the 2-row micro-batches overrun (their activations) but 1-row ones fit: the cut stays within it
    assert costly.schedule == "1F1B"  # (one stage per rank: a stage's total is its rank's)
    one = max(s.memory.total for s in _forced(replace(costly, spec=replace(SPEC, micro_batch_size=1),
                                                      micro_batches=16), COSTLY).stages)
    assert one < max(s.memory.total for s in costly.stages)
    tight = make_plan(CONFIG, f"2x{one}B", link=COSTLY, activation_checkpointing=False, **common)
    assert _cut(tight) == (1, 16) and tight.step_time_s > costly.step_time_s


def test_auto_cut_keeps_the_rows_per_replica_and_needs_a_global_batch():
    plan = make_plan(CONFIG, "2x1GiB", spec=SPEC, global_batch=12, micro_batches="auto", device_speeds=SPEEDS,
                     link=COSTLY, dp=2, pp=1, tp=1, world_size=2)
    assert plan.dp == 2 and _cut(plan) == (2, 3)  # 6 rows per replica; the costly actions want the largest size
    with pytest.raises(PlanError, match="pass global_batch"):
        make_plan(CONFIG, "2x1GiB", spec=SPEC, micro_batches="auto")
