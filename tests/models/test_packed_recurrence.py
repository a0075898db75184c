"""Packed rows through recurrent mixers (Gated DeltaNet, Mamba2), example by example
(`hfsplit.models.packed_recurrence`): a packed row's examples give the logits and gradients each gives alone in
transformers' own model, activation checkpointing's recompute included; without packed rows nothing changes."""
import functools

import pytest
import torch
from transformers import AutoConfig

from hfsplit.load.proof import run_split, split_gradients, split_stages, tiny_model
from hfsplit.models.packed_recurrence import recurrent_mixer
from hfsplit.models.shrink import shrunk_config

LENGTHS = (7, 4, 4, 9)  # a row of four examples, two of one length (run as one batch)


def checkpointed(stages):
    """Each real block recomputed in backward, as transformers' gradient checkpointing runs it."""
    for stage in stages:
        for block in stage.model_blocks():
            if hasattr(block, "gradient_checkpointing"):
                block.gradient_checkpointing = True
                block._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint,
                                                                       use_reentrant=False)
    return stages


# Granite 4 builds its masks without the position ids and hands its blocks none: the stage gives it the masks and
# `seq_idx` (`hfsplit.models.packed_masks`), here through Mamba2 mixers and attention layers on both stages
GRANITE_4 = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2)


@pytest.mark.parametrize("model_type, overrides", [("qwen3_5_text", {}), ("falcon_h1", {}),
                                                   ("granitemoehybrid", GRANITE_4)])
def test_a_packed_row_through_recurrent_mixers_equals_each_example_alone(model_type, overrides):
    whole = tiny_model(shrunk_config(AutoConfig.for_model(model_type, **overrides)))
    stages = checkpointed(split_stages(whole, pp=2))
    for stage in stages:
        stage.train()
    whole.train()
    assert all(any(recurrent_mixer(block) is not None for block in stage.model_blocks()) for stage in stages)
    vocab = whole.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(5)
    examples = [torch.randint(3, vocab, (n,), generator=gen) for n in LENGTHS]
    weights = [torch.randn(n, vocab, generator=gen) for n in LENGTHS]
    packed = run_split(stages, torch.cat(examples)[None], torch.cat([torch.arange(n) for n in LENGTHS])[None])[0]
    alone = [whole(input_ids=e[None], use_cache=False).logits[0] for e in examples]
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=0)
    (packed * torch.cat(weights)).sum().backward()
    sum((a * w).sum() for a, w in zip(alone, weights)).backward()
    got = split_gradients(whole, stages)
    # relative to each tensor's largest gradient, as the tp=2 sweep compares: one packed row's backward against four
    # examples' summed sums in another order (about 3e-7 here; a Llama's split alone reads 2e-7)
    worst = max((got[name] - p.grad).abs().max().item() / p.grad.abs().max().item()
                for name, p in whole.named_parameters() if p.grad is not None and p.grad.abs().max() > 0)
    assert set(got) == {name for name, p in whole.named_parameters() if p.grad is not None} and worst <= 1e-5
    # the same row unpacked (one example's positions) is one sequence: its later tokens see the earlier ones
    whole_row = run_split(stages, torch.cat(examples)[None])[0]
    assert (whole_row[LENGTHS[0]:] - packed[LENGTHS[0]:]).abs().max() > 1e-3


@pytest.mark.parametrize("model_type, recurrent", [("qwen3_next", [True, True]), ("granitemoehybrid", [True, True]),
                                                   ("llama", [False, False])])
def test_a_stage_with_a_recurrent_mixer_is_told_from_an_attention_only_one(model_type, recurrent):
    """Generation runs the prompts of a model with recurrent layers in one pass (`SplitModel._prefill_chunks`):
    whether a stage holds one is read from its modules, as packing finds its mixers."""
    from hfsplit.models.packed_recurrence import has_recurrent_mixer

    overrides = GRANITE_4 if model_type == "granitemoehybrid" else {}
    stages = split_stages(tiny_model(shrunk_config(AutoConfig.for_model(model_type, **overrides))), pp=2)
    assert [has_recurrent_mixer(stage) for stage in stages] == recurrent
