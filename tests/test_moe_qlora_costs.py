"""QLoRA on an MoE as transformers + bitsandbytes run it: the block's nn.Linear layers 4-bit, the fused 3-D experts and
the router in the compute dtype; the cost model counts them so, and its peak matches a real step."""
import pytest

from hfsplit.costs import TrainingSpec, model_costs
from hfsplit.quantize import quantized_linear_bytes
from tests.test_costs import estimated_peak, measured_peak, tiny_config


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_qlora_counts_experts_16_bit_and_its_peak_matches_a_real_step(family):
    config = tiny_config(family)
    spec = TrainingSpec(method="qlora", seq_len=64, dtype="float32", lora_r=8, lora_targets=None)
    costs, full = model_costs(config, spec), model_costs(config, TrainingSpec(method="full", seq_len=64, dtype="float32"))
    h, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    d = config.head_dim if family == "qwen3_moe" else h // heads
    attention = [(h, heads * d), (h, kv * d), (h, kv * d), (heads * d, h)]  # q, k, v, o: the block's only Linears
    weights = sum(i * o for i, o in attention)
    quantized = sum(quantized_linear_bytes(i, o, quant_type="nf4", double_quant=True) for i, o in attention)
    adapters = costs.block.grad_bytes  # fp32 adapters, their gradients the same size
    assert costs.block.param_bytes == full.block.param_bytes - 4 * weights + quantized + adapters
    measured, estimated = measured_peak(config, "qlora", 64), estimated_peak(config, "qlora", 64)
    assert estimated == pytest.approx(measured, rel=0.15), f"estimated/measured = {estimated / measured:.3f}"
