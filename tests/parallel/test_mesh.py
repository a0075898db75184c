"""Rank layout arithmetic (no processes)."""
import pytest

from hfsplit.parallel.mesh import launcher_world, schedule_pp_rank
from hfsplit.plan import coordinates_of_rank
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


def test_each_rank_runs_on_the_gpu_its_stage_was_planned_for():
    """Mismatched GPUs: the planner may put stage 0 on GPU 1; that rank must then use GPU 1, not GPU 0."""
    from hfsplit.plan import TrainingSpec
    from hfsplit.parallel.mesh import gpu_index_of_rank
    from hfsplit.planning.planner import make_plan

    plan = make_plan("Qwen/Qwen2.5-14B", "24GiB,12GiB,12GiB", spec=TrainingSpec(method="lora", seq_len=2048, lora_r=16),
                     schedule="1F1B")  # one stage per rank: the reorder shows
    planned = {s.pp_rank: int(s.devices[0][0]) for s in plan.stages}
    chosen = {rank: gpu_index_of_rank(plan, rank=rank, local_rank=rank, gpus_per_host=3) for rank in range(3)}
    assert chosen == planned and sorted(chosen.values()) == [0, 1, 2]
    assert any(gpu != rank for rank, gpu in chosen.items())  # the plan did reorder the GPUs
    # the same plan on three one-GPU hosts: each host's only GPU
    assert {gpu_index_of_rank(plan, rank=r, local_rank=0, gpus_per_host=1) for r in range(3)} == {0}


def test_the_launchers_world_carries_torchruns_restart_count_and_run_id(monkeypatch):
    """Elastic code reads the restart count and the job id from the World, never from the environment."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    first = launcher_world()
    assert (first.rank, first.world_size, first.restart_count, first.run_id) == (0, 1, 0, None)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    restarted = launcher_world()
    assert (restarted.rank, restarted.world_size, restarted.restart_count, restarted.run_id) == (3, 4, 2, "job-7")


def test_a_torch_without_loss_kwargs_still_hands_the_step_its_token_count():
    """Under torch before 2.12 a schedule calls the loss with (output, target) alone; the step's
    `num_items_in_batch` reaches transformers' causal-LM loss through `with_step_kwargs` all the same."""
    import torch

    from hfsplit.models.loss import causal_lm_loss
    from hfsplit.parallel.pipeline import with_step_kwargs

    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(2, 5, 11, generator=gen), torch.randint(0, 11, (2, 5), generator=gen)
    loss, held = causal_lm_loss(11), {}
    wrapped = with_step_kwargs(loss, held)
    held["num_items_in_batch"] = 40  # the step's label tokens over the whole global batch
    assert torch.equal(wrapped(logits, labels), loss(logits, labels, num_items_in_batch=40))
    assert not torch.equal(wrapped(logits, labels), loss(logits, labels))  # a mean over these 8 would differ
    assert torch.equal(wrapped(logits, labels, num_items_in_batch=8), loss(logits, labels, num_items_in_batch=8))
    assert wrapped.causal_lm  # a chunked_loss plan still recognises it
