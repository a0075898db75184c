"""What the cost model reads off the real model class on the meta device: parameter counts and one block's linears.

Configs are keyed by their JSON (`keyed`), so the figures derived from one are computed once per process
(`functools.lru_cache`) and, for the layout, once per machine (`hfsplit.planning.costs.cache`).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError

from hfsplit.errors import PlanError
from hfsplit.models.families import tp_style_of, tp_whole_parts
from hfsplit.models.layout import block_linears, decoder_layout, meta_model, one_layer_config
from hfsplit.plan import TrainingSpec
from hfsplit.planning.costs.cache import read_cache, write_cache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

LORA_ADAPTER_DTYPE = torch.float32  # peft's autocast_adapter_dtype=True (its default) upcasts bf16/fp16 adapters

CONFIGS: dict[str, object] = {}


def config_key(config) -> str:
    """The key a config is cached under: its full JSON (configs are not hashable), and the attention implementation
    asked for, which the JSON leaves out but the masks and traces follow (eager materialises what sdpa does not)."""
    return f"{config.to_json_string(use_diff=False)}|attn={getattr(config, '_attn_implementation', None)}"


def keyed(config) -> str:
    """`config`'s key, with the config registered under it in `CONFIGS` (the cached functions take keys)."""
    key = config_key(config)
    CONFIGS.setdefault(key, config)
    return key


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a TrainingSpec names; PlanError for an unknown one."""
    if name not in DTYPES:
        raise PlanError(f"TrainingSpec.dtype {name!r}: use one of {sorted(DTYPES)}")
    return DTYPES[name]


def rank_layer_config(config, *, tp: int = 1):
    """A copy of `config` with one decoder block whose heads and MLP width are those of one TP rank (whole where the
    plan gathers them on every rank, `tp_whole_parts`)."""
    cfg = one_layer_config(config)
    whole = tp_whole_parts(config)
    if tp > 1 and "attention" not in whole:
        heads = config.num_attention_heads
        cfg.num_attention_heads = heads // tp
        cfg.num_key_value_heads = (getattr(config, "num_key_value_heads", None) or heads) // tp
        cfg.head_dim = head_dim(config)  # hidden_size // heads would change once heads are divided
    if tp > 1 and "mlp" not in whole:
        cfg.intermediate_size = config.intermediate_size // tp
        if getattr(config, "moe_intermediate_size", None):  # each expert's width, split as the dense MLP's
            cfg.moe_intermediate_size = config.moe_intermediate_size // tp
    return cfg  # attention as transformers picks it by default (sdpa where the class supports it)


def head_dim(config) -> int:
    """The width of one attention head: the config's own, else hidden size / heads; where it varies by layer (Gemma
    4's full-attention layers' `global_head_dim`), the widest, as the attention FLOPs of a block are counted."""
    try:
        own = getattr(config, "head_dim", None)
    except AmbiguousGlobalPerLayerAttributeError:
        return max(layer.head_dim for layer in config.per_layer_config)
    return own or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class Linear:
    name: str  # relative to the block
    in_features: int
    out_features: int
    shard: Optional[str]  # "col" (output dim split), "row" (input dim split) or None (replicated)


@dataclass(frozen=True)
class Layout:
    """Parameter counts of the real model class, read from a meta-device instance."""

    embed_numel: int  # everything ahead of the blocks (GPT-2's positional embedding too)
    head_numel: int  # final norm + lm_head, the tied matrix included
    norm_numel: int  # everything behind the blocks but lm_head (replicated under TP)
    block_numel_replicated: int  # block parameters not split by TP (norms, rowwise biases)
    block_numel_sharded: int  # block parameters split by TP (before division)
    linears: tuple[Linear, ...]
    tied: bool
    # (values, split by TP) of each parameter: what an optimizer holds a state for, tensor by tensor
    embed_params: tuple[tuple[int, bool], ...] = ()
    block_params: tuple[tuple[int, bool], ...] = ()
    head_params: tuple[tuple[int, bool], ...] = ()
    attn_implementation: str = ""  # the attention transformers picks for the model class (its masks follow)


def _shard(style: Optional[str]) -> Optional[str]:
    if style and "colwise" in style:
        return "col"
    if style and "rowwise" in style:
        return "row"
    return None


def parts(model) -> tuple[list, torch.nn.Module, list, torch.nn.Module]:
    """(modules ahead of the blocks, the first block, modules behind them, lm_head) of a causal LM."""
    layout = decoder_layout(model)
    before = [model.get_submodule(name) for name in layout.before]
    after = [model.get_submodule(name) for name in layout.after]
    return before, model.get_submodule(layout.layers)[0], after, model.get_output_embeddings()


def numel(modules) -> int:
    """Parameters of `modules`, together."""
    return sum(p.numel() for m in modules for p in m.parameters())


@functools.lru_cache(maxsize=32)
def layout_of(key: str) -> Layout:
    return cached_layout(key, _build_layout)  # building the meta model imports the modeling code: ~1 s


def _build_layout(key: str) -> Layout:
    config = CONFIGS[key]
    model = meta_model(rank_layer_config(config))
    before, block, after, lm_head = parts(model)
    tied = lm_head.weight is model.get_input_embeddings().weight
    block_params = []
    for name, module in block.named_modules():
        shard = _shard(tp_style_of(config, f"layers.0.{name}")) if name else None
        for pname, p in module.named_parameters(recurse=False):
            # fused experts: the plan styles each 3-D parameter itself (packed_colwise, rowwise)
            own = _shard(tp_style_of(config, f"layers.0.{name}.{pname}")) if name else None
            # A rowwise layer's bias is added after the all-reduce, so each rank holds it whole.
            block_params.append((p.numel(), bool(own or shard == "col" or (shard == "row" and pname == "weight"))))
    sharded = sum(n for n, split in block_params if split)
    replicated = sum(n for n, split in block_params if not split)
    linears = tuple(Linear(lin.name, lin.in_features, lin.out_features, _shard(lin.tp_style))
                    for lin in block_linears(config))
    return Layout(
        embed_numel=numel(before),
        head_numel=numel(after) + numel([lm_head]),
        norm_numel=numel(after),
        block_numel_replicated=replicated,
        block_numel_sharded=sharded,
        linears=linears,
        tied=tied,
        # hfsplit.apply.tp splits the embeddings and lm_head over the vocabulary; the final norm stays whole
        embed_params=tuple((p.numel(), True) for m in before for p in m.parameters()),
        block_params=tuple(block_params),
        head_params=tuple((p.numel(), False) for m in after for p in m.parameters())
        + tuple((p.numel(), True) for p in lm_head.parameters()),
        attn_implementation=model.config._attn_implementation,
    )


def lora_targets(layout: Layout, spec: TrainingSpec, experts=()) -> list[Linear]:
    """The block's linears LoRA wraps (`experts`: names of fused expert parameters, targeted apart)."""
    if spec.lora_targets is None:
        return list(layout.linears)
    # peft matches a target name against the end of the module path
    def matches(lin: Linear, target: str) -> bool:
        return lin.name == target or lin.name.endswith("." + target)

    missing = [t for t in spec.lora_targets if t not in experts and not any(matches(lin, t) for lin in layout.linears)]
    if missing:
        raise PlanError(f"LoRA target(s) {', '.join(missing)} name no module of the model; "
                        f"linear layers here: {', '.join(sorted({lin.name.rsplit('.', 1)[-1] for lin in layout.linears}))}")
    return [lin for lin in layout.linears if any(matches(lin, t) for t in spec.lora_targets)]


def cached_layout(key: str, build):
    """The `Layout` of the config `key`, from disk or `build(key)`."""
    record = read_cache("layout", key)
    # (a layout cached before it listed its parameters or its attention: rebuilt)
    if record is not None and "block_params" in record and record.get("attn_implementation"):
        params = {k: tuple(tuple(p) for p in record[k]) for k in ("embed_params", "block_params", "head_params")}
        return Layout(**{**record, **params, "linears": tuple(Linear(**lin) for lin in record["linears"])})
    layout = build(key)
    write_cache("layout", key, asdict(layout))
    return layout
