"""LoRA on an MoE's fused experts, as peft does it (`LoraConfig(target_parameters=...)`).

transformers 5 keeps a layer's experts as 3-D parameters (`mlp.experts.gate_up_proj [E, 2I, H]`,
`mlp.experts.down_proj [E, H, I]`), not nn.Linear modules, so `target_modules` cannot name them. peft wraps such a
parameter in a `ParamWrapper` whose adapters span the experts: A is `[r·E, in]`, B `[out, r·E]`, and each expert's
delta is its slice of B @ A. hfsplit takes these names in `--lora-targets` beside module names ("q_proj,...,
gate_up_proj,down_proj") and hands them to peft as target parameters; the cost model counts the same adapters.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

from hfsplit.errors import HfsplitError
from hfsplit.models.layer_kinds import SPARSE, kind_config, layer_kinds
from hfsplit.models.layout import (block_linear_names, block_linears, decoder_layout, holds_experts, meta_model,
                                   one_layer_config)


def expert_parameters(config) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{leaf name: (path within a block, shape)} of the 3-D expert parameters of `config`'s blocks ({} if dense)."""
    if not getattr(config, "num_experts_per_tok", None):  # not an MoE: no model to build
        return {}
    key = config.to_json_string(use_diff=False)
    _CONFIGS.setdefault(key, config)
    return dict(_expert_parameters(key))


_CONFIGS: dict[str, object] = {}  # lru_cache keys must be hashable; configs are not


@functools.lru_cache(maxsize=32)
def _expert_parameters(key: str) -> tuple:
    config = _CONFIGS[key]
    cfg = one_layer_config(kind_config(config, SPARSE) if layer_kinds(config) else config)
    model = meta_model(cfg)
    block = model.get_submodule(decoder_layout(model).layers)[0]
    return tuple((leaf, (f"{owner}.{leaf}", tuple(p.shape))) for owner, m in block.named_modules() if holds_experts(m)
                 for leaf, p in m.named_parameters(recurse=False) if p.dim() == 3)


# Modules peft refuses to adapt in Mamba-based model types (its `_check_lora_target_modules_mamba`, a rule it keeps
# inside a function): the mixer's `out_proj` and `conv1d`
PEFT_REFUSED_TARGETS = dict.fromkeys(("falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"), ("out_proj", "conv1d"))


def default_lora_targets(config) -> list[str]:
    """LoRA's default targets: the blocks' linear layers (`block_linear_names`) but those named like a fused expert
    parameter (Qwen3-Next's shared expert `down_proj` beside the experts' `down_proj`), which peft's MoE target
    conversion would also apply to the experts, and those peft refuses in the model type (Falcon-H1's Mamba
    `out_proj`)."""
    experts = expert_parameters(config)
    refused = PEFT_REFUSED_TARGETS.get(config.model_type, ())
    return [name for name in block_linear_names(config) if name not in experts and name not in refused]


def split_lora_targets(targets: Sequence[str], config) -> tuple[list[str], list[str]]:
    """(module targets, peft target parameters) of `targets`: a name of a fused expert parameter becomes a target
    parameter (its path within the block); any other name stays a module target.

    Raises:
        HfsplitError: a name that is both a block's linear and an expert parameter (Qwen3-MoE's dense
            `down_proj` beside the experts' `down_proj` under `mlp_only_layers`): peft's MoE target conversion
            would adapt the experts under both names.
    """
    experts = expert_parameters(config)
    if not experts:
        return list(targets), []
    kinds = layer_kinds(config)
    linear_names = {lin.name.rsplit(".", 1)[-1] for c in ([kind_config(config, k) for k in set(kinds)] if kinds
                                                          else [config]) for lin in block_linears(c)}
    both = sorted(t for t in targets if t in experts and t in linear_names)
    if both:
        raise HfsplitError(f"LoRA target(s) {', '.join(both)} name both a dense layer's linear and the fused experts' "
                           "parameter; name the attention and expert targets only, or train the model fully")
    return [t for t in targets if t not in experts], [experts[t][0] for t in targets if t in experts]


def expert_lora_tp_error(config, targets: Optional[Sequence[str]], tp: int) -> Optional[str]:
    """Why LoRA on `targets` cannot train at tensor-parallel degree `tp` (None when it can): a target naming a fused
    expert parameter. From the names alone, without peft (the planner imports none of it); the run also refuses the
    expert parameters peft's MoE target conversion adapts for module names (`hfsplit.apply.lora.check_expert_lora`)."""
    if tp <= 1 or not targets:  # the default targets name no expert parameter (`default_lora_targets`)
        return None
    experts = expert_parameters(config)
    named = [t for t in dict.fromkeys(targets) if t in experts]
    return expert_lora_tp_refusal(named, [experts[t][0] for t in named], tp=tp) if named else None


def expert_lora_tp_refusal(targets: Sequence[str], parameters: Sequence[str], *, tp: int, mapped: bool = False,
                           default: bool = False) -> str:
    """The one line refusing LoRA `targets` that adapt fused expert `parameters` at tensor-parallel degree `tp`
    (`mapped`: peft maps these module names onto the experts; `default`: LoRA's default targets, none given)."""
    names = ",".join(targets)
    how = " (peft's MoE target conversion maps these names onto them)" if mapped else ""
    what = f"LoRA's default targets include {names}" if default else f"--lora-targets {names}"
    fix = f"pass --lora-targets without {names}" if default else f"leave {names} out of --lora-targets"
    return (f"{what} at tp={tp}: LoRA on the fused experts' parameters {', '.join(parameters)}{how} trains at tp=1 "
            f"only (peft adapts a 3-D expert parameter whole, tensor parallelism holds a slice of it); use --tp 1 "
            f"(pipeline stages split the model), or {fix}")


def expert_lora_numel(config, targets: Optional[Sequence[str]], r: int) -> int:
    """Adapter elements of one block's targeted expert parameters: r·E·(in + out) each (0 without such targets)."""
    experts = expert_parameters(config)
    shapes = [experts[t][1] for t in dict.fromkeys(targets or ()) if t in experts]
    return sum(r * e * (out + inp) for e, out, inp in shapes)
