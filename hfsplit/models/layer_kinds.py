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


# Attention types that change only a layer's mask, not its modules: one kind for the cost model.
MASK_ONLY = ("full_attention", "sliding_attention", "chunked_attention")


def layer_kinds(config) -> Optional[tuple[str, ...]]:
    """The kind of each decoder layer of `config`, or None when every layer is built alike: its MLP's kind (dense or
    sparse) where the model mixes them, and its attention type where that changes its modules (Qwen3-Next's linear
    attention beside full attention, Granite 4's Mamba2 mixers), joined as "linear_attention/sparse"."""
    n = config.num_hidden_layers
    mlp = [_mlp_kind(config, i) for i in range(n)]
    types = getattr(config, "layer_types", None)
    attention = list(types) if isinstance(types, (list, tuple)) and len(types) == n and \
        len(set(types)) > 1 and (not set(types) <= set(MASK_ONLY) or per_layer_overrides(config)) else [None] * n
    mlp = mlp if len(set(mlp)) > 1 else [None] * n
    kinds = tuple("/".join(part for part in (a, m) if part) for a, m in zip(attention, mlp))
    return kinds if len(set(kinds)) > 1 else None


def _mlp_kind(config, i: int) -> Optional[str]:
    """Layer `i`'s MLP: "sparse" (experts) or "dense", by whichever rule its config follows (None: not an MoE)."""
    experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None) or 0
    if hasattr(config, "mlp_only_layers") or hasattr(config, "decoder_sparse_step"):
        dense_only = set(getattr(config, "mlp_only_layers", None) or ())
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return SPARSE if i not in dense_only and experts > 0 and (i + 1) % step == 0 else DENSE
    types = getattr(config, "mlp_layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == config.num_hidden_layers:
        return DENSE if types[i] == DENSE else SPARSE
    first_dense = getattr(config, "first_k_dense_replace", None)
    if isinstance(first_dense, int) and experts:
        return DENSE if i < first_dense else SPARSE
    return None


def per_layer_overrides(config) -> dict:
    """{layer index: the config fields that layer overrides}: Gemma 4's full-attention layers' wider heads and own
    KV heads (`per_layer_config`), so its attention types change a layer's modules, not only its mask; else {}."""
    overrides = config.to_dict().get("per_layer_config")
    return {int(i): dict(fields) for i, fields in overrides.items() if fields} if isinstance(overrides, dict) else {}


def kind_config(config, kind: str):
    """A copy of `config` whose every layer is of `kind` (what the cost model traces one block of), with the
    per-layer overrides of the first layer of that kind on every layer (`per_layer_overrides`)."""
    data = config.to_dict()
    n = config.num_hidden_layers
    attention = [part for part in kind.split("/") if part not in (DENSE, SPARSE)]
    if attention and isinstance(data.get("per_layer_config"), dict):
        first = list(config.layer_types).index(attention[0])
        fields = per_layer_overrides(config).get(first)
        data["per_layer_config"] = {str(i): fields for i in range(n)} if fields else {}
    cfg = config.__class__.from_dict(data)
    for part in kind.split("/"):
        if part not in (DENSE, SPARSE):
            cfg.layer_types = [part] * n
        elif hasattr(config, "mlp_only_layers") or hasattr(config, "decoder_sparse_step"):
            if part == DENSE:
                cfg.mlp_only_layers = list(range(n))
            else:
                cfg.mlp_only_layers, cfg.decoder_sparse_step = [], 1
        elif isinstance(getattr(config, "mlp_layer_types", None), (list, tuple)):
            cfg.mlp_layer_types = [part] * n
        elif hasattr(config, "first_k_dense_replace"):
            cfg.first_k_dense_replace = n if part == DENSE else 0
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
