"""The user's config shrunk: every flag, layer type and layer pattern kept, only the sizes made tiny.

What the proof of a split runs (`hfsplit.load.proof`): a model of the same class and the same switches as the one the
user gave, small enough to build with random weights and run whole and split on one CPU core in a second or two.
Sizes are set by what each field is (a width, a head count, an expert count, a window), so that the constraints
between them hold (heads × head_dim, experts ≥ experts per token, groups dividing experts); the lists that give each
layer its kind (`layer_types`, `mlp_layer_types`, `no_rope_layers`, dense-first layers) are cut to the first layers,
enough of them that every kind appears.
"""
from __future__ import annotations

from typing import Any

VOCAB = 256
HIDDEN = 64
HEADS = 4
HEAD_DIM = 16
WINDOW = 4  # sliding windows and attention chunks shorter than the proof's examples, so that they bite
MIN_LAYERS = 4

# field: tiny value (set only where the config has the field and it is an int)
_SIZES: dict[str, int] = {
    "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN,
    "head_dim": HEAD_DIM, "kv_channels": HEAD_DIM, "attention_head_dim": HEAD_DIM,
    "intermediate_size": 2 * HIDDEN, "intermediate_size_mlp": 2 * HIDDEN, "ffn_hidden_size": 2 * HIDDEN,
    "n_inner": 2 * HIDDEN, "ffn_dim": 2 * HIDDEN,
    "moe_intermediate_size": HIDDEN // 2, "shared_expert_intermediate_size": HIDDEN // 2,
    "shared_intermediate_size": HIDDEN // 2, "expert_intermediate_size": HIDDEN // 2,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 16,
    "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 8, "mamba_d_ssm": 64,
    "mamba_n_groups": 1, "ssm_state_size": 16, "time_step_rank": 8, "mamba_dt_rank": 8, "state_size": 16,
    "chunk_size": 8,
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB, "laurel_rank": 8,
    "sliding_window": WINDOW, "attention_chunk_size": WINDOW, "window_size": WINDOW,
    "conv_L_cache": 3, "conv_dim": HIDDEN, "conv_dim_out": HIDDEN, "block_multiple_of": 16, "block_dim": HIDDEN,
    "block_ff_dim": 2 * HIDDEN, "rotary_dim": 8, "n_group": 2, "topk_group": 1,
}
_SPECIAL_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
# lists holding one entry per layer, and lists of layer indices
_PER_LAYER = ("layer_types", "mlp_layer_types", "no_rope_layers", "intermediate_size", "activation_sparsity_pattern",
              "attn_layer_period", "block_types", "attention_layers")
_INDEX_LISTS = ("mlp_only_layers", "moe_layers", "full_attn_idxs", "attn_layer_indices", "swa_layers",
                "global_attn_layers", "no_rope_layer_indices", "dense_layers")


def shrunk_config(config):
    """A copy of `config` of the same class and switches with tiny sizes (see the module docstring)."""
    data = config.to_dict()
    # a field under its own name (Ernie's `moe_k` for `num_experts_per_tok`) is shrunk by the rule of the standard
    # name, unless its own name has a rule (Inkling's `moe_intermediate_size`, aliased `intermediate_size`)
    aliases = {std: own for std, own in getattr(config, "attribute_map", {}).items()
               if own in data and std not in data and own not in _SIZES}
    data = {**data, **{std: data[own] for std, own in aliases.items()}}
    layers = _layer_count(data)
    small: dict[str, Any] = {}
    for key, value in data.items():
        if key in _SIZES and isinstance(value, int) and not isinstance(value, bool) and value:
            small[key] = min(value, _SIZES[key]) if key in ("num_experts_per_tok",) else _SIZES[key]
    small.update(_heads(data))
    small.update(_experts(data))
    small.update(_mla(data, small))
    small.update(_vocab(data))
    small.update(_layers(data, layers))
    small.update(_mamba(data, small))
    for std, own in aliases.items():  # back under the config's own name, where no rule of that name shrank it
        value, _ = small.pop(std, None), data.pop(std)
        if value is not None and own not in small:
            small[own] = value
    data.update(small)
    shrunk = config.__class__.from_dict(data)
    for key in ("_attn_implementation_internal", "_name_or_path"):
        if hasattr(config, key):
            setattr(shrunk, key, getattr(config, key))
    return shrunk


_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num")


def _heads(data: dict) -> dict:
    out = {}
    for key in ("num_attention_heads", "n_head", "num_heads"):
        if isinstance(data.get(key), int):
            out[key] = HEADS
    for key in _KV_HEADS:
        value, heads = data.get(key), next((data[k] for k in ("num_attention_heads", "n_head", "num_heads")
                                            if isinstance(data.get(k), int)), None)
        if isinstance(value, int) and heads:
            out[key] = HEADS if value >= heads else max(1, HEADS // 2) if value > 1 else 1
    if "head_dim" in data and data.get("head_dim") and not data.get("qk_rope_head_dim"):
        out["head_dim"] = HEAD_DIM
    return out


def _experts(data: dict) -> dict:
    out = {}
    if isinstance(data.get("num_experts_per_tok"), int):
        out["num_experts_per_tok"] = min(data["num_experts_per_tok"], 2)
    if isinstance(data.get("moe_topk"), int):
        out["moe_topk"] = min(data["moe_topk"], 2)
    if isinstance(data.get("n_shared_experts"), int) and data["n_shared_experts"] > 1:
        out["n_shared_experts"] = 1
    if isinstance(data.get("first_k_dense_replace"), int) and data["first_k_dense_replace"] > 1:
        out["first_k_dense_replace"] = 1
    if isinstance(data.get("num_kv_shared_layers"), int) and data["num_kv_shared_layers"]:
        out["num_kv_shared_layers"] = 2
    return out


def _mla(data: dict, small: dict) -> dict:
    """Multi-head latent attention: the query/key head is its rope and no-rope parts, the rotary one its head_dim."""
    if not data.get("qk_rope_head_dim"):
        return {}
    out = {"qk_head_dim": small["qk_rope_head_dim"] + small.get("qk_nope_head_dim", 0)} if "qk_head_dim" in data else {}
    if "head_dim" in data:
        out["head_dim"] = small["qk_rope_head_dim"]
    return out


def _mamba(data: dict, small: dict) -> dict:
    """Mamba2 mixers: heads × head width = expand × hidden (Granite 4, Bamba), or the SSM width given (Falcon-H1)."""
    if not isinstance(data.get("mamba_d_head"), int) or not isinstance(data.get("mamba_n_heads"), int):
        return {}
    heads = small.get("mamba_n_heads", data["mamba_n_heads"])
    if isinstance(data.get("mamba_d_ssm"), int):
        return {"mamba_d_ssm": heads * small["mamba_d_head"]}
    expand = data.get("mamba_expand") or 2
    return {"mamba_d_head": expand * small.get("hidden_size", HIDDEN) // heads}


def _vocab(data: dict) -> dict:
    out = {"vocab_size": VOCAB} if isinstance(data.get("vocab_size"), int) else {}
    for key, tiny in _SPECIAL_TOKENS.items():
        value = data.get(key)
        if isinstance(value, int) and value >= VOCAB:
            out[key] = tiny
        elif isinstance(value, list):
            out[key] = [v if v < VOCAB else tiny for v in value]
    return out


def _layer_count(data: dict) -> int:
    """How many layers the shrunk model keeps: every kind of layer appears (and at least `MIN_LAYERS`)."""
    total = data.get("num_hidden_layers") or data.get("n_layer") or MIN_LAYERS
    needed = MIN_LAYERS
    for key in _PER_LAYER:
        kinds = data.get(key)
        if isinstance(kinds, list) and len(kinds) == total:
            firsts = {}
            for i, kind in enumerate(map(str, kinds)):
                firsts.setdefault(kind, i)
            needed = max(needed, max(firsts.values()) + 1)
    first_dense = data.get("first_k_dense_replace")
    if isinstance(first_dense, int) and first_dense:
        needed = max(needed, 3)
    kv_shared = data.get("num_kv_shared_layers")
    if isinstance(kv_shared, int) and kv_shared:
        needed = max(needed, 6)
    return min(total, needed + (needed % 2))


def _override(data: dict, override: dict) -> dict:
    """One layer's overrides (Gemma 4's full-attention `global_head_dim`) shrunk as the fields they override: a size
    keeps its ratio to the model-wide one (512 over 256 stays twice the shrunk head: 32, its layers still the
    widest), a head count takes the model-wide rule (`_heads`)."""
    out = dict(override)
    for key, value in override.items():
        base = data.get(key)
        if not (isinstance(value, int) and isinstance(base, int) and base) or isinstance(value, bool):
            continue
        if key in _SIZES:
            out[key] = max(1, _SIZES[key] * value // base)
        elif key in _KV_HEADS:
            out[key] = _heads({**data, key: value})[key]
    return out


def _layers(data: dict, layers: int) -> dict:
    total = data.get("num_hidden_layers") or data.get("n_layer")
    out = {key: layers for key in ("num_hidden_layers", "n_layer") if isinstance(data.get(key), int)}
    for key in _PER_LAYER:
        if isinstance(data.get(key), list) and len(data[key]) == total:
            out[key] = data[key][:layers]
            if key == "intermediate_size":
                out[key] = [2 * HIDDEN] * layers
    if isinstance(data.get("attention_types"), list) and "attention_layers" in out:  # GPT-Neo: [[kinds, repeats]]
        out["attention_types"] = [[[kind], 1] for kind in out["attention_layers"]]
    if isinstance(data.get("per_layer_config"), dict):  # Gemma 4: overrides keyed by layer index
        overrides = data["per_layer_config"].items()
        out["per_layer_config"] = {k: _override(data, v) for k, v in overrides if int(k) < layers}
    for key in _INDEX_LISTS:
        if isinstance(data.get(key), list) and all(isinstance(i, int) for i in data[key]):
            out[key] = [i for i in data[key] if i < layers]
    return out
