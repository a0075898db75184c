"""Models whose layers are of several kinds (Qwen3-MoE's dense `mlp_only_layers`): each layer costed by its own kind,
and the planner summing the kinds a stage really holds."""
from dataclasses import replace

import pytest
from transformers import AutoConfig

from hfsplit.plan import TrainingSpec
from hfsplit.planning.costs.model import estimate_peak_bytes, model_costs, weight_bytes
from hfsplit.models.layer_kinds import DENSE, SPARSE, layer_kinds
from hfsplit.models.layout import decoder_layout, meta_model
from hfsplit.planning.search import stage_slots
from hfsplit.planning.planner import make_plan
from hfsplit.planning.stage_costs import stage_memory
from tests.planning.test_costs import measured_peak


def qwen3_moe(layers: int = 4, **overrides):
    """Tiny Qwen3-MoE whose expert block holds 8× a dense block's MLP weights, so the kinds' costs differ."""
    kwargs = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=512, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                  decoder_sparse_step=1, num_hidden_layers=layers, max_position_embeddings=512, pad_token_id=0)
    kwargs.update(overrides)
    return AutoConfig.for_model("qwen3_moe", **kwargs)


@pytest.mark.parametrize("overrides", [dict(mlp_only_layers=[0, 1]), dict(decoder_sparse_step=2),
                                       dict(mlp_only_layers=[3], decoder_sparse_step=2), dict(), dict(num_experts=0)])
def test_layer_kinds_are_those_transformers_builds(overrides):
    config = qwen3_moe(**overrides)
    model = meta_model(config)
    built = tuple(SPARSE if any(p.dim() == 3 for p in block.parameters()) else DENSE
                  for block in model.get_submodule(decoder_layout(model).layers))
    kinds = layer_kinds(config)
    assert (kinds or (built[0],) * 4) == built
    assert (kinds is None) == (len(set(built)) == 1)


@pytest.mark.parametrize("method", ["inference", "lora", "full"])
def test_mixed_layers_estimated_peak_matches_a_real_step(method):
    """Two dense layers then two expert layers: the real step against the estimate that costs each layer by its
    kind; costing all four as layer 0 (dense), as before, misses the experts by far more than the band."""
    config = qwen3_moe(mlp_only_layers=[0, 1])
    spec = TrainingSpec(method=method, seq_len=64, dtype="float32", lora_r=8)  # measured_peak's rank
    costs = model_costs(config, spec)
    assert [b.param_bytes > costs.block.param_bytes for b in costs.layer_blocks] == [False, False, True, True]
    measured, estimated = measured_peak(config, method, 64), estimate_peak_bytes(costs)
    assert estimated == pytest.approx(measured, rel=0.15), f"estimated/measured = {estimated / measured:.3f}"
    as_layer_0 = estimate_peak_bytes(replace(costs, layer_blocks=()))
    assert as_layer_0 < 0.8 * measured, f"layer-0 costing/measured = {as_layer_0 / measured:.3f}"
    if method == "full":  # the planner's lower bound on weights sums the kinds too
        held = sum(b.param_bytes for b in costs.layer_blocks) + costs.embed.param_bytes + costs.head.param_bytes
        assert weight_bytes(config, spec) == held


def test_a_stage_of_dense_layers_takes_more_layers_than_one_of_expert_layers():
    """Eight layers, the first four dense, on two equal budgets where four expert layers do not fit a stage: stage 0
    (dense) takes more layers than stage 1 (experts), and each stage's figure is the sum of the kinds it holds."""
    config = qwen3_moe(layers=8, mlp_only_layers=[0, 1, 2, 3])
    spec = TrainingSpec(method="full", seq_len=64, dtype="float32", reserve_bytes=0)
    costs = model_costs(config, spec)
    dense, sparse = costs.layer_blocks[0], costs.layer_blocks[-1]
    assert sparse.state_bytes > 4 * dense.state_bytes
    slots = stage_slots([("0",), ("1",)], {"0": 1 << 40, "1": 1 << 40}, {}, p=2, d=1, v=1, m=2, schedule="1F1B")
    budget = max(stage_memory(costs, slots[0], range(0, 5)).total, stage_memory(costs, slots[1], range(5, 8)).total)
    assert stage_memory(costs, slots[1], range(4, 8)).total > budget  # the even split does not fit
    plan = make_plan(config, f"2x{budget}B", spec=spec, pp=2, tp=1, dp=1, micro_batches=2, schedule="1F1B",
                     activation_checkpointing=False)
    assert [s.layers for s in plan.stages] == [(0, 5), (5, 8)]
    for s in plan.stages:
        blocks = costs.layer_blocks[s.layers[0]:s.layers[1]]
        ends = [e for e, held in ((costs.embed, s.has_embed), (costs.head, s.has_head)) if held]
        assert s.memory.weights + s.memory.gradients + s.memory.optimizer == sum(
            p.state_bytes for p in (*blocks, *ends)), s.index
    # costed as layer 0 (dense) throughout, as before, stage 1 would look like it held a third of its weights
    assert stage_memory(replace(costs, layer_blocks=()), slots[1], 3).weights < 0.5 * plan.stages[1].memory.weights


def test_lora_default_targets_on_mixed_layers_are_the_attention_every_kind_has():
    """A dense layer's MLP names would make peft adapt the expert layers' fused experts too (its MoE target
    conversion) and name no module of an expert-only stage: the default is what every kind holds, and the cost
    model counts those adapters in every layer."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from hfsplit.models.layout import block_linear_names
    from hfsplit.apply.lora import lora_config

    config = qwen3_moe(mlp_only_layers=[0, 1])
    assert block_linear_names(config) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert "down_proj" in block_linear_names(qwen3_moe(mlp_only_layers=[0, 1, 2, 3]))
    model = get_peft_model(AutoModelForCausalLM.from_config(config),
                           lora_config(r=8, alpha=16, dropout=0.0, targets=None, model_config=config))
    adapted = {n.split(".lora_")[0].split("layers.")[1] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted == {f"{i}.self_attn.{p}" for i in range(4) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    costs = model_costs(config, TrainingSpec(method="lora", seq_len=64, dtype="float32", lora_r=8))
    assert {b.grad_bytes for b in costs.layer_blocks} == {costs.block.grad_bytes}  # the same adapters per layer
    attention = 8 * (64 + 64) + 8 * (64 + 32) * 2 + 8 * (64 + 64)  # r × (in + out): q, k, v, o
    assert costs.block.grad_bytes == 4 * attention


def test_a_one_layer_config_of_a_sliding_kind_keeps_its_kind_without_transformers_warning():
    """Gemma 4's config post-init forces the last layer to full attention and warns; the planner's one-layer config of
    its sliding kind must stay sliding, and `hfsplit plan` must not print that warning once per kind."""
    import logging

    from transformers import Gemma4TextConfig

    from hfsplit.models.layout import one_layer_config

    config = Gemma4TextConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    config.layer_types = ["sliding_attention", "sliding_attention"]  # as a per-kind config holds it
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        one = one_layer_config(config)
    finally:
        logger.removeHandler(handler)
    assert one.layer_types == ["sliding_attention"] and one.num_hidden_layers == 1
    assert not [m for m in warned if "Forcing last layer" in m], warned
