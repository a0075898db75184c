"""Packed rows through a decoder that builds its masks without the position ids (`hfsplit.models.packed_masks`):
the stage hands it the masks built with them, and `seq_idx` for its recurrent mixers (Granite 4's case runs in
tests/models/test_packed_recurrence.py)."""
import pytest
import torch
from transformers import AutoConfig

from hfsplit.load.proof import run_split, split_stages, tiny_model
from hfsplit.models.layout import decoder_layout
from hfsplit.models.packed_masks import builds_masks_blind, example_index, lengths_of_index
from hfsplit.models.shrink import shrunk_config


@pytest.mark.parametrize("model_type, blind", [("afmoe", True), ("granitemoehybrid", True), ("llama", False),
                                               ("qwen3_next", False)])
def test_the_decoders_blind_to_position_ids_are_read_from_their_forward(model_type, blind):
    whole = tiny_model(shrunk_config(AutoConfig.for_model(model_type)))
    assert builds_masks_blind(whole.get_submodule(decoder_layout(whole).base)) is blind


def test_a_packed_row_of_sliding_and_full_attention_equals_each_example_alone():
    """AFMoE's sliding and full attention layers (masks without the position ids), a packed row longer than its
    sliding window: each example's logits as alone in transformers' own model; the same row unpacked mixes them."""
    config = shrunk_config(AutoConfig.for_model("afmoe"))
    assert {"sliding_attention", "full_attention"} <= set(config.layer_types)
    whole = tiny_model(config)
    stages = split_stages(whole, pp=2)
    lengths = (7, 4, 4, 9)
    gen = torch.Generator().manual_seed(5)
    examples = [torch.randint(3, config.vocab_size, (n,), generator=gen) for n in lengths]
    with torch.no_grad():
        packed = run_split(stages, torch.cat(examples)[None], torch.cat([torch.arange(n) for n in lengths])[None])[0]
        alone = torch.cat([whole(input_ids=e[None], use_cache=False).logits[0] for e in examples])
        unpacked = run_split(stages, torch.cat(examples)[None])[0]
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    assert (unpacked[lengths[0]:] - alone[lengths[0]:]).abs().max() > 1e-3


def test_the_example_index_restarts_where_the_positions_do():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5], [3, 4, 0, 1, 2, 3]])
    index = example_index(positions)
    assert index.dtype == torch.int32
    assert index.tolist() == [[0, 0, 0, 1, 1, 2], [0] * 6, [0, 0, 1, 1, 1, 1]]
    assert lengths_of_index(index) == [[3, 2, 1], [6], [2, 4]]
