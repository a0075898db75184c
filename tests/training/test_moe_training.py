"""MoE training beyond one pipeline: data-parallel replicas, and resuming under another split."""
import pytest

from hfsplit.training.options import FinetuneOptions
from tests.parallel.launcher import launch
from tests.training.test_trainer import reference_training, run_options

ROUTED = dict(output_router_logits=True, router_aux_loss_coef=0.5)


@pytest.mark.slow
def test_moe_data_parallel_equals_transformers_and_resumes_under_another_split(tiny_checkpoint, tmp_path):
    """pp=2 × dp=2 on four ranks, Qwen3-MoE full and Mixtral LoRA with the router auxiliary loss: every step equals
    transformers over the global batch, each micro-batch its own forward whose loss adds coef × its aux loss (the
    replicas' losses and gradients averaged as one process accumulating the global batch's micro-batches). The full
    run's checkpoint (pp=2, dp=2) then resumes on one rank (pp=1, the same global batch as 8 micro-batches) and
    continues the curve: the experts' weights and AdamW moments are resharded from the stage files."""
    full = dict(run_options(tiny_checkpoint("qwen3_moe", **ROUTED), tmp_path, "full", tp=1, pp=2, max_memory="4x1GiB"),
                max_steps=8, save_every=4, output_dir=str(tmp_path / "full"))
    lora = dict(run_options(tiny_checkpoint("mixtral", **ROUTED), tmp_path, "lora", tp=1, pp=2, max_memory="4x1GiB"),
                max_steps=6, output_dir=str(tmp_path / "lora"))
    results = launch("tests.training.cases:finetune_losses", world_size=4, kwargs={"runs": [full, lora]}, timeout_s=400)
    assert all(r == results[0] for r in results)  # every rank reports the global loss
    for run, split_losses in zip((full, lora), results[0]):
        expected, _ = reference_training(FinetuneOptions(**run), replicas=2)
        assert split_losses == pytest.approx(expected, rel=1e-5), run["model"]
    moved = dict(full, pp=1, micro_batches=8, max_memory="1GiB", resume=str(tmp_path / "full" / "checkpoint-4"),
                 output_dir=str(tmp_path / "moved"))
    (resumed,) = launch("tests.training.cases:finetune_losses", world_size=1, kwargs={"runs": [moved]}, timeout_s=300)[0]
    assert resumed == pytest.approx(results[0][0][4:], rel=1e-5)
