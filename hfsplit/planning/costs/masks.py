"""The attention masks of a traced block and of a stage: the ones a stage builds when it runs.

The cost model traces a block on fake tensors, and transformers never skips a causal mask built from a fake
tensor (`masking_utils._ignore_causal_mask_sdpa` reads one as tracing), while a real stage under sdpa gets None
where there is no padding (`hfsplit.models.masks.causal_masks`, as the model's own forward): sdpa's causal flag then
replaces the mask, and the block makes none of the mask's float copies. So the mask is decided as the stage
decides it, on a meta hidden state of the traced shape, and the trace drops the captured fake mask where the run
has none. Packed rows (position ids restarting inside a row) get a materialised block-diagonal mask under eager:
its bytes are a stage's, once per micro-batch, beside what each block keeps of it. Under sdpa they run example by
example (`hfsplit.models.varlen`): no mask, only the examples' index tensors (`PackedRows`), and the trace runs
the block on that path (the examples' gathered queries, keys and values are what it keeps instead).
"""
from __future__ import annotations

import torch

from hfsplit.models.masks import causal_masks, layer_attention_type
from hfsplit.models.families import FAMILIES
from hfsplit.models.varlen import IMPLEMENTATION, PackedRows, enabled, packed_rows


def traced_lengths(seq: int, *, packed: bool) -> list[int]:
    """The example lengths of a traced row: one sequence, or (packed) two examples."""
    return [seq // 2, seq - seq // 2] if packed and seq > 1 else [seq]


def traced_positions(batch: int, seq: int, *, packed: bool) -> torch.Tensor:
    """Position ids of the traced shape: one sequence a row, or (packed) two examples a row. Where the examples end
    does not change what a mask costs (it is `seq × seq` whatever its blocks), only whether one is built."""
    positions = torch.cat([torch.arange(n) for n in traced_lengths(seq, packed=packed)])
    return positions.expand(batch, -1)


def runs_examples_apart(config, *, packed: bool) -> bool:
    """Whether packed rows of `config`'s model run example by example (`hfsplit.models.varlen`: sdpa, a declared
    family's stage; a followed model's own forward builds transformers' block-diagonal mask)."""
    return packed and config._attn_implementation == IMPLEMENTATION and enabled() and config.model_type in FAMILIES


def attended_positions(config, *, seq: int, packed: bool) -> int:
    """Query-key pairs a row's attention computes, as the time model counts them (the whole `seq²` under a mask or
    sdpa's causal flag; each traced example's `l²` where packed rows run example by example)."""
    if runs_examples_apart(config, packed=packed):
        return sum(n * n for n in traced_lengths(seq, packed=True))
    return seq * seq


def stage_masks(config, *, batch: int, seq: int, packed: bool, dtype: torch.dtype = torch.float32) -> dict:
    """The masks a stage builds for a micro-batch of this shape, by attention type (None: sdpa's causal flag), on the
    meta device (built, they cost nothing)."""
    hidden = torch.empty(batch, seq, config.hidden_size, dtype=dtype, device="meta")
    return causal_masks(config, hidden=hidden, position_ids=traced_positions(batch, seq, packed=packed))


def mask_as_run(config, kwargs: dict, *, batch: int, seq: int, packed: bool = False) -> dict:
    """`kwargs` (captured for `config`'s layer 0 on fake tensors) with the attention mask a stage passes (for packed
    rows run example by example, the `PackedRows` of `traced_rows`, built by the caller under its FakeTensorMode)."""
    if kwargs.get("attention_mask") is None or runs_examples_apart(config, packed=packed):
        return kwargs

    masks = stage_masks(config, batch=batch, seq=seq, packed=packed)
    kind = layer_attention_type(config, 0)
    if kind not in masks:  # a type of its own (linear, chunked, indexed attention): traced with the model's own mask
        return kwargs
    return {**kwargs, "attention_mask": None} if masks[kind] is None else kwargs


def traced_rows(config, *, batch: int, seq: int, packed: bool):
    """The `PackedRows` layer 0 gets for traced packed rows run example by example (None otherwise), its tensors
    built from Python lists, so under the caller's FakeTensorMode fake ones."""
    if not runs_examples_apart(config, packed=packed) or seq < 2:
        return None
    window = config.sliding_window if layer_attention_type(config, 0) == "sliding_attention" else None
    return packed_rows([traced_lengths(seq, packed=True)] * batch, seq=seq, device="cpu", window=window)


def stage_mask_bytes(config, *, batch: int, seq: int, packed: bool, dtype: torch.dtype) -> int:
    """Bytes of the masks a stage materialises for one micro-batch (a boolean `seq²` per row under sdpa, one of the
    compute dtype under eager; a sliding-window model builds one per attention type; none for unpacked rows under
    sdpa, nor as a BlockMask under flex or for flash attention, which read the position ids; packed rows under sdpa:
    the int64 index tensors of their examples, `PackedRows`, shared by the layer types)."""
    masks = stage_masks(config, batch=batch, seq=seq, packed=packed, dtype=dtype)
    distinct = {id(m): m for m in masks.values() if isinstance(m, torch.Tensor)}
    indices = {id(m.order): m.index_bytes() for m in masks.values() if isinstance(m, PackedRows)}
    return sum(m.numel() * m.element_size() for m in distinct.values()) + sum(indices.values())
