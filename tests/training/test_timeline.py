"""A training step's measured timeline (issue 33): the clocks put on rank 0's, the actions from the step's start,
the file and chart it is written as, and the stage timer's reading of torch's chunk calls. The run that records one
is tests/training/test_trainer.py::test_epochs_and_evaluation (two ranks, pp=2)."""
import json

import matplotlib.image
import pytest

from hfsplit.cli.charts import run_timeline_chart
from hfsplit.parallel.pipeline import StageTimer, chunk_kind
from hfsplit.planning.timeline import Action, plan_timeline
from hfsplit.training.timeline import (
    TIMELINE_JSON, clock_offsets, from_zero, read_timeline, recorded_step, write_timeline,
)
from tests.planning.byte_plans import byte_plan


def test_ranks_on_rank_0s_host_share_its_clock_and_another_host_takes_its_median_reading():
    """Ranks 0, 1 on host a read after the barrier at 10.0 and 10.2 (one clock: no offset, whatever the reading);
    ranks 2, 3 and 4 on host b at 55.1, 55.0 and 57.0 (one descheduled): b's clock is 45.1 s ahead."""
    offsets = clock_offsets(["a", "a", "b", "b", "b"], [10.0, 10.2, 55.1, 55.0, 57.0])
    assert offsets == pytest.approx([0.0, 0.0, 45.1, 45.1, 45.1])


def test_the_step_starts_at_its_first_action_and_each_rank_lists_its_own_in_the_order_they_ran():
    actions = [Action(1, 1, "F", 0, 7.0, 8.0), Action(0, 0, "B", 0, 9.0, 11.0), Action(0, 0, "F", 0, 5.0, 6.0)]
    assert from_zero(actions) == (Action(0, 0, "F", 0, 0.0, 1.0), Action(0, 0, "B", 0, 4.0, 6.0),
                                  Action(1, 1, "F", 0, 2.0, 3.0))


def test_the_last_step_unless_told():
    assert recorded_step(None, total_steps=20) == 20
    assert recorded_step(3, total_steps=20) == 3 and recorded_step(0, total_steps=20) == 0


def test_the_file_holds_the_timeline_and_its_step_and_the_chart_is_drawn_beside_it(tmp_path):
    plan = byte_plan(schedule="Interleaved1F1B", pp=2, micro_batches=4, times=(0.5, 0.5, 0.5, 0.5), method="full")
    measured = plan_timeline(plan, "1F1B")  # a stand-in of the right shape
    json_path = write_timeline(measured, plan, str(tmp_path), step=7)
    assert json_path.name == TIMELINE_JSON and read_timeline(str(tmp_path)) == (7, measured)
    png_path = run_timeline_chart(json_path)  # the recipe's, from the file alone: it holds the plan too
    # rank 0's two stages as one under 1F1B: a forward is a third of their 2 × 0.5 s (full: a backward is two)
    assert json.loads(json_path.read_text())["actions"][0] == {"rank": 0, "stage": 0, "kind": "F", "micro_batch": 0,
                                                               "start": 0.0, "end": pytest.approx(1 / 3)}
    height, width, _ = matplotlib.image.imread(png_path).shape
    assert width > 500 and height > 400  # three panels: as it ran, the plan's schedule, 1F1B
    assert sorted(p.name for p in tmp_path.iterdir()) == [TIMELINE_JSON, "timeline.png"]  # no temporary file left


@pytest.mark.parametrize("name, args, kwargs, kind", [
    ("forward_one_chunk", ((), {}), {}, "F"),
    ("backward_one_chunk", (), {"loss": None, "last_backward": True}, "B"),
    ("backward_one_chunk", (), {"loss": None, "full_backward": False}, "I"),
    ("backward_one_chunk", (None, False), {}, "I"),
    ("backward_weight_one_chunk", (), {"last_backward": True}, "W"),
])
def test_a_chunk_call_is_the_action_torch_runs(name, args, kwargs, kind):
    """How torch's schedules call a stage (schedules.py: the micro-batch first, `full_backward=` by keyword)."""
    assert chunk_kind(name, args, kwargs) == kind


def test_the_timer_records_only_while_asked_and_the_loss_ends_the_forward_it_follows():
    stage = type("Stage", (), {"stage_index": 3, "forward_one_chunk": lambda self, i, args, kwargs=None: i})()
    timer = StageTimer()
    timer.watch([stage])
    loss = timer.with_loss_in_forward(lambda output, target: output - target)
    stage.forward_one_chunk(0, ())
    kept: list = []
    with timer.recording(kept):
        assert stage.forward_one_chunk(1, ()) == 1
        ended = kept[-1][4]
        assert loss(5, 2) == 3
    stage.forward_one_chunk(2, ())
    assert [(s, k, mb) for s, k, mb, _, _ in kept] == [(3, "F", 1)]
    assert kept[0][3] <= ended <= kept[0][4]  # the loss's time is the forward's
    assert timer.busy_s > 0
