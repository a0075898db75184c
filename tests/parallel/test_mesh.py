"""Rank layout arithmetic (no processes)."""
import pytest

from hfsplit.parallel.mesh import coordinates_of_rank, schedule_pp_rank
from hfsplit.parallel.split_model import micro_batches_for


class _Plan:
    pp, tp, dp = 2, 2, 2


@pytest.mark.parametrize("rank, expected", [(0, (0, 0, 0)), (1, (0, 0, 1)), (2, (0, 1, 0)), (5, (1, 0, 1)), (7, (1, 1, 1))])
def test_coordinates_are_row_major_over_dp_pp_tp(rank, expected):
    c = coordinates_of_rank(_Plan, rank=rank)
    assert (c.dp, c.pp, c.tp) == expected


@pytest.mark.parametrize("schedule, ranks", [
    ("Interleaved1F1B", [0, 1, 0, 1]),
    ("ZBVZeroBubble", [0, 1, 1, 0]),
])
def test_schedule_pp_rank_follows_torch_layout(schedule, ranks):
    assert [schedule_pp_rank(schedule=schedule, pp=2, index=i) for i in range(4)] == ranks


@pytest.mark.parametrize("batch, planned, expected", [(8, 4, 4), (6, 4, 3), (1, 4, 1), (4, 8, 4)])
def test_micro_batches_divide_the_batch(batch, planned, expected):
    assert micro_batches_for(batch=batch, planned=planned) == expected
