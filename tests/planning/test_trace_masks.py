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


@pytest.mark.parametrize("config, unpacked", [(_config(), 0), (_config(attention="eager"), 2 * 64 * 64 * 4)])
def test_packed_rows_cost_a_mask_per_micro_batch_and_the_probe_times_it(config, unpacked):
    """Packed rows under eager get transformers' block-diagonal float mask (eager builds one either way): the cost
    model counts it. Under sdpa they run example by example (models/varlen.py): no L x L mask, only the examples'
    int64 indices (`PackedRows`: one per position for the groups, one for the order), and with the block-mask path
    turned off a bool seq² per row. The calibration probe runs the block as the stage does, and a packed probe is
    cached apart."""
    from transformers import AutoModelForCausalLM

    from hfsplit.load.probes import _probe_inputs, speed_key
    from hfsplit.models.layout import decoder_layout
    from hfsplit.models import varlen
    from hfsplit.plan import TrainingSpec
    from hfsplit.planning.costs.masks import stage_mask_bytes

    packed = stage_mask_bytes(config, batch=2, seq=64, packed=True, dtype=torch.float32)
    assert stage_mask_bytes(config, batch=2, seq=64, packed=False, dtype=torch.float32) == unpacked
    assert packed == (2 * 64 * 64 * 4 if unpacked else 2 * 2 * 64 * 8)
    model, cpu = AutoModelForCausalLM.from_config(config), torch.device("cpu")
    layout = decoder_layout(model)
    base, block = model.get_submodule(layout.base), model.get_submodule(layout.layers)[0]

    def probe_inputs(packed: bool) -> dict:  # what the probe hands block 0, as the stage does
        return _probe_inputs(model.config, base, block, TrainingSpec(packing=packed, micro_batch_size=2, seq_len=64),
                             cpu)

    inputs = probe_inputs(True)
    positions, mask = inputs["position_ids"], inputs.get("attention_mask")
    assert positions[0, 32] == 0
    if unpacked:  # token 40 (second example) attends to 35 (its own) but not to 10 (the first example)
        assert mask is not None and mask[0, 0, 40, 10] != mask[0, 0, 40, 35]
    else:  # two examples of 32 in each of the two rows
        assert isinstance(mask, varlen.PackedRows) and [(n, i.numel()) for n, i in mask.groups] == [(32, 128)]
        with varlen.block_masks():
            assert stage_mask_bytes(config, batch=2, seq=64, packed=True, dtype=torch.float32) == 2 * 64 * 64
    assert (probe_inputs(False).get("attention_mask") is None) == (unpacked == 0)
    assert speed_key(config, TrainingSpec(packing=True), cpu) != speed_key(config, TrainingSpec(), cpu)
