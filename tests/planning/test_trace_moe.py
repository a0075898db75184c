"""The MoE block trace saves for backward what a real block saves: torch's `grouped_mm` (what the run calls) keeps
the routed rows only for the experts' weight gradients, so LoRA with frozen experts keeps none, where transformers'
fallback op (what the fake-tensor trace must call in fp32) always kept them (hfsplit/planning/costs/moe.py)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoModelForCausalLM

from hfsplit.planning.costs import layout as costs_layout, trace as costs_trace
from hfsplit.plan import TrainingSpec
from tests.planning.test_costs import tiny_config


def real_saved_bytes(key: str, spec: TrainingSpec) -> int:
    """One real block of the trace's one-layer model, its LoRA (peft's) and kwargs built the trace's way: the
    unique storages autograd saves in a forward, parameters excluded (costs_trace.SavedBytes, as the trace counts)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(costs_layout.rank_layer_config(costs_layout.CONFIGS[key]), dtype=costs_layout.dtype_of(spec.dtype))
    block = costs_layout.parts(model)[1]
    if spec.method == "lora":
        costs_trace._add_lora(block, key, spec, use_peft=True)
    costs_trace.set_trainable(block, spec)
    kwargs, _ = costs_trace._block_kwargs(getattr(model, model.base_model_prefix), block, spec)
    kwargs["attention_mask"] = traced_mask(key, spec)  # the attention's share is the dense blocks' (test_costs.py)
    saved = costs_trace.SavedBytes(exclude=list(block.parameters()))
    x = torch.randn(spec.micro_batch_size, spec.seq_len, model.config.hidden_size, dtype=costs_layout.dtype_of(spec.dtype),
                    requires_grad=True)
    with saved.hooks():
        y = costs_trace._hidden(block(x, **kwargs))
    y.sum().backward()  # the step runs (the saved tensors were real ones)
    assert x.grad is not None
    return saved.bytes


def traced_mask(key: str, spec: TrainingSpec):
    """A real causal mask where the trace's model forward built one (under fake tensors it cannot see that sdpa
    would skip it; a real one-layer forward does), of the same shape and dtype: the same attention path."""
    mask = costs_trace._fake_model(key, spec, 1, FakeTensorMode())[2].get("attention_mask")
    if not isinstance(mask, torch.Tensor):
        return mask
    causal = torch.ones(mask.shape[-2:], dtype=torch.bool).tril().expand(mask.shape)
    return causal if mask.dtype == torch.bool else torch.zeros(mask.shape, dtype=mask.dtype).masked_fill(
        ~causal, torch.finfo(mask.dtype).min)


@pytest.mark.parametrize("method, dtype", [("lora", "float32"), ("full", "float32"), ("lora", "bfloat16")])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_block_trace_saves_what_a_real_block_saves(family, method, dtype):
    """fp32 traces through trace_moe; bf16 traces through torch's own meta `grouped_mm` (was right before)."""
    config = tiny_config(family)
    key = costs_layout.keyed(config)
    spec = TrainingSpec(method=method, seq_len=256, micro_batch_size=2, dtype=dtype, lora_r=8, lora_targets=None)
    traced = costs_trace.block_events(key, spec, 1).activations
    real = real_saved_bytes(key, spec)
    assert traced == real, f"traced / real saved bytes = {traced / real:.3f}"
