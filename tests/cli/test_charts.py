"""The pictures of a plan: one memory bar per GPU holding its stages as the plan counts them, and the timeline."""
import matplotlib.image

from hfsplit.cli.charts import device_bars, plan_memory_chart, plan_timeline_chart
from hfsplit.cli.charts.timeline import compared_schedules
from hfsplit.plan import StageMemory, rank_total
from tests.planning.byte_plans import byte_plan

OFFLOADED = StageMemory(weights=10, gradients=1, optimizer=2, activations=5, reserve=4, workspace=3, offload=7)


def test_a_gpu_running_two_stages_is_one_bar_of_both_with_one_reserve_and_workspace():
    plan = byte_plan(schedule="Interleaved1F1B", pp=2, memories=(OFFLOADED,) + (StageMemory(
        weights=20, gradients=1, optimizer=2, activations=9, reserve=4, workspace=6),) * 3)
    bars = device_bars(plan)
    assert [b.device for b in bars] == ["0", "1"]
    for bar in bars:
        mine = plan.stages_of_rank(int(bar.device))
        assert bar.stages == mine
        assert bar.total == rank_total(s.memory for s in mine)
        assert [s.part for s in bar.segments].count("reserve") == 1
    assert bars[0].total == 10 + 1 + 2 + (5 - 3) + 20 + 1 + 2 + 9 + 4  # stage 2's workspace is the larger: kept
    assert bars[0].offload == 7 + 0 and bars[1].offload == 0


def test_bars_follow_the_devices_not_the_stages():
    """Stage 0 on device 1 and stage 1 on device 0 (the larger card holds the head): bars in device order."""
    plan = byte_plan(pp=2, devices=(("1",), ("0",)))
    assert [(b.device, b.stages[0].index) for b in device_bars(plan)] == [("0", 1), ("1", 0)]


def test_a_tp_group_draws_a_bar_per_gpu():
    plan = byte_plan(pp=2, devices=(("0", "1"), ("2", "3")))
    assert [b.device for b in device_bars(plan)] == ["0", "1", "2", "3"]
    assert device_bars(plan)[1].total == plan.stages[0].memory.total


def test_the_charts_are_pngs(tmp_path):
    plan = byte_plan(schedule="ZBVZeroBubble", pp=2, micro_batches=4, memories=(OFFLOADED,) * 4, method="full")
    for draw in (plan_memory_chart, plan_timeline_chart):
        path = draw(plan, tmp_path / f"{draw.__name__}.png")
        height, width, _ = matplotlib.image.imread(path).shape
        assert width > 500 and height > 200, (draw.__name__, width, height)


def test_the_timeline_sets_the_plans_schedule_against_1f1b():
    assert compared_schedules(byte_plan(schedule="Interleaved1F1B")) == ["Interleaved1F1B", "1F1B"]
    assert compared_schedules(byte_plan(schedule="1F1B")) == ["1F1B"]


def test_plan_png_of_gpt_oss_120b_draws_four_gpus_at_the_tables_per_device_figures(tmp_path, capsys):
    """Issue 33: two stages a GPU under Interleaved1F1B were drawn as eight bars against the whole budget; now one
    bar a GPU, topping out at the figure the plan table gives for the GPU."""
    from hfsplit.budget import format_bytes
    from hfsplit.cli.plan import main
    from hfsplit.plan import Plan

    png = tmp_path / "plan.png"
    assert main(["plan", "openai/gpt-oss-120b", "--max-memory", "4xRTX4090", "--qlora", "--lora-r", "16",
                 "--seq-len", "2048", "--micro-batch-size", "1", "--host-embedding", "off",  # rank 0 offloads
                 "--json", "--png", str(png)]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    bars = device_bars(plan)
    assert plan.virtual_stages == 2 and [b.device for b in bars] == ["0", "1", "2", "3"]
    per_device = plan.table().split("per device, its stages together: ")[1].splitlines()[0]
    for bar in bars:
        assert f"{bar.device} {format_bytes(bar.total)} of {format_bytes(bar.budget)}" in per_device
    assert bars[0].offload == sum(s.memory.offload for s in plan.stages_of_rank(0)) > 0
    assert matplotlib.image.imread(png).shape[1] > 500
