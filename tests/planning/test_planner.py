"""Planner tests on toy costs with integer budgets: exact assignments and brute-force optima."""
import itertools

import pytest

from hfsplit.plan import TrainingSpec
from hfsplit.planning.costs.model import ModelCosts, PartCost
from hfsplit.errors import PlanError
from hfsplit.planning.stage_costs import rank_fits
from hfsplit.planning.stage_costs import rank_times, bubble_fraction, in_flight
from hfsplit.planning.search import stage_slots, split_layers
from hfsplit.planning.planner import make_plan


def toy_costs(layers=8, *, block_state=10, block_act=2, embed_state=20, head_state=30, head_act=5, tied=False,
              reserve=0):
    spec = TrainingSpec(method="lora", seq_len=16, reserve_bytes=reserve)
    return ModelCosts(
        num_layers=layers, tp=1, tied=tied, spec=spec,
        embed=PartCost(embed_state, 0, 0, 1, 0, 1.0),
        block=PartCost(block_state, 0, 0, block_act, 0, 10.0),
        head=PartCost(head_state, 0, 0, head_act, 0, 4.0),
    )


def make_slots(budgets, *, m=4, schedule="1F1B", speeds=None):
    groups = [(str(i),) for i in range(len(budgets))]
    return stage_slots(groups, {str(i): b for i, b in enumerate(budgets)}, speeds or {}, p=len(budgets), d=1, v=1,
                  m=m, schedule=schedule)


def brute_force(costs, slots):
    """Min over every composition of the layers of the slowest rank's time, within caps."""
    best = None
    L, P = costs.num_layers, len(slots)
    for cuts in itertools.combinations(range(1, L), P - 1):
        counts = [b - a for a, b in zip((0,) + cuts, cuts + (L,))]
        if all(rank_fits(costs, slots, counts, s.pp_rank) for s in slots):
            slowest = max(rank_times(costs, slots, counts).values())
            best = slowest if best is None else min(best, slowest)
    return best


def test_even_budgets_give_even_split():
    costs = toy_costs(8)
    slots = make_slots([10_000] * 4)
    assert split_layers(costs, slots) == [2, 2, 2, 2]


def test_memory_cap_moves_layers_to_the_larger_card_only_when_full():
    costs = toy_costs(8, block_act=0)
    # stage 0: embed 20 + 10/layer + 2 in-flight embedding outputs of 1 byte.
    assert split_layers(costs, make_slots([62, 10_000])) == [4, 4]
    assert split_layers(costs, make_slots([61, 10_000])) == [3, 5]
    assert split_layers(costs, make_slots([32, 10_000])) == [1, 7]
    assert split_layers(costs, make_slots([31, 10_000])) is None


def test_in_flight_activations_count_per_schedule():
    assert [in_flight("1F1B", p=4, m=8, v=1, pp_rank=r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1F1B", p=4, m=2, v=1, pp_rank=r) for r in range(4)] == [2, 2, 2, 1]
    assert [in_flight("GPipe", p=4, m=8, v=1, pp_rank=r) for r in range(4)] == [8] * 4
    # the schedules the planner runs only when named: LoopedBFS (every forward on a stage before its backwards)
    # and InterleavedZeroBubble (its order not modelled): every micro-batch, the upper bound
    for name in ("LoopedBFS", "InterleavedZeroBubble"):
        assert [in_flight(name, p=2, m=4, v=2, pp_rank=r, index=i) for r in range(2) for i in (r, r + 2)] == [4] * 4
    # 1F1B holds more activations on stage 0, so a tight cap there takes fewer layers.
    costs = toy_costs(8, block_state=10, block_act=5)
    assert split_layers(costs, make_slots([150, 150], m=4)) == [4, 4]  # stage 0: 20+4*10+2*(4*5+1)=102
    assert split_layers(costs, make_slots([100, 1000], m=4)) == [3, 5]


def test_faster_device_gets_more_layers():
    costs = toy_costs(9)
    slots = make_slots([10_000, 10_000], speeds={"0": 2.0})
    counts = split_layers(costs, slots)
    assert counts[0] > counts[1]


@pytest.mark.parametrize("layers, budgets, act, m, schedule", [
    (6, [80, 80, 80], 2, 4, "1F1B"),
    (7, [200, 60, 60], 3, 4, "1F1B"),
    (9, [100, 120, 70, 200], 1, 8, "1F1B"),
    (8, [300, 100], 4, 3, "GPipe"),
    (10, [90, 150, 120], 0, 2, "1F1B"),
    (12, [120, 70, 100, 90], 2, 6, "1F1B"),
])
def test_greedy_split_equals_brute_force_optimum(layers, budgets, act, m, schedule):
    costs = toy_costs(layers, block_act=act)
    slots = make_slots(budgets, m=m, schedule=schedule)
    counts = split_layers(costs, slots)
    expected = brute_force(costs, slots)
    if expected is None:
        assert counts is None
    else:
        assert counts is not None and sum(counts) == layers
        assert all(rank_fits(costs, slots, counts, s.pp_rank) for s in slots)
        assert max(rank_times(costs, slots, counts).values()) == pytest.approx(expected)


def test_bubble_fraction():
    assert bubble_fraction("1F1B", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("GPipe", 2, 8) == pytest.approx(1 / 9)
    assert bubble_fraction("Interleaved1F1B", 4, 8, v=2) == pytest.approx(3 / 19)
    assert bubble_fraction("ZBVZeroBubble", 4, 8, v=2) < bubble_fraction("Interleaved1F1B", 4, 8, v=2)
    assert bubble_fraction("1F1B", 1, 8) == 0.0


def test_tied_matrix_counted_once_on_a_single_stage():
    from hfsplit.planning.stage_costs import stage_memory

    costs = toy_costs(2, tied=True, embed_state=20, head_state=25, block_act=0)
    (slot,) = make_slots([10_000])
    assert stage_memory(costs, slot, 2).weights == 2 * 10 + 25  # head (norm 5 + matrix 20); embed shares it
    first, last = make_slots([10_000, 10_000])
    assert stage_memory(costs, first, 1).weights + stage_memory(costs, last, 1).weights == 2 * 10 + 20 + 25


def test_a_model_whose_tp_plan_hfsplit_cannot_shard_is_planned_at_tp_1():
    """Phi-3's plan gathers its fused projections' outputs (colwise_gather_output, then rowwise_split_input): tp=2
    plans. The same plan with a style hfsplit does not shard plans at tp=1, and tp=2 asked for is refused by name."""
    from hfsplit.checkpoint.synthetic import tiny_config

    spec = TrainingSpec(method="full", seq_len=64, dtype="float32", reserve_bytes=0)
    config = tiny_config("phi3")
    assert make_plan(config, "2x1GiB", spec=spec, tp=2).tp == 2
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.self_attn.qkv_proj": "local_params"}
    assert make_plan(config, "2x1GiB", spec=spec).tp == 1
    with pytest.raises(PlanError, match=r"tp=2.*local_params.*use tp=1"):
        make_plan(config, "2x1GiB", spec=spec, tp=2)


# --- schedule auto ------------------------------------------------------------------------------

AUTO_CASES = [
    ("meta-llama/Llama-3.1-8B", "4x24GiB", dict(method="lora", seq_len=2048), {}),
    ("meta-llama/Llama-3.1-8B", "2x80GiB", dict(method="full", seq_len=1024), dict(pp=2)),
    ("Qwen/Qwen2.5-14B", "24GiB,12GiB,12GiB", dict(method="lora", seq_len=2048), dict(micro_batches=6)),
]


@pytest.mark.parametrize("model, budget, spec, forced", AUTO_CASES)
def test_schedule_auto_fits_and_is_never_slower_by_the_model_than_a_hand_picked_one(model, budget, spec, forced):
    from hfsplit.errors import PlanError
    from hfsplit.parallel.mesh import check_plan_for_world
    from hfsplit.schedules import AUTO_CANDIDATES, min_micro_batches

    spec = TrainingSpec(**spec)
    auto = make_plan(model, budget, spec=spec, **forced)
    check_plan_for_world(auto, world_size=auto.world_size)  # a layout torch runs
    assert all(s.memory.total <= s.budget for s in auto.stages)
    assert auto.pp == 1 or auto.micro_batches >= min_micro_batches(auto.schedule, auto.pp)
    if "micro_batches" in forced:
        assert auto.micro_batches == forced["micro_batches"]
    picked = []
    for name in AUTO_CANDIDATES + ("GPipe", "DualPipeV"):
        try:
            picked.append(make_plan(model, budget, spec=spec, schedule=name, **forced))
        except PlanError:
            continue
    rate = lambda p: p.dp * p.micro_batches / p.step_time_s  # noqa: E731
    assert picked and rate(auto) >= max(rate(p) for p in picked) * (1 - 1e-9)
    if auto.pp > 1:
        note = next(n for n in auto.notes if n.startswith("schedule auto chose"))
        assert auto.schedule in note and "1F1B" in note and " ms" in note


def test_dual_pipe_v_needs_two_micro_batches_per_stage():
    from hfsplit.errors import PlanError

    with pytest.raises(PlanError, match="raise --micro-batches to at least 4"):
        make_plan("meta-llama/Llama-3.1-8B", "2x80GiB", pp=2, micro_batches=3, schedule="DualPipeV")
    assert make_plan("meta-llama/Llama-3.1-8B", "2x80GiB", pp=2, micro_batches=4, schedule="DualPipeV").virtual_stages == 2
