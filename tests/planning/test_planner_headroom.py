"""The planner's memory choices per stage (checkpointing off / on / offload, fp32 or 8-bit moments), on the meta
device: the flagship targets, what a user fixes is kept, host RAM is a budget, and the plan says it all."""
import re
from dataclasses import replace

import pytest

from hfsplit.planning.costs.model import ModelCosts, PartCost
from hfsplit.errors import PlanError
from hfsplit.planning.links import HOST_COPY_LATENCY_S, Link
from hfsplit.plan import Plan, TrainingSpec, rank_total
from hfsplit.planning.search import stage_slots, split_with_choices
from hfsplit.planning.planner import make_plan

GiB = 1 << 30
LLAMA_70B, QWEN_32B = "meta-llama/Llama-3.1-70B", "Qwen/Qwen2.5-32B"
QLORA = TrainingSpec(method="qlora", lora_r=16, seq_len=2048)  # bf16, micro-batch 1: TrainingSpec's defaults
TARGETS = {  # issue 21: (model, budget, spec, options); seq 4096 needs the chunked loss (the head's logits, not the
    # blocks) and, under the 3% margin, 2 micro-batches: at the default 8 torch's receive buffers (8 × 64 MiB a
    # direction, planning/buffers.py) leave it 98% full
    "70B r=16 2x24GiB seq 2048": (LLAMA_70B, "2x24GiB", QLORA, {}),
    "70B r=16 2x24GiB seq 4096": (LLAMA_70B, "2x24GiB", replace(QLORA, seq_len=4096, chunked_loss=True),
                                  {"micro_batches": 2}),
    "32B r=16 1x24GiB seq 4096": (QWEN_32B, "24GiB", replace(QLORA, seq_len=4096, chunked_loss=True), {}),
    "70B r=64 4x24GiB seq 8192": (LLAMA_70B, "4x24GiB", replace(QLORA, lora_r=64, seq_len=8192), {}),
}


def device_use(plan: Plan) -> list[float]:
    """Each device's plan total (its stages together) over its budget."""
    return [rank_total(s.memory for s in plan.stages_of_rank(r)) / plan.stages_of_rank(r)[0].budget
            for r in range(plan.pp)]


@pytest.mark.parametrize("name", TARGETS)
def test_flagship_qlora_targets_fit_with_3_percent_headroom_on_every_card(name):
    model, budget, spec, options = TARGETS[name]
    plan = make_plan(model, budget, spec=spec, headroom=0.03, **options)
    assert max(device_use(plan)) <= 0.97, device_use(plan)
    assert plan.tp == 1 and plan.world_size == int(budget.split("x")[0]) if "x" in budget else 1
    # none of these fits on the device alone: every stage recomputes, and at least one offloads its blocks' inputs or
    # keeps its embedding table in host RAM (a stage whose MLP is tiled may keep its inputs on the device: issue 30's
    # knobs)
    assert {s.checkpointing for s in plan.stages} <= {"on", "offload"}
    assert "offload" in {s.checkpointing for s in plan.stages} or plan.stages[0].host_embedding
    assert Plan.from_json(plan.to_json()) == plan  # each stage's decisions travel with the plan
    tight = make_plan(model, budget, spec=spec, **options)  # without the margin: the fastest that fits, never slower
    assert tight.step_time_s <= plan.step_time_s and max(device_use(tight)) <= 1.0


def test_before_offload_and_8bit_states_the_70b_job_does_not_fit_and_the_fixes_say_so():
    with pytest.raises(PlanError) as err:
        make_plan(LLAMA_70B, "2x24GiB", spec=QLORA, activation_checkpointing=True, optim="adamw_torch",
                  tiled_mlp="off", chunked_loss=False, micro_batches=8)
    assert "offloaded activation checkpointing: block inputs in host RAM (--activation-checkpointing offload)" \
        in str(err.value)
    forced = dict(spec=replace(QLORA, lora_r=64), activation_checkpointing="offload", pp=2, schedule="1F1B",
                  tiled_mlp="off", chunked_loss=False, micro_batches=8)  # issue 30's knobs held: this asks for 8-bit
    low, high = 20 << 10, 40 << 10  # MiB: the smallest budget 8-bit moments fit, to 64 MiB
    while high - low > 64:
        mid = (low + high) // 2
        try:
            make_plan(LLAMA_70B, f"2x{mid}MiB", optim="adamw_8bit", **forced)
            high = mid
        except PlanError:
            low = mid
    with pytest.raises(PlanError, match=r"8-bit optimizer states \(--optim adamw_8bit\)"):
        make_plan(LLAMA_70B, f"2x{high}MiB", optim="adamw_torch", **forced)


def test_what_the_user_fixes_every_stage_runs():
    spec = TrainingSpec(method="lora", seq_len=1024)
    for ac, optim in ((True, "adamw_8bit"), ("offload", "adamw_torch"), (False, "paged_adamw_8bit")):
        plan = make_plan("meta-llama/Llama-3.1-8B", "4x24GiB", spec=spec, activation_checkpointing=ac, optim=optim)
        mode = {True: "on", False: "off"}.get(ac, ac)
        assert {(s.checkpointing, s.optim) for s in plan.stages} == {(mode, optim)}
        assert plan.spec.checkpointing == mode and plan.spec.optim == optim
    roomy = make_plan("meta-llama/Llama-3.1-8B", "4x80GiB", spec=spec)  # auto, where all of it fits: nothing traded
    assert {(s.checkpointing, s.optim) for s in roomy.stages} == {("off", "adamw_torch")}


def test_offload_counts_against_each_local_ranks_share_of_host_ram():
    plan = make_plan(LLAMA_70B, "2x24GiB,cpu:64GiB", spec=QLORA)
    fullest = max(sum(s.memory.offload for s in plan.stages_of_rank(r)) for r in range(plan.pp))
    assert 0 < fullest <= 32 * GiB and any("of its share 32.00 GiB of max_memory['cpu']" in n for n in plan.notes)
    assert "host" in plan.table().splitlines()[2] and "host RAM for activation offload" in plan.table()
    with pytest.raises(PlanError, match=r"more host RAM for the activation offload \(max_memory\['cpu'\] of") as err:
        make_plan(LLAMA_70B, "2x24GiB,cpu:1GiB", spec=QLORA, activation_checkpointing="offload")
    enough = re.search(r"max_memory\['cpu'\] of ([\d.]+) GiB or more", str(err.value)).group(1)
    make_plan(LLAMA_70B, f"2x24GiB,cpu:{enough}GiB", spec=QLORA, activation_checkpointing="offload")  # the fix fits


def toy(state: int, act: int, offload: int = 0, flops: float = 10e12) -> ModelCosts:
    spec = TrainingSpec(method="lora", seq_len=16, reserve_bytes=0, activation_checkpointing="offload" if offload else True)
    block = PartCost(state, 0, 0, act, 0, flops, offload_bytes=offload)
    return ModelCosts(num_layers=8, tp=1, tied=False, spec=spec, embed=PartCost(0, 0, 0, 0, 0, 0.0), block=block,
                      head=PartCost(0, 0, 0, 0, 0, 0.0))


def test_each_rank_runs_the_first_choice_its_layers_fit_under():
    fast, frugal = toy(10, 5), toy(10, 0, offload=5, flops=11e12)  # frugal: a tenth slower (recompute, copies)
    slots = stage_slots([("0",), ("1",)], {"0": 60, "1": 1000}, {}, p=2, d=1, v=1, m=2, schedule="1F1B")
    counts, levels = split_with_choices([fast, frugal], slots)
    assert levels == [1, 0]  # the small card offloads (its 2 in-flight inputs per block), the large one need not
    assert counts == [4, 4]  # balanced, where without the choice the small card takes 3 (20 bytes a layer there)
    assert split_with_choices([fast], slots) is not None  # fewer layers there without the choice...
    assert split_with_choices([fast], slots)[0][0] < counts[0]  # ...so the choice bought layers on the small card


def test_offload_costs_host_link_time_hidden_on_a_side_stream_and_not_on_a_cpu_rank():
    side, inline = Link(bandwidth=50e9, host_bandwidth=1e9), Link(bandwidth=50e9, host_bandwidth=1e9, host_overlap=False)
    assert side.host_copy_s(1e9, 2, compute_s=5.0) == pytest.approx(2 * HOST_COPY_LATENCY_S)  # behind compute
    assert side.host_copy_s(1e9, 2, compute_s=0.25) == pytest.approx(0.75 + 2 * HOST_COPY_LATENCY_S)  # beyond it
    assert inline.host_copy_s(1e9, 2, compute_s=5.0) == pytest.approx(1.0 + 2 * HOST_COPY_LATENCY_S)
    spec = TrainingSpec(method="lora", seq_len=2048)
    common = dict(spec=spec, pp=2, schedule="1F1B", micro_batches=8)
    on = make_plan("meta-llama/Llama-3.1-8B", "2x24GiB", activation_checkpointing=True, **common)
    gpu = make_plan("meta-llama/Llama-3.1-8B", "2x24GiB", activation_checkpointing="offload", **common)
    cpu = make_plan("meta-llama/Llama-3.1-8B", "2x24GiB", activation_checkpointing="offload", link=inline, **common)
    assert on.step_time_s < gpu.step_time_s < on.step_time_s * 1.001  # a GPU: copy launches only
    assert cpu.step_time_s > 1.2 * gpu.step_time_s  # 1 GB/s in line: 0.5 GB a micro-batch per stage shows


def test_hfsplit_plan_takes_the_host_ram_and_prints_per_stage_what_it_trades(capsys):
    from hfsplit.cli.plan import main

    # two GPUs and their host, not three devices; at 4 micro-batches auto picks Interleaved1F1B (two stages a card,
    # hence the per-device line; at the default 8 it no longer fits since the sends its runtime holds until the
    # step's end are counted, planning/buffers.py, and auto takes 1F1B)
    assert main(["plan", LLAMA_70B, "--max-memory", "2x24GiB,cpu:64GiB", "--method", "qlora", "--seq-len",
                 "2048", "--micro-batches", "4"]) == 0
    out = capsys.readouterr().out
    assert "ckpt     moments  host" in out and "offload" in out and "per device, its stages together:" in out
    assert "of max_memory['cpu'] 64.00 GiB (2 local ranks)" in out
    assert main(["plan", LLAMA_70B, "--max-memory", "2x24GiB", "--method", "qlora", "--seq-len", "2048",
                 "--activation-checkpointing", "on", "--optim", "adamw_torch", "--tiled-mlp", "off",
                 "--chunked-loss", "off", "--micro-batches", "8"]) == 2  # fixed by the user: kept
    assert "--activation-checkpointing offload" in capsys.readouterr().err
