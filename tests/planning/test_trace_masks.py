"""The traced block gets the attention mask a stage passes (hfsplit.planning.costs.masks): none under sdpa without padding,
as transformers' own forward, though the fake-tensor capture always builds one."""
import pytest
import torch
from transformers import LlamaConfig, MistralConfig

from hfsplit.models.masks import causal_masks, layer_attention_type
from hfsplit.planning.costs.masks import mask_as_run

CAPTURED = object()  # stands for the fake mask the capture built


def _config(cls=LlamaConfig, attention="sdpa", **extra):
    config = cls(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=64, **extra)
    config._attn_implementation = attention
    return config


@pytest.mark.parametrize("config, kept", [
    (_config(), False),  # sdpa runs causal by its flag
    (_config(attention="eager"), True),  # eager needs the tensor (transformers' eager_mask never skips)
    (_config(MistralConfig, sliding_window=16), True),  # a window shorter than the sequence must be masked
    (_config(MistralConfig, sliding_window=4096), False),  # a window the sequence never reaches
])
def test_the_trace_keeps_a_mask_only_where_a_stage_passes_one(config, kept):
    kwargs = mask_as_run(config, {"attention_mask": CAPTURED, "position_ids": None}, batch=2, seq=64)
    assert (kwargs["attention_mask"] is CAPTURED) == kept
    assert "position_ids" in kwargs
    # ... as the stage builds it on real tensors
    hidden, positions = torch.zeros(2, 64, 64), torch.arange(64).unsqueeze(0)
    real = causal_masks(config, hidden=hidden, position_ids=positions)[layer_attention_type(config, 0)]
    assert (real is not None) == kept
