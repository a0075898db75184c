"""The LoRA step: adapters on stage modules (after tensor parallelism), with initial values that do
not depend on how the model is split.

peft builds the adapters (`inject_adapter_in_model`) on the rank's local pieces of the
sharded layers, so their shapes follow the base layer's sharding:
- colwise layer (q/k/v, gate/up): A is whole (replicated), B holds this rank's output rows;
- rowwise layer (o, down): A holds this rank's input columns, B is whole.
Small autograd functions make the adapter branch exact under TP (as Megatron's
copy-to / reduce-from tensor-parallel region): after a colwise A the gradient is summed
over the TP group; after a rowwise A the partial activations are summed in forward. Where the
base layer gathers its output (`colwise_gather_output`) B's output is gathered too; where it
takes its input whole and slices it (`rowwise_split_input`) A's input is sliced too.

A matrices are drawn from a generator keyed by (seed, checkpoint name) at full size and
sliced, so the unsplit model and every split start from the same adapters.
"""
from __future__ import annotations

import copy
import dataclasses
import fnmatch
import math
import re
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hfsplit.apply.quantized_experts_lora import register_quantized_experts_lora
from hfsplit.apply.tp import GradSummedOverTP, mark_tp_sharded, rope_grad_summed, tp_shard_dim
from hfsplit.errors import HfsplitError, PlanError
from hfsplit.models.expert_lora import default_lora_targets, expert_lora_tp_refusal, split_lora_targets
from hfsplit.models.families import COLWISE_GATHERED, MLA_KV_A, ROWWISE_OWN_OUTPUT, ROWWISE_WHOLE_INPUT, tp_plan_of
from hfsplit.plan import Plan
from hfsplit.plan.steps import Step, lora_step

_LAYER_NAME = re.compile(r"(model\.layers\.\d+\..*)$")
_IN_PLAN = re.compile(r"layers\.\d+\.(.*)$")


def lora_config(*, r: int, alpha: int, dropout: float, targets: Optional[Sequence[str]], model_config):
    """The peft LoraConfig hfsplit trains with (the same for split and unsplit models); without
    `targets`, every linear projection of a decoder block of `model_config`'s model. A target naming an MoE's
    fused expert parameter ("gate_up_proj", "down_proj") adapts the experts (`hfsplit.models.expert_lora`); on 4-bit
    experts through `hfsplit.apply.quantized_experts_lora` (peft's adapters, applied split)."""
    from peft import LoraConfig  # lazy: importing peft imports bitsandbytes and torch._inductor (~3 s)

    # names of fused MoE expert parameters (gate_up_proj, down_proj) go to peft as target parameters
    modules, parameters = split_lora_targets(list(targets or default_lora_targets(model_config)), model_config)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=modules,
                        target_parameters=parameters or None, bias="none", task_type="CAUSAL_LM")
    register_quantized_experts_lora(config)
    return config


@dataclass(frozen=True)
class LoraSetup:
    """The LoRA a run trains: a peft `LoraConfig` (see `lora_config`) and the seed
    its A matrices are drawn from."""

    config: object
    seed: int = 0


def add_adapters(modules: Sequence[nn.Module], step: Step, inputs) -> Step:
    """The step: the call's LoRA (`inputs.lora`, else the plan's own) in every stage; the step as applied
    (its rank is that of the LoRA given)."""
    lora = inputs.lora or default_lora(inputs.plan, modules[0].config, seed=inputs.lora_seed)
    apply_lora(modules, lora, plan=inputs.plan, ctx=inputs.ctx)
    return lora_step(lora.config.r)


def apply_lora(modules: Sequence[nn.Module], lora: LoraSetup, *, plan: Plan, ctx) -> None:
    """Inject `lora` into every stage (after TP: the adapters follow the base layers' shards)."""
    tp_group = ctx.tp_mesh.get_group() if plan.tp > 1 else None
    for module in modules:
        add_lora(module, lora.config, seed=lora.seed, tp_group=tp_group, tp_rank=ctx.coords.tp, tp_size=plan.tp,
                 tp_plan=tp_plan_of(module.config))


def lora_config_of(spec, model_config):
    """The peft LoraConfig a LoRA `TrainingSpec` describes (its rank, alpha, dropout and targets): the one builder
    the run's adapters and its saved adapter config share."""
    return lora_config(r=spec.lora_r, alpha=spec.alpha, dropout=spec.lora_dropout, targets=spec.lora_targets,
                       model_config=model_config)


def default_lora(plan: Plan, model_config, *, seed: int = 0) -> LoraSetup:
    """The plan's own LoRA (`lora_config_of` its spec), its A matrices drawn from `seed`, when the caller gives none."""
    return LoraSetup(lora_config_of(plan.spec, model_config), seed=seed)


class _SumOverTP(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward (the downstream gradient is already whole)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _whole_model(module: nn.Module) -> bool:
    """Whether `module` is a whole model (every layer kind in it), not a stage."""
    return not hasattr(module, "stage_index")


def add_lora(module: nn.Module, config, *, seed: int, tp_group=None, tp_rank: int = 0, tp_size: int = 1,
             tp_plan: Optional[dict] = None) -> nn.Module:
    """Inject LoRA adapters into `module`, freeze everything else, seed the adapters.

    Args:
        module: a stage module (TP already applied) or a whole unsplit model.
        config: from `lora_config`.
        seed: keys the A matrices' values.
        tp_group, tp_rank, tp_size, tp_plan: the TP group and the model's `base_model_tp_plan` when sharded.

    Raises:
        HfsplitError: a target names no module of the model.
    """
    from peft import inject_adapter_in_model  # lazy: importing peft imports bitsandbytes and torch._inductor (~3 s)

    config = module_lora_config(module, config)
    for p in module.parameters():
        p.requires_grad_(False)
    inject_adapter_in_model(config, module)
    # 16-bit adapters (and their AdamW state) in fp32, as peft's get_peft_model keeps them
    # (autocast_adapter_dtype=True) and the cost model counts them; inject_adapter_in_model leaves the base's dtype.
    from peft.tuners.tuners_utils import cast_adapter_dtype  # lazy: ~3 s import (inductor)

    cast_adapter_dtype(module, "default")
    for name, sub in lora_layers(module):
        style = _tp_style(name, tp_plan) if tp_size > 1 else None
        shard_adapter(sub.lora_A["default"], sub.lora_B["default"], style=style, tp_group=tp_group,
                      rope_dim=getattr(module.config, "qk_rope_head_dim", 0) if style == MLA_KV_A else 0)
    seed_lora_weights(module, seed=seed, tp_rank=tp_rank, tp_size=tp_size)
    return module


def module_lora_config(module: nn.Module, config):
    """`config` (a LoraConfig) as `module` takes it: a stage holding some layer kinds only (Qwen3-Next's full
    attention) keeps the module targets it has.

    Raises:
        HfsplitError: a target names no module of the model.
    """
    names = {n.rsplit(".", 1)[-1] for n, _ in module.named_modules()}
    missing = sorted(set(config.target_modules) - names)
    if missing and not set(config.target_modules) & names or missing and _whole_model(module):
        raise HfsplitError(f"LoRA target(s) {', '.join(missing)} name no module of the model; "
                           f"linear layers here: {', '.join(sorted(n for n in names if n.endswith('proj')))}")
    return dataclasses.replace(config, target_modules=sorted(set(config.target_modules) & names)) if missing else config


def check_expert_lora(modules: Sequence[nn.Module], lora: Optional[LoraSetup], *, plan: Plan) -> None:
    """Refuse LoRA on fused expert parameters under tp > 1 before any weight is read (`PlanError`, one line naming
    the targets and the fix): peft adapts a 3-D expert parameter whole, while TP holds a slice of it. `modules` are
    this rank's stages on the meta device, each probed on a copy with peft's own injection, so the expert parameters
    peft's MoE target conversion adapts for module names (Qwen3-Next's shared-expert `gate_proj` and `up_proj`) are
    refused too; `lora`: the run's, else the plan's own."""
    if plan.tp <= 1 or not any(step.kind == "lora" for step in plan.steps()):
        return
    from peft import inject_adapter_in_model  # lazy: importing peft imports bitsandbytes and torch._inductor (~3 s)

    config = (lora or default_lora(plan, modules[0].config)).config
    for module in modules:
        probe, copied = copy.deepcopy(module_lora_config(module, config)), copy.deepcopy(module)
        inject_adapter_in_model(probe, copied)  # converts `probe` in place, as peft converts the run's config
        adapted = sorted({_IN_PLAN.search(f"{name.replace('.base_layer', '')}.{sub.parameter_name}").group(1)
                          for name, sub in copied.named_modules() if getattr(sub, "parameter_name", None)})
        if adapted:
            mapped = sorted(set(config.target_modules) - set(probe.target_modules))
            named = [p.rsplit(".", 1)[-1] for p in config.target_parameters or ()]
            raise PlanError(expert_lora_tp_refusal(named + mapped, adapted, tp=plan.tp, mapped=bool(mapped),
                                                   default=lora is None and plan.spec.lora_targets is None))


def shard_adapter(a: nn.Linear, b: nn.Linear, *, style: Optional[str], tp_group, rope_dim: int = 0) -> None:
    """Make one layer's adapter (A, then B; peft shaped them as the base layer's local piece) compute what the
    unsharded adapter does, under base layer style `style` (None: not sharded, nothing to do). `rope_dim`: MLA's
    key rope width, for an adapter of the whole `mla_kv_a_proj` (its output's rope part goes to this rank's heads
    only, as the base layer's does: that part's gradient is summed over the TP group)."""
    if style == MLA_KV_A:
        b.register_forward_hook(lambda _m, _i, out, g=tp_group: rope_grad_summed(out, rope_dim, g))
    elif style in ("colwise", COLWISE_GATHERED):  # B holds this rank's output rows, A is whole
        mark_tp_sharded(b.weight, dim=0)
        a.register_forward_hook(lambda _m, _i, out, g=tp_group: GradSummedOverTP.apply(out, g))
        if style == COLWISE_GATHERED:  # the base layer's output is gathered whole: B's too
            b.register_forward_hook(lambda _m, _i, out, g=tp_group: _GatherOverTP.apply(out, g))
    elif style in ("rowwise", ROWWISE_WHOLE_INPUT, ROWWISE_OWN_OUTPUT):  # A holds this rank's input columns, B is whole
        mark_tp_sharded(a.weight, dim=1)
        if style == ROWWISE_WHOLE_INPUT:  # the input arrives whole: A reads its own columns of it
            a.register_forward_pre_hook(lambda _m, args, g=tp_group: (_SliceOverTP.apply(args[0], g), *args[1:]))
        a.register_forward_hook(lambda _m, _i, out, g=tp_group: _SumOverTP.apply(out, g))


class _GatherOverTP(torch.autograd.Function):
    """Forward: this rank's piece of the last dim joined with the other ranks' (all-gather); backward: the gradient
    of this rank's piece (the gathered output's gradient is whole on every rank)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _joined_over_tp(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist.get_world_size(ctx.group), dim=-1)[dist.get_rank(ctx.group)], None


class _SliceOverTP(torch.autograd.Function):
    """Forward: this rank's piece of the last dim of a tensor whole on every rank; backward: the pieces' gradients
    joined (all-gather), so the whole input's gradient is whole on every rank."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.chunk(dist.get_world_size(group), dim=-1)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _joined_over_tp(grad, ctx.group), None


def _joined_over_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `x` joined along the last dim, in rank order."""
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


def seed_lora_weights(module: nn.Module, *, seed: int, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Draw every LoRA A from a generator keyed by (seed, checkpoint name); B starts at zero, as in peft."""
    for name, sub in lora_layers(module):
        match = _LAYER_NAME.search(name)
        key = match.group(1) if match else name
        a = sub.lora_A["default"].weight
        dim = tp_shard_dim(a)
        shape = list(a.shape)
        if dim is not None:
            shape[dim] *= tp_size
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        bound = 1 / math.sqrt(shape[1])  # kaiming-uniform(a=√5), peft's default for A
        full = (torch.rand(shape, generator=generator, dtype=torch.float32) * 2 - 1) * bound
        if dim is not None:
            full = full.chunk(tp_size, dim=dim)[tp_rank]
        with torch.no_grad():
            a.copy_(full.to(device=a.device, dtype=a.dtype))
            sub.lora_B["default"].weight.zero_()


def lora_layers(module: nn.Module):
    """(name, layer) of every peft LoRA layer in `module` (the adapter named "default")."""
    for name, sub in module.named_modules():
        if hasattr(sub, "lora_A") and "default" in getattr(sub, "lora_A", {}):
            yield name, sub


def _tp_style(name: str, tp_plan: Optional[dict]) -> Optional[str]:
    match = _IN_PLAN.search(name)
    if not match or not tp_plan:
        return None
    for pattern, style in tp_plan.items():
        if fnmatch.fnmatchcase(f"layers.*.{match.group(1)}", pattern) or \
                fnmatch.fnmatchcase(f"layers.0.{match.group(1)}", pattern):
            return style
    return None
