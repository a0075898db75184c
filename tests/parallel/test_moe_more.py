"""MoE beyond the plain split: layers of two kinds on a pipeline (plan vs measured per stage), data parallelism,
resuming under another split."""
import pytest

# Qwen3-MoE with two dense layers (mlp_only_layers) ahead of two expert layers whose experts hold 8x a dense MLP;
# full fine-tuning, so the weights' state (4x) is what separates the kinds.
MIXED = dict(num_layers=4, hidden=64, intermediate=64, num_experts=8, moe_intermediate_size=128, mlp_only_layers=[0, 1])


@pytest.mark.slow
def test_mixed_dense_and_expert_layers_run_as_planned_per_stage(launch, tiny_checkpoint):
    """pp=2, each rank's measured peak of a steady-state step against the plan's figure for its stage (both
    checkpointing settings, apply_cases' measure). Costed as layer 0 throughout (before), the expert stage read 3.5x."""
    checkpoint = str(tiny_checkpoint("qwen3_moe", **MIXED))
    results = launch("tests.parallel.apply_cases:step_memory_and_losses", world_size=2, timeout_s=400,
                     kwargs=dict(checkpoint=checkpoint, method="full", tp=1, pp=2, seq_len=64, micro_batch_size=2,
                                 micro_batches=2, steps=3))
    for rank, by_ac in enumerate(results):
        for ac, r in by_ac.items():
            ratio = r["measured"] / r["planned"]
            assert 0.85 <= ratio <= 1.15, f"rank {rank} checkpointing {ac}: measured/planned = {ratio:.3f}"
