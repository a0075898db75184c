"""Model tensors that transformers merges on load from several checkpoint tensors (MoE experts).

transformers 5 keeps a Mixtral / Qwen3-MoE layer's experts fused in the module (`mlp.experts.gate_up_proj`
`[E, 2I, H]`, `mlp.experts.down_proj` `[E, H, I]`) while checkpoints store them one by one
(`block_sparse_moe.experts.3.w1.weight`, `mlp.experts.3.gate_proj.weight`; `save_pretrained` writes that
layout too). The model class declares how in its conversion mapping (`transformers.conversion_mapping`):
renamings, then `WeightConverter`s whose operations (`MergeModulelist`, `Concatenate`) build the module
tensor from the list of stored tensors. hfsplit groups the stored names exactly as transformers' loader
does (natural key order, one converter per target) and runs transformers' own operations on the tensors
it read, so nothing here knows a family's names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from hfsplit.errors import ConvertedOnLoadError
from hfsplit.models.layout import meta_model, one_layer_config


@dataclass(frozen=True)
class MergedTensor:
    """One model tensor built on load from several checkpoint tensors.

    Args:
        target: the model's parameter name ("model.layers.0.mlp.experts.gate_up_proj").
        converter: transformers' `WeightConverter` declaring the merge.
        sources: {the converter's source pattern: checkpoint keys it matched, in transformers' load order}.
    """

    target: str
    converter: object
    sources: dict[str, list[str]]

    def keys(self) -> list[str]:
        """Every checkpoint key the tensor is built from."""
        return [key for keys in self.sources.values() for key in keys]

    def merge(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The model tensor from `read(checkpoint key)` of each source, by the converter's own operations
        (on meta tensors this gives the shape and dtype without reading a byte)."""
        collected = {pattern: [read(key) for key in keys] for pattern, keys in self.sources.items() if keys}
        for op in self.converter.operations:
            collected = op.convert(collected, source_patterns=self.converter.source_patterns,
                                   target_patterns=self.converter.target_patterns, full_layer_name=self.target,
                                   model=None, config=None, missing_keys=None)
        (tensor,) = collected.values()
        return tensor

    def placement(self, shape_of: Callable[[str], tuple[int, ...]]) -> Optional[list[tuple[str, int, int, int]]]:
        """Where each stored piece lands in the merged tensor, as (checkpoint key, index along dim 0, dim of that
        slice, start): for transformers' stack-then-concatenate merges (`MergeModulelist(dim=0)`, then
        optionally `Concatenate(dim≥1)`), so the reader preads each piece straight into its place. None for
        other operations, which `merge` runs as transformers does."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        ops = self.converter.operations
        if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0:
            return None
        if len(ops) == 1 and len(self.sources) == 1:
            dim = 0
        elif len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim >= 1:
            dim = ops[1].dim - 1  # the concatenated dim of one stacked piece
        else:
            return None
        placed, start = [], 0
        for keys in self.sources.values():  # Concatenate's order: the converter's source patterns
            placed += [(key, index, dim, start) for index, key in enumerate(keys)]
            start += shape_of(keys[0])[dim] if keys else 0
        return placed


def split_checkpoint_names(weight_map: dict[str, str], model: torch.nn.Module
                           ) -> tuple[dict[str, str], dict[str, MergedTensor]]:
    """({model name: checkpoint key} for tensors read as stored or renamed, {model name: MergedTensor}),
    by transformers' renamings and converters for the model's class.

    Raises:
        ConvertedOnLoadError: a converter makes several model tensors from one (only merges are read here).
    """
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters = conversions_of(model)
    if not renamings and not converters:
        return {key: key for key in weight_map}, {}
    state = dict(model.state_dict(keep_vars=True))
    names: dict[str, str] = {}
    merged: dict[str, MergedTensor] = {}
    for key in sorted(weight_map, key=dot_natural_key):  # transformers' load order: experts 0, 1, …, 10
        renamed, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        if renamed not in state and key in state:  # as transformers: a name already the model's stays
            renamed, pattern = key, None
        if pattern is None:
            names[renamed] = key
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        if len(converter.target_patterns) != 1:
            raise ConvertedOnLoadError(
                f"{type(model).__name__}: checkpoint tensor {key!r} is split on load into "
                f"{converter.target_patterns}; hfsplit's reader only merges tensors; load this model with transformers")
        entry = merged.setdefault(renamed, MergedTensor(renamed, converter, {p: [] for p in converter.source_patterns}))
        entry.sources[pattern].append(key)
    return names, merged


def conversions_of(model: torch.nn.Module) -> tuple[list, list]:
    """transformers' (renamings, converters) for the model class; empty when the API is absent."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        transforms = get_model_conversion_mapping(model)
    except (ImportError, AttributeError, TypeError):  # a transformers without this API renames nothing
        return [], []
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def as_stored(config, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state`, a stage's state dict (model names: experts fused; emptied here), in the layout transformers' own `save_pretrained`
    writes, by its `revert_weight_conversion` (Mixtral's experts one by one as `block_sparse_moe.experts.N.w1`):
    what older transformers and other tools read. Unchanged for models without a conversion mapping.

    The pieces transformers returns are views of the fused tensors; each is copied out (safetensors writes no
    tensors sharing memory), one fused tensor at a time, so a stage's experts are held about once more at most
    by one layer's worth."""
    from transformers.core_model_loading import revert_weight_conversion

    reverted = revert_weight_conversion(meta_model(one_layer_config(config)), state)
    if reverted is state:
        return state
    kept = {id(t) for t in state.values()}
    state.clear()  # the fused tensors now live only through their pieces' views
    return {key: reverted[key] if id(reverted[key]) in kept else reverted.pop(key).clone() for key in list(reverted)}
