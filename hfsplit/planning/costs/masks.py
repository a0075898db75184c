"""The attention masks of a traced block and of a stage: the ones a stage builds when it runs.

The cost model traces a block on fake tensors, and transformers never skips a causal mask built from a fake
tensor (`masking_utils._ignore_causal_mask_sdpa` reads one as tracing), while a real stage under sdpa gets None
where there is no padding (`hfsplit.models.masks.causal_masks`, as the model's own forward): sdpa's causal flag then
replaces the mask, and the block makes none of the mask's float copies. So the mask is decided as the stage
decides it, on a meta hidden state of the traced shape, and the trace drops the captured fake mask where the run
has none. Packed rows (position ids restarting inside a row) always get a materialised block-diagonal mask under
sdpa and eager: its bytes are a stage's, once per micro-batch, beside what each block keeps of it.
"""
from __future__ import annotations

import torch

from hfsplit.models.masks import causal_masks, layer_attention_type


def traced_positions(batch: int, seq: int, *, packed: bool) -> torch.Tensor:
    """Position ids of the traced shape: one sequence a row, or (packed) two examples a row. Where the examples end
    does not change what a mask costs (it is `seq × seq` whatever its blocks), only whether one is built."""
    positions = torch.arange(seq)
    if packed and seq > 1:
        positions = torch.cat([torch.arange(seq // 2), torch.arange(seq - seq // 2)])
    return positions.expand(batch, -1)


def stage_masks(config, *, batch: int, seq: int, packed: bool, dtype: torch.dtype = torch.float32) -> dict:
    """The masks a stage builds for a micro-batch of this shape, by attention type (None: sdpa's causal flag), on the
    meta device (built, they cost nothing)."""
    hidden = torch.empty(batch, seq, config.hidden_size, dtype=dtype, device="meta")
    return causal_masks(config, hidden=hidden, position_ids=traced_positions(batch, seq, packed=packed))


def mask_as_run(config, kwargs: dict, *, batch: int, seq: int, packed: bool = False) -> dict:
    """`kwargs` (captured for `config`'s layer 0 on fake tensors) with the attention mask a stage passes."""
    if kwargs.get("attention_mask") is None:
        return kwargs

    masks = stage_masks(config, batch=batch, seq=seq, packed=packed)
    return {**kwargs, "attention_mask": None} if masks[layer_attention_type(config, 0)] is None else kwargs


def stage_mask_bytes(config, *, batch: int, seq: int, packed: bool, dtype: torch.dtype) -> int:
    """Bytes of the masks a stage materialises for one micro-batch (a boolean `seq²` per row under sdpa, one of the
    compute dtype under eager; a sliding-window model builds one per attention type; none for unpacked rows under
    sdpa, nor as a BlockMask under flex or for flash attention, which read the position ids)."""
    masks = stage_masks(config, batch=batch, seq=seq, packed=packed, dtype=dtype)
    distinct = {id(m): m for m in masks.values() if isinstance(m, torch.Tensor)}
    return sum(m.numel() * m.element_size() for m in distinct.values())
