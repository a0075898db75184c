"""Models whose decoder blocks are not all alike: which kind each layer is, and the config of one kind.

Qwen2-MoE / Qwen3-MoE build a dense MLP instead of the sparse expert block in the layers named by
`mlp_only_layers` and in those off the `decoder_sparse_step` stride (transformers' decoder layer: sparse iff
`i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0`). A dense block holds a
fraction of an expert block's weights, so the cost model costs each kind by its own trace and the planner sums
the kinds a stage really holds (tests/models/test_layer_kinds.py checks the rule against the real classes on meta).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

DENSE, SPARSE = "dense", "sparse"


def layer_kinds(config) -> Optional[tuple[str, ...]]:
    """The kind of each decoder layer of `config`, or None when every layer is built alike."""
    if not hasattr(config, "mlp_only_layers") and not hasattr(config, "decoder_sparse_step"):
        return None
    dense_only = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    experts = getattr(config, "num_experts", 0) or 0
    kinds = tuple(SPARSE if i not in dense_only and experts > 0 and (i + 1) % step == 0 else DENSE
                  for i in range(config.num_hidden_layers))
    return kinds if len(set(kinds)) > 1 else None


def kind_config(config, kind: str):
    """A copy of `config` whose every layer is of `kind` (what the cost model traces one block of)."""
    cfg = config.__class__.from_dict(config.to_dict())
    if kind == DENSE:
        cfg.mlp_only_layers = list(range(config.num_hidden_layers))
    else:
        cfg.mlp_only_layers, cfg.decoder_sparse_step = [], 1
    return cfg


def runs_of(blocks: Sequence, layers: Union[int, range], default) -> list[tuple[object, int]]:
    """(cost, count) of consecutive alike layers of a stage holding `layers` (a count when every block is
    `default`, or the range of layer indices), in forward order; `blocks` holds each layer's cost."""
    if isinstance(layers, int) or not blocks:
        return [(default, len(layers) if isinstance(layers, range) else layers)]
    runs: list[list] = []
    for i in layers:
        if runs and runs[-1][0] is blocks[i]:
            runs[-1][1] += 1
        else:
            runs.append([blocks[i], 1])
    return [(cost, count) for cost, count in runs]
