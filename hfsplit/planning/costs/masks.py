"""The attention mask a traced block gets: the one a stage's block gets when it runs.

The cost model traces a block on fake tensors, and transformers never skips a causal mask built from a fake
tensor (`masking_utils._ignore_causal_mask_sdpa` reads one as tracing), while a real stage under sdpa gets None
where there is no padding (`parallel.stage.causal_masks`, as the model's own forward): sdpa's causal flag then
replaces the mask, and the block makes none of the mask's float copies. So the mask is decided as the stage
decides it, on a meta hidden state of the traced shape, and the trace drops the captured fake mask where the run
has none.
"""
from __future__ import annotations

import torch

from hfsplit.models.masks import causal_masks, layer_attention_type


def mask_as_run(config, kwargs: dict, *, batch: int, seq: int) -> dict:
    """`kwargs` (captured for `config`'s layer 0 on fake tensors) with the attention mask a stage passes."""
    if kwargs.get("attention_mask") is None:
        return kwargs

    hidden = torch.empty(batch, seq, config.hidden_size, device="meta")  # a mask that is built costs nothing
    positions = torch.arange(seq).unsqueeze(0)  # real: transformers reads them (packed-sequence detection)
    masks = causal_masks(config, hidden=hidden, position_ids=positions)
    return {**kwargs, "attention_mask": None} if masks[layer_attention_type(config, 0)] is None else kwargs
