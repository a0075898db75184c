"""How a causal LM is laid out: the meta-device model, its decoder's parts, one block's linear layers.

The one builder every part of hfsplit uses (`meta_model`) and what it reads off the real transformers class
(no hand formulas): where the blocks sit, which linears a block holds and how the TP plan styles them.
"""
from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from hfsplit.errors import UnsupportedModelError
from hfsplit.models.families import tp_style_of
from hfsplit.models.layer_kinds import DENSE, SPARSE, kind_config, layer_kinds


def meta_model(config, *, dtype: Optional[torch.dtype] = None, attn_implementation: Optional[str] = None) -> nn.Module:
    """The causal LM of `config` on the meta device: shapes and names, no memory.

    The one builder every part of hfsplit uses (the stage builder, the loader, the cost model).
    """
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype or torch.get_default_dtype()}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **kwargs)


def rebuilt_quietly(config_class, data: dict):
    """`config_class.from_dict(data)` without transformers' warnings: a config of one layer kind (all sliding, say)
    makes Gemma 4's post-init warn that it forces the last layer to full attention, once per kind and plan, though
    `one_layer_config` then sets the one block's type itself."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return config_class.from_dict(data)
    finally:
        hf_logging.set_verbosity(level)


def one_layer_config(config):
    """A copy of `config` with one decoder block (all blocks alike; 1 block builds ~80× faster than 80)."""
    data = config.to_dict()
    if isinstance(data.get("per_layer_config"), dict):  # Gemma 4: overrides by layer index, the first block's kept
        data["per_layer_config"] = {k: v for k, v in data["per_layer_config"].items() if int(k) == 0}
    cfg = rebuilt_quietly(config.__class__, data)
    cfg.num_hidden_layers = 1
    layer_types = getattr(cfg, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and len(layer_types) > 1:  # (Falcon-H1's derives its own: a property)
        cfg.layer_types = list(layer_types[:1])
    if getattr(cfg, "num_kv_shared_layers", None):  # Gemma 3n: one block reuses no other's keys
        cfg.num_kv_shared_layers = 0
    return cfg


@dataclass(frozen=True)
class DecoderLayout:
    """Where a causal LM keeps its parts, as module paths of the full model ("model.layers").

    Args:
        base: the decoder ("model", GPT-2's "transformer").
        before: the decoder's children ahead of the blocks (embeddings, positional embeddings).
        layers: the ModuleList of decoder blocks.
        after: the decoder's children behind the blocks (final norm, rotary embedding).
        outside: the model's children outside the decoder (lm_head).
    """

    base: str
    before: tuple[str, ...]
    layers: str
    after: tuple[str, ...]
    outside: tuple[str, ...]


def decoder_layout(model: nn.Module) -> DecoderLayout:
    """The layout of `model` (a transformers causal LM): its blocks are the decoder's ModuleList holding
    `num_hidden_layers` modules; the decoder's other children go before or after them in registration
    order, which is the order the model's forward runs them."""
    prefix = model.base_model_prefix
    if not isinstance(getattr(model, prefix, None), nn.Module) and isinstance(getattr(model, "model", None), nn.Module):
        prefix = "model"  # Llama 4's text model: prefix "language_model", decoder at "model"
    base = getattr(model, prefix, None)
    if not isinstance(base, nn.Module):
        raise UnsupportedModelError(f"{type(model).__name__} has no decoder named {prefix!r}; load it with transformers")
    children = list(base.named_children())
    n = model.config.num_hidden_layers
    at = next((i for i, (_, m) in enumerate(children) if isinstance(m, nn.ModuleList) and len(m) == n), None)
    if at is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: found no list of its {n} decoder blocks under {prefix!r}; load it with transformers")
    early = _run_before_blocks(base, children[at][0])
    later = [(name, m) for name, m in children[at + 1:] if name not in early or not any(True for _ in m.parameters())]
    return DecoderLayout(
        base=prefix,
        before=tuple(f"{prefix}.{name}" for name, m in children if (name, m) not in later and name != children[at][0]),
        layers=f"{prefix}.{children[at][0]}",
        after=tuple(f"{prefix}.{name}" for name, _ in later),
        outside=tuple(name for name, _ in model.named_children() if name != prefix),
    )


def _run_before_blocks(base: nn.Module, layers: str) -> set[str]:
    """The names the decoder's forward uses before its loop over the blocks `layers`, read from its source and that
    of its own methods it calls there: where a child registered after the blocks runs before them (Gemma 3n's and
    Gemma 4's per-layer embeddings and projections, Gemma 3n's AltUp projections)."""
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return set()
    loop = re.search(rf"\n\s*for [^\n]*self\.{layers}\b", source)
    if loop is None:
        return set()
    head = source[:loop.start()]
    for method in set(re.findall(r"self\.(\w+)\(", head)):
        if inspect.isfunction(getattr(type(base), method, None)) and method != "forward":
            head += inspect.getsource(getattr(type(base), method))
    return set(re.findall(r"self\.(\w+)", head))


@dataclass(frozen=True)
class BlockLinear:
    """One nn.Linear of a decoder block."""

    name: str  # relative to the block ("self_attn.q_proj")
    in_features: int
    out_features: int
    tp_style: Optional[str]  # the TP plan's style for it, None when the plan leaves it whole


def block_linears(config) -> tuple[BlockLinear, ...]:
    """The linear layers of one decoder block of `config`'s model, read from the real class on meta."""
    key = config.to_json_string(use_diff=False)
    _CONFIGS.setdefault(key, config)
    return _block_linears(key)


_CONFIGS: dict[str, object] = {}  # lru_cache keys must be hashable; configs are not


@functools.lru_cache(maxsize=32)
def _block_linears(key: str) -> tuple[BlockLinear, ...]:
    config = _CONFIGS[key]
    model = meta_model(one_layer_config(config))
    block = model.get_submodule(decoder_layout(model).layers)[0]
    return tuple(BlockLinear(name, m.in_features, m.out_features, tp_style_of(config, f"layers.0.{name}"))
                 for name, m in block.named_modules() if _plain_linear(m))


def _plain_linear(module: nn.Module) -> bool:
    """An nn.Linear computing a linear map (not a router subclass returning its scores and logits, Llama 4's)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def routed_expert_numel(config) -> int:
    """Matmul weights one token passes through in one block's fused experts (MoE): `num_experts_per_tok` experts'
    share of the 3-D expert tensors (Mixtral's `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]); 0 for a
    dense block. Every expert's weights are held, only these are computed with."""
    key = config.to_json_string(use_diff=False)
    _CONFIGS.setdefault(key, config)
    return _routed_expert_numel(key)


def holds_experts(module: nn.Module) -> bool:
    """Whether `module`'s own 3-D parameters are fused experts `[experts, d1, d2]`: a convolution's 3-D weight
    (the conv1d of Mamba2 mixers and of gated DeltaNet linear attention) is not."""
    return not isinstance(module, nn.modules.conv._ConvNd)


@functools.lru_cache(maxsize=32)
def _routed_expert_numel(key: str) -> int:
    config = _CONFIGS[key]
    top_k = getattr(config, "num_experts_per_tok", None)
    if not top_k:
        return 0
    model = meta_model(one_layer_config(config))
    block = model.get_submodule(decoder_layout(model).layers)[0]
    per_expert = sum(p[0].numel() for m in block.modules() if holds_experts(m)  # [experts, out, in]
                     for p in m.parameters(recurse=False) if p.dim() == 3)
    return top_k * per_expert


def block_linear_names(config) -> list[str]:
    """The linear layers of one decoder block ("q_proj" … "down_proj", Phi-3's fused "qkv_proj" and
    "gate_up_proj"): LoRA's default targets, which the cost model counts when none are given. Where the layers are
    of several kinds (`hfsplit.models.layer_kinds`): over attention kinds, those of any (Qwen3-Next's linear
    attention's and its full attention's projections); over MLP kinds (Qwen3-MoE's dense `mlp_only_layers`), those
    every kind has: a dense layer's `gate_proj`/`up_proj`/`down_proj` would also make peft adapt the other layers'
    fused experts (its v4-to-v5 MoE target conversion), and name no module of a stage holding expert layers only."""
    kinds = layer_kinds(config)
    if not kinds:
        return sorted({lin.name.rsplit(".", 1)[-1] for lin in block_linears(config)})
    by_mlp: dict = {}
    for kind in sorted(set(kinds)):
        mlp = next((part for part in kind.split("/") if part in (DENSE, SPARSE)), None)
        by_mlp.setdefault(mlp, set()).update(lin.name.rsplit(".", 1)[-1] for lin in block_linears(kind_config(config, kind)))
    return sorted(set.intersection(*by_mlp.values()))


def recompute_buffers(root: nn.Module, init, *, device: Optional[torch.device] = None) -> list[torch.Tensor]:
    """Recompute the non-persistent buffers no checkpoint holds (rotary `inv_freq`, Gemma's `embed_scale`)
    with the model's own `_init_weights` (`init`), as transformers' loading does.

    With `device`, only buffers still on the meta device are given storage there and recomputed. A module's
    own parameters (Gemma's embedding weight beside `embed_scale`) already hold checkpoint bytes: `init`
    sees meta stand-ins, on which its writes do nothing. Returns the buffers recomputed.
    """
    fresh = []
    for module_name, module in root.named_modules():
        own = [b for b in module._non_persistent_buffers_set if module._buffers.get(b) is not None]
        if device is not None:
            own = [b for b in own if module._buffers[b].is_meta]
            module._buffers.update({b: torch.zeros_like(module._buffers[b], device=device) for b in own})  # what init leaves
        if not own:
            continue
        fresh += [module._buffers[b] for b in own]
        if init is None:
            raise UnsupportedModelError(f"{type(root).__name__} has no _init_weights to recompute {module_name} buffers")
        loaded = dict(module._parameters)
        module._parameters.update({k: nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                                   for k, p in loaded.items() if p is not None})
        try:
            with torch.no_grad():
                init(module)
        finally:
            module._parameters.update(loaded)
    return fresh
