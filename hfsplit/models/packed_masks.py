"""Packed rows through a decoder that builds its masks without the position ids (Granite 4, AFMoE).

transformers finds a packed row's examples from the position ids its mask functions are given (`create_causal_mask`
and the others make the mask block-diagonal then). Some decoders leave them out of their `mask_kwargs`, so a packed
row's examples would attend to each other; the same decoders hand their blocks no position ids either, so a
recurrent mixer (`hfsplit.models.packed_recurrence`) would not know where an example starts. Such a decoder takes
prepared masks, one per layer type (its `attention_mask` given as a dict, as `generate` hands them), so a stage
running it on packed rows hands it:

- the masks transformers' own mask function of each layer type (`LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING`) builds
  with the position ids;
- `seq_idx`, each token's example index in its row (transformers' keyword for packed sequences in Mamba2 kernels),
  which the decoder passes on to its blocks with its other keyword arguments, and from which the recurrent mixers'
  block pre-hook finds the examples (also when an activation-checkpointing recompute calls the block again).

Which decoders: read from the forward's source (its `mask_kwargs` without `position_ids`, and a dict
`attention_mask` taken as it is); the proof (`hfsplit.load.proof.packed_rows_isolated`) still decides whether a
model packs.
"""
from __future__ import annotations

import inspect
import re
from typing import Optional

import torch
from torch import nn

_MASK_KWARGS = re.compile(r"mask_kwargs\s*=\s*\{(.*?)\}", re.S)
_TAKES_MASKS = re.compile(r"isinstance\(\s*(?:causal_mask_mapping\s*:=\s*)?attention_mask\s*,\s*dict\s*\)")


def builds_masks_blind(decoder: nn.Module) -> bool:
    """Whether `decoder` builds its masks without the position ids and takes prepared ones as a dict instead."""
    try:
        source = inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):
        return False
    found = _MASK_KWARGS.search(source)
    return found is not None and "position_ids" not in found.group(1) and _TAKES_MASKS.search(source) is not None


def packed_inputs(config, position_ids: torch.Tensor, *, dtype: torch.dtype,
                  attention_mask: Optional[torch.Tensor] = None) -> dict:
    """The keyword arguments that tell a blind decoder where a packed micro-batch's examples start: `attention_mask`,
    each layer type's mask built with `position_ids` `(batch, seq)` (for hidden states of `dtype`), and `seq_idx`;
    {} where transformers maps some layer type of `config` to no single mask function."""
    from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING

    kinds = set(getattr(config, "layer_types", None) or ())
    builders = {kind: LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.get(kind) for kind in kinds}
    if not kinds or not all(callable(build) for build in builders.values()):
        return {}
    like = torch.empty(*position_ids.shape, 1, dtype=dtype, device=position_ids.device)  # only its shape, dtype, device
    masks = {kind: build(config=config, inputs_embeds=like, attention_mask=attention_mask, cache=None,
                         position_ids=position_ids) for kind, build in builders.items()}
    return {"attention_mask": masks, "seq_idx": example_index(position_ids)}


def example_index(position_ids: torch.Tensor) -> torch.Tensor:
    """Each token's example in its row (0, 1, ...: a new one wherever a position is not the previous one plus 1),
    int32 as the Mamba2 kernels take it."""
    starts = torch.ones_like(position_ids, dtype=torch.int32)
    starts[..., 1:] = (position_ids.diff(dim=-1) != 1).to(torch.int32)
    return starts.cumsum(-1, dtype=torch.int32) - 1


def lengths_of_index(seq_idx: torch.Tensor) -> list[list[int]]:
    """Per row, the lengths of its examples from `example_index`'s output."""
    return [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in seq_idx]
