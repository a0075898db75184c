"""Long sequences on the meta device (issue 30): the tiled MLP as a per-stage decision, costed and round-tripped; the
plan-wide knobs the planner turns (chunked loss, micro-batches); the longest sequence by binary search."""
from dataclasses import replace

import pytest

from hfsplit.plan import Plan, TrainingSpec, rank_total
from hfsplit.planning.costs.model import model_costs
from hfsplit.planning.max_seq import longest_fitting, max_seq_len
from hfsplit.planning.memory_choices import Choice, ladder, mlp_tiles
from hfsplit.planning.planner import make_plan
from hfsplit.errors import PlanError

GiB, MiB = 1 << 30, 1 << 20
LLAMA_70B = "meta-llama/Llama-3.1-70B"


def _tiny_config(**overrides):
    from transformers import LlamaConfig

    values = dict(hidden_size=64, intermediate_size=512, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=256, max_position_embeddings=1 << 16)
    return LlamaConfig(**{**values, **overrides})


@pytest.mark.parametrize("limit", [0, 1, 255, 256, 257, 1000, 4096, 65535])
@pytest.mark.parametrize("multiple", [1, 256])
def test_longest_fitting_is_the_scan_s_answer(limit, multiple):
    calls = []

    def fits(n):
        calls.append(n)
        return n <= limit

    found = longest_fitting(fits, low=multiple, high=1 << 16, multiple=multiple)
    scan = max((n for n in range(multiple, (1 << 16) + 1, multiple) if n <= limit), default=None)
    assert found == scan
    assert len(calls) <= 18 and all(n % multiple == 0 for n in calls)


def test_tiles_hold_one_hidden_state_of_intermediates_and_experts_are_not_tiled():
    from transformers import MixtralConfig

    spec = TrainingSpec(seq_len=16384)
    assert mlp_tiles(_tiny_config(), spec) == 16  # slices of 1024 tokens (MIN_SLICE)
    assert mlp_tiles(_tiny_config(), replace(spec, seq_len=1 << 17)) == 4 * 512 // 64  # one hidden state's worth
    assert mlp_tiles(_tiny_config(), replace(spec, seq_len=100)) == 2
    assert mlp_tiles(MixtralConfig(num_local_experts=4, hidden_size=64, intermediate_size=128), spec) == 0


def test_the_ladder_tries_tiles_after_every_untiled_choice_and_the_flags_stay_overrides():
    spec = TrainingSpec(method="lora")
    auto = ladder(spec, tiles=8)
    assert [c.tiled_mlp for c in auto] == [0] * 6 + [8] * 4  # checkpointed ones only: tiles serve a recompute
    assert auto[6] == Choice("on", "adamw_torch", 8) and auto[-1] == Choice("offload", "adamw_8bit", 8)
    assert all(c.tiled_mlp == 8 for c in ladder(spec, tiles=8, tiled_mlp="on"))
    assert all(c.tiled_mlp == 0 for c in ladder(spec, tiles=8, tiled_mlp=False))
    assert all(c.tiled_mlp == 0 for c in ladder(spec, tiles=0))  # an MoE: nothing to tile under auto
    with pytest.raises(PlanError, match="dense MLP"):
        ladder(spec, tiles=0, tiled_mlp="on")


def test_a_tiled_mlp_costs_less_memory_and_one_more_mlp_forward():
    """Llama-3.1-70B at seq 16384, QLoRA with checkpointing: tiling in 14 slices takes the MLP's intermediates out of a
    block's recompute (gate, up, their activation and product: 4 × 896 MiB whole) and the norms' fp32 upcasts (512 MiB
    each, kept) and their backward's fp32 temporaries (2.5 GiB at the peak), for one more MLP forward (measured: 5.4
    GiB less)."""
    spec = TrainingSpec(method="qlora", lora_r=16, seq_len=16384, activation_checkpointing=True, reserve_bytes=0)
    from hfsplit.checkpoint.resolve import load_config

    config = load_config(LLAMA_70B)
    whole = model_costs(config, spec)
    tiled = model_costs(config, replace(spec, tiled_mlp=14))
    assert whole.block.activation_bytes == tiled.block.activation_bytes == 16384 * 8192 * 2  # the block's input
    saved = whole.block.workspace_bytes - tiled.block.workspace_bytes
    assert 3 * 896 * MiB + 2 * 512 * MiB <= saved <= 4 * 896 * MiB + 2 * 512 * MiB + 2560 * MiB, saved / MiB
    mlp_forward = 2.0 * 16384 * 3 * 8192 * 28672
    assert tiled.block.flops - whole.block.flops >= mlp_forward


def test_a_plan_with_tiles_says_so_per_stage_and_round_trips_through_json():
    plan = make_plan(_tiny_config(), "2x8GiB", spec=TrainingSpec(method="lora", seq_len=4096, dtype="float32"),
                     activation_checkpointing=True, tiled_mlp="on", pp=2, gpus=False)
    assert [plan.tiled_mlp_of(s) for s in plan.stages] == [4, 4] and plan.spec.tiled_mlp == 4  # slices of 1024
    assert [s.kind for s in plan.steps()][:3] == ["checkpointing", "tiled_mlp", "load"]
    assert "MLP tiled over the sequence (4 slices on every stage)" in plan.table()
    assert "4 tiles" in plan.table()
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.stages[1].tiled_mlp == 4


def test_auto_tiles_only_the_ranks_that_fit_no_other_way():
    """Two equal budgets, the second rank also holding the head: the budget is set between what the split needs with
    every rank untiled and offloaded, and what it needs tiled; auto tiles and the plan fits, off does not."""
    config = _tiny_config(num_hidden_layers=8)
    spec = TrainingSpec(method="lora", seq_len=8192, dtype="float32")
    tight = make_plan(config, "2x64GiB", spec=spec, tiled_mlp="on", activation_checkpointing="offload",
                      optim="adamw_8bit", pp=2, gpus=False)
    budget = int(max(rank_total([s.memory]) for s in tight.stages) * 1.02)
    plan = make_plan(config, {"0": budget, "1": budget}, spec=spec, pp=2, gpus=False)
    assert any(plan.tiled_mlp_of(s) for s in plan.stages)
    assert all(rank_total([s.memory]) <= budget for s in plan.stages)
    with pytest.raises(PlanError):
        make_plan(config, {"0": budget, "1": budget}, spec=spec, pp=2, gpus=False, tiled_mlp="off")


def test_the_planner_turns_the_chunked_loss_and_the_micro_batches_itself():
    """Issue 30's example: Llama-3.1-70B QLoRA r=16 at seq 4096, micro-batch 1, on 2 × 24 GiB fitted only with
    `--chunked-loss on --micro-batches 2`; now the planner chooses them. Fixed off, the chunked loss stays off."""
    spec = TrainingSpec(method="qlora", lora_r=16, seq_len=4096)
    plan = make_plan(LLAMA_70B, "2x24GiB", spec=spec)
    assert plan.spec.chunked_loss
    assert all(s.memory.total <= s.budget for s in plan.stages)
    with pytest.raises(PlanError) as err:
        make_plan(LLAMA_70B, "2x24GiB", spec=spec, chunked_loss=False, micro_batches=8, tiled_mlp="off")
    assert "chunked loss" in str(err.value)  # among the changes that fit


def test_max_seq_len_is_the_longest_multiple_that_fits():
    config = _tiny_config()
    spec = TrainingSpec(method="lora", dtype="float32")
    fixed = dict(pp=2, gpus=False, activation_checkpointing=True, optim="adamw_torch", tiled_mlp="off",
                 chunked_loss=True)
    plan = max_seq_len(make_plan, config, "2x24MiB", spec=spec, limit=8192, multiple=256, **fixed)
    assert plan is not None and plan.spec.seq_len % 256 == 0 and 256 < plan.spec.seq_len < 8192
    with pytest.raises(PlanError):
        make_plan(config, "2x24MiB", spec=replace(spec, seq_len=plan.spec.seq_len + 256), **fixed)


@pytest.mark.parametrize("weight", [16, 64])
def test_max_seq_len_finds_a_fit_past_a_slice_step_where_the_length_before_did_not_fit(weight):
    """A tiled MLP's slice shrinks where the sequence takes one more slice, so "fits" is a saw in the length: a plan
    whose bytes are the sequence plus `weight` slices (the planner's own slice count) fits past a step where the
    length before did not. The search answers what a scan of every length does; a plain binary search does not."""
    from types import SimpleNamespace

    config, spec, high = _tiny_config(), TrainingSpec(method="lora", dtype="float32"), 40000

    def bytes_at(seq):
        return seq + weight * seq / mlp_tiles(config, replace(spec, seq_len=seq))

    missed = 0
    for budget in range(1000, 80000, 211):
        def plan(model, max_memory, *, spec, **options):
            if bytes_at(spec.seq_len) > budget:
                raise PlanError(f"{spec.seq_len} does not fit")
            return SimpleNamespace(spec=spec)

        scan = max((n for n in range(256, high + 1, 256) if bytes_at(n) <= budget), default=None)
        found = max_seq_len(plan, config, "1GiB", spec=spec, limit=high, multiple=256)
        assert (found and found.spec.seq_len) == scan, budget
        missed += longest_fitting(lambda n: bytes_at(n) <= budget, low=256, high=high, multiple=256) != scan
    assert missed  # the saw is real: a binary search alone stops at the end of a tooth


@pytest.mark.parametrize("packing", [False, True], ids=["rows", "packed"])
def test_attention_memory_is_linear_in_the_sequence_and_no_seq2_mask_is_built(packing):
    """Llama-3.1-8B under sdpa (the CPU flash kernel on fake tensors, the GPU's flash / memory-efficient kernels when
    run): a block's kept activations and workspace double when the sequence doubles from 32768 to 65536 (a seq²
    score matrix would quadruple them: 65536² × 32 heads × 2 B = 256 GiB), and the masks a stage builds hold no seq²
    tensor (unpacked rows: sdpa's causal flag; packed rows: each example's indices, `hfsplit.models.varlen`)."""
    import torch

    from hfsplit.checkpoint.resolve import load_config
    from hfsplit.planning.costs.masks import stage_mask_bytes

    config = load_config("meta-llama/Llama-3.1-8B")
    config._attn_implementation = "sdpa"
    costs = {seq: model_costs(config, TrainingSpec(method="lora", seq_len=seq, packing=packing,
                                                                      reserve_bytes=0)) for seq in (32768, 65536)}
    for field in ("activation_bytes", "workspace_bytes"):
        ratio = getattr(costs[65536].block, field) / getattr(costs[32768].block, field)
        assert 1.9 <= ratio <= 2.1, (field, ratio)
    for seq in (32768, 131072):
        masks = stage_mask_bytes(config, batch=1, seq=seq, packed=packing, dtype=torch.bfloat16)
        assert masks <= 64 * seq, (seq, masks)  # int64 indices at most: linear in the sequence
