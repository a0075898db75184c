"""An inference plan budgets generation: every stage holds its layers' KV cache for the whole rollout batch (issue 31)."""
import pytest

from hfsplit.checkpoint import load_config
from hfsplit.plan import TrainingSpec
from hfsplit.planning.costs.model import kv_cache_bytes
from hfsplit.planning.planner import make_plan

MODEL = "meta-llama/Llama-3.1-8B"  # bundled config: plans offline


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "ZBVZeroBubble"])
def test_every_stage_holds_the_kv_cache_of_the_whole_rollout_batch(schedule):
    """Micro-batches × micro-batch size sequences of seq_len tokens (prompt and new tokens), whatever the schedule
    (a training schedule holds only its micro-batches in flight; generation keeps every one's cache)."""
    spec = TrainingSpec(method="inference", seq_len=1024, micro_batch_size=4)
    per_block = kv_cache_bytes(load_config(MODEL), spec, 1)
    assert per_block == 2 * 4 * 1024 * 8 * 128 * 2  # keys and values, 4 rows × 1024 positions × 8 kv heads × 128, bf16
    for micro_batches in (2, 8):
        plan = make_plan(MODEL, "2x24GiB", spec=spec, pp=2, micro_batches=micro_batches, schedule=schedule)
        for stage in plan.stages:
            cache = stage.memory.activations - stage.memory.workspace
            assert cache == micro_batches * (stage.layers[1] - stage.layers[0]) * per_block, (schedule, stage)


def test_the_rollout_batch_sets_the_micro_batches():
    """`global_batch` states the rollout batch: 32 sequences in micro-batches of 4 are 8 micro-batches."""
    spec = TrainingSpec(method="inference", seq_len=1024, micro_batch_size=4)
    plan = make_plan(MODEL, "2x24GiB", spec=spec, pp=2, global_batch=32)
    assert plan.micro_batches == 8
    longer = make_plan(MODEL, "2x24GiB", spec=TrainingSpec(method="inference", seq_len=2048, micro_batch_size=4),
                       pp=2, global_batch=32, schedule=plan.schedule)
    grown = [b.memory.activations - b.memory.workspace - (a.memory.activations - a.memory.workspace)
             for a, b in zip(plan.stages, longer.stages) if a.layers == b.layers]
    assert grown and all(g > 0 for g in grown)
