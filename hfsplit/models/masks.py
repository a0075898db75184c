"""The attention masks a decoder block gets, by attention type, as the model's own forward builds them.

Read by a stage when it runs (`hfsplit.parallel.stage`) and by the cost model when it traces a block
(`hfsplit.planning.costs.masks`), so both decide the same mask.
"""
from __future__ import annotations

from typing import Optional

import torch

from hfsplit.models.varlen import IMPLEMENTATION, enabled, is_packed, packed_rows_of


def layer_attention_type(config, index: int) -> str:
    """"full_attention" or "sliding_attention" for layer `index`, as the model's own forward picks it."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def causal_masks(config, *, hidden: torch.Tensor, position_ids: torch.Tensor, cache=None,
                 layers: tuple[int, ...] | list[int] = (),
                 attention_mask: Optional[torch.Tensor] = None) -> dict[str, Optional[torch.Tensor]]:
    """Attention masks by attention type, as the model's own forward builds them; with `cache`, over the cached
    positions too (sized from the first of this stage's `layers` of each type: a stage's cache holds only its own).

    Under sdpa a causal mask without padding is None, as in transformers: sdpa's causal flag replaces it, and a
    materialised mask costs a float copy per block that backward keeps (measured: ~0.29 GiB on SmolLM2 at seq
    512 × 4). Eager attention always gets a tensor (transformers' `eager_mask` never skips), so None never means
    non-causal there. Packed rows (position ids restarting inside a row, no cache) get transformers' block-diagonal
    causal mask, sliding windows inside each example: materialised under eager, a BlockMask under flex; under sdpa
    instead a `PackedRows` (`hfsplit.models.varlen`), which runs each example on its own, with no L × L mask.
    `attention_mask` `(batch, cached + new)`: transformers' 2-D padding mask (generation's left-padded prompts).
    """
    if cache is None and config._attn_implementation == IMPLEMENTATION and enabled() and is_packed(position_ids):
        return packed_masks(config, position_ids)
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    def first_layer(kind: str):
        return next((i for i in layers if layer_attention_type(config, i) == kind), None) if cache is not None else None

    kwargs = dict(config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache,
                  position_ids=position_ids)
    masks = {"full_attention": create_causal_mask(**kwargs, layer_idx=first_layer("full_attention"))}
    if getattr(config, "sliding_window", None):
        masks["sliding_attention"] = create_sliding_window_causal_mask(
            **kwargs, layer_idx=first_layer("sliding_attention"))
    return masks


def packed_masks(config, position_ids: torch.Tensor) -> dict:
    """Packed rows under sdpa: one `PackedRows` a layer type (the sliding one with the config's window)."""
    rows = packed_rows_of(position_ids)
    masks = {"full_attention": rows}
    if getattr(config, "sliding_window", None):
        masks["sliding_attention"] = rows.with_window(config.sliding_window)
    return masks
