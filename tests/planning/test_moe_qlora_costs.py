"""QLoRA on an MoE: the block's nn.Linear layers 4-bit as transformers + bitsandbytes quantize them, and the fused 3-D
experts 4-bit too, each expert alone (hfsplit.apply.quantized_experts), or kept in the compute dtype as transformers does
(`quantize_experts=False`); the cost model counts them so, and its peak matches a real step. LoRA on the fused
experts (peft target parameters): counted, and refused where it cannot be what the user meant."""
from dataclasses import replace

import pytest

from hfsplit.checkpoint.quantized import quantized_experts_bytes, quantized_linear_bytes
from hfsplit.models.expert_lora import expert_parameters
from hfsplit.plan import TrainingSpec
from hfsplit.planning.costs.model import estimate_peak_bytes, model_costs
from tests.planning.test_costs import MOE, estimated_peak, measured_peak, tiny_config


EXPERT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_qlora_counts_4bit_experts_exactly_and_its_peak_matches_a_real_step(family):
    """The block's bytes: attention linears and every expert of each fused tensor in NF4 (exact packed bytes and
    quant state), the rest 32-bit; with quantize_experts=False the experts stay 32-bit. The estimated peak of a
    real step (linears and experts quantized as the loaders do) within 15%, LoRA on attention and on the experts."""
    config = tiny_config(family)
    spec = TrainingSpec(method="qlora", seq_len=64, dtype="float32", lora_r=8, lora_targets=None)
    costs, full = model_costs(config, spec), model_costs(config, TrainingSpec(method="full", seq_len=64, dtype="float32"))
    h, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    d = config.head_dim if family == "qwen3_moe" else h // heads
    attention = [(h, heads * d), (h, kv * d), (h, kv * d), (heads * d, h)]  # q, k, v, o: the block's only Linears
    experts = [shape for _, shape in expert_parameters(config).values()]
    weights = sum(i * o for i, o in attention)
    quantized = sum(quantized_linear_bytes(i, o, quant_type="nf4", double_quant=True) for i, o in attention)
    packed = sum(quantized_experts_bytes(*shape) for shape in experts)
    adapters = costs.block.grad_bytes  # fp32 adapters, their gradients the same size
    expert_numel = sum(e * a * b for e, a, b in experts)
    assert costs.block.param_bytes == full.block.param_bytes - 4 * (weights + expert_numel) + quantized + packed + adapters
    kept = model_costs(config, replace(spec, quantize_experts=False))
    assert kept.block.param_bytes == full.block.param_bytes - 4 * weights + quantized + adapters
    measured, estimated = measured_peak(config, "qlora", 64), estimated_peak(config, "qlora", 64)
    assert estimated == pytest.approx(measured, rel=0.15), f"estimated/measured = {estimated / measured:.3f}"
    measured = measured_peak(config, "qlora", 64, lora_targets=list(EXPERT_TARGETS))
    estimated = estimate_peak_bytes(model_costs(config, replace(spec, lora_targets=EXPERT_TARGETS)))
    assert estimated == pytest.approx(measured, rel=0.15), f"expert LoRA: estimated/measured = {estimated / measured:.3f}"


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_lora_on_fused_experts_is_counted_and_its_peak_matches_a_real_step(family):
    """`gate_up_proj` / `down_proj` in the LoRA targets adapt the fused experts (peft target parameters): r·E·(in+out)
    adapter elements each, and the peak of a real step with them within 15%."""
    from hfsplit.apply.lora import lora_config

    config = tiny_config(family)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]
    peft_config = lora_config(r=8, alpha=16, dropout=0.0, targets=targets, model_config=config)
    assert sorted(peft_config.target_parameters) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert peft_config.target_modules == {"q_proj", "k_proj", "v_proj", "o_proj"}
    spec = TrainingSpec(method="lora", seq_len=64, dtype="float32", lora_r=8, lora_targets=tuple(targets))
    with_experts, attention = model_costs(config, spec), model_costs(config, replace(spec, lora_targets=tuple(targets[:4])))
    experts, h = MOE[family].get("num_local_experts") or MOE[family]["num_experts"], config.hidden_size
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    assert with_experts.block.grad_bytes - attention.block.grad_bytes == 4 * 8 * experts * ((h + 2 * inter) + (inter + h))
    measured = measured_peak(config, "lora", 64, lora_targets=targets)
    estimated = estimate_peak_bytes(with_experts)
    assert estimated == pytest.approx(measured, rel=0.15), f"estimated/measured = {estimated / measured:.3f}"


def test_expert_lora_targets_refused_where_ambiguous_or_merged(tiny_checkpoint):
    """A name that is both a dense layer's linear and the experts' parameter (Qwen3-MoE with mlp_only_layers) is
    refused naming it; --merge with expert adapters is refused before any weight is read."""
    from hfsplit.errors import HfsplitError
    from hfsplit.apply.lora import lora_config
    from hfsplit.planning.planner import make_plan
    from hfsplit.training.options import plan_arguments, tiny_demo_options
    from hfsplit.training.run import lora_of_run

    mixed = tiny_config("qwen3_moe")
    mixed.num_hidden_layers, mixed.mlp_only_layers = 2, [0]
    with pytest.raises(HfsplitError, match=r"down_proj name both a dense layer's linear and the fused experts"):
        lora_config(r=8, alpha=16, dropout=0.0, targets=["q_proj", "down_proj"], model_config=mixed)
    path = str(tiny_checkpoint("mixtral"))
    options = tiny_demo_options(model=path, method="lora", lora_targets=["q_proj", "gate_up_proj"], merge=True)
    with pytest.raises(HfsplitError, match=r"LoRA on fused experts \(mlp.experts.gate_up_proj\) .* drop --merge"):
        lora_of_run(make_plan(path, "1GiB", **plan_arguments(options, world_size=1)), model_path=path, merge=True)


def test_calibration_probe_adapts_the_runs_expert_targets():
    """The time probe's block carries the run's adapters, fused experts included, and runs forward and backward."""
    import torch

    from hfsplit.load.probes import _probe_block

    spec = TrainingSpec(method="lora", seq_len=16, dtype="float32", lora_r=8,
                        lora_targets=("q_proj", "gate_up_proj", "down_proj"))
    run = _probe_block(tiny_config("mixtral"), spec, torch.device("cpu"))
    block = dict(zip(run.__code__.co_freevars, (c.cell_contents for c in run.__closure__)))["block"]
    adapted = sorted(n for n, p in block.named_parameters() if p.requires_grad)
    assert [n for n in adapted if "experts" in n] and [n for n in adapted if "q_proj" in n]
    run(False)
    assert all(p.grad is not None for p in block.parameters() if p.requires_grad)


def test_qwen3_30b_a3b_qlora_fits_one_24gib_card_and_mixtral_8x7b_two_with_4bit_experts():
    """Issue 22's targets on the meta device (bundled configs, QLoRA r=16, seq 2048, micro-batch 1): Qwen3-30B-A3B on one
    24 GiB card, Mixtral-8x7B on 2×24GiB, their experts 4-bit (the plan's step says so); with the experts kept 16-bit
    neither fits, and the no-fit fixes name the 4-bit experts."""
    from hfsplit.errors import PlanError
    from hfsplit.plan import rank_total
    from hfsplit.planning.planner import make_plan

    spec = TrainingSpec(method="qlora", seq_len=2048, micro_batch_size=1, lora_r=16)
    for model, budget, devices in (("Qwen/Qwen3-30B-A3B", "24GiB", 1), ("mistralai/Mixtral-8x7B-v0.1", "2x24GiB", 2)):
        plan = make_plan(model, budget, spec=spec)
        ranks = {s.pp_rank: [t.memory for t in plan.stages if t.pp_rank == s.pp_rank] for s in plan.stages}
        assert plan.tp == 1 and plan.pp * plan.dp == devices
        assert all(rank_total(memories) <= 24 << 30 for memories in ranks.values()), model
        assert "MoE experts nf4 too, expert by expert" in " ".join(map(str, plan.steps()))
        with pytest.raises(PlanError, match=r"the MoE experts in 4 bits too \(--quantize-experts on\)"):
            make_plan(model, budget, spec=replace(spec, quantize_experts=False))


def test_expert_lora_keeps_tp1_and_a_forced_tp2_is_refused_before_any_search():
    """LoRA on fused expert parameters trains at tp=1 only (peft adapts a 3-D parameter whole): left to itself the
    planner tries tp=1 alone for it (tp=2 still for attention-only LoRA); a forced tp=2 is one line naming
    --lora-targets, the expert parameter and the fix, before any search."""
    from hfsplit.errors import PlanError
    from hfsplit.planning.planner import make_plan
    from hfsplit.planning.search import tp_degrees_for

    config = tiny_config("qwen3_moe")
    experts = TrainingSpec(method="lora", seq_len=16, dtype="float32", lora_targets=("q_proj", "gate_up_proj"))
    assert tp_degrees_for(config, experts, 2) == [1]
    assert tp_degrees_for(config, replace(experts, lora_targets=("q_proj",)), 2) == [1, 2]
    with pytest.raises(PlanError) as refused:
        make_plan(config, "2x1GiB", spec=experts, tp=2)
    line = str(refused.value)
    assert line.startswith("--lora-targets gate_up_proj at tp=2: LoRA on the fused experts' parameters "
                           "mlp.experts.gate_up_proj trains at tp=1 only") and "\n" not in line, line
    assert "use --tp 1" in line and "leave gate_up_proj out of --lora-targets" in line, line
