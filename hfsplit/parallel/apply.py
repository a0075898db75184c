"""Apply a Plan to this rank's stages, in one place and one order (as torchtitan's `parallelize_llama`):

    tensor parallelism → activation checkpointing → load weights → quantization → LoRA → autocast (16-bit QLoRA)

TP and checkpointing act on the stage while it is still on the meta device (TP so each rank
reads only its slices); quantization needs real weights; LoRA comes last because peft wraps
whatever linear layer it finds (a TP-sharded one, later a quantized one). Every step returns
the label `Plan.steps()` uses for it, and the run records the labels it applied
(`Plan.applied`): a test compares the two, so nothing the planner counts is left undone.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ..errors import PlanError, UnsupportedModelError
from ..plan import Plan, activation_checkpointing_label, autocast_label, lora_label, quantize_label, tp_label
from .tensor import apply_tp


@dataclass(frozen=True)
class LoraSetup:
    """The LoRA a run trains: a peft `LoraConfig` (see `hfsplit.training.lora.lora_config`) and the seed
    its A matrices are drawn from."""

    config: object
    seed: int = 0


def apply_plan(modules: Sequence[nn.Module], *, plan: Plan, ctx, load: Callable[[Sequence[nn.Module]], None],
               lora: Optional[LoraSetup] = None) -> tuple[str, ...]:
    """Apply `plan`'s decisions to this rank's stage modules (on meta); `load` gives them their weights.

    Args:
        modules: this rank's StageModules, still on the meta device.
        plan: the plan being run.
        ctx: this rank's ParallelContext (TP mesh and coordinates).
        load: reads this rank's bytes into the modules (after TP, before quantization).
        lora: the LoRA to add; None with a LoRA plan means the plan's own rank and targets.

    Returns:
        The labels of the steps applied, in order (compare `plan.steps()`).
    """
    applied = []
    if plan.tp > 1:
        for module in modules:
            apply_tp(module, tp_mesh=ctx.tp_mesh, body_name=module.body_name)
        applied.append(tp_label(plan.tp))
    if plan.spec.activation_checkpointing and plan.spec.method != "inference":
        for module in modules:
            apply_activation_checkpointing(module.body.layers.values())
        applied.append(activation_checkpointing_label())
    load(modules)
    applied += quantize(modules, plan=plan, ctx=ctx)
    if plan.spec.method in ("lora", "qlora"):
        lora = lora or default_lora(plan, modules[0].config)
        apply_lora(modules, lora, plan=plan, ctx=ctx)
        applied.append(lora_label(lora.config.r))
    if plan.spec.autocast_dtype is not None:  # after LoRA: it turns off the adapters' input casts
        from .autocast import autocast_forwards

        autocast_forwards(modules, dtype=plan.spec.autocast_dtype)
        applied.append(autocast_label(plan.spec.autocast_dtype))
    return tuple(applied)


def apply_activation_checkpointing(blocks) -> int:
    """Recompute each decoder block's activations in backward (non-reentrant `torch.utils.checkpoint`).

    Uses transformers' own per-layer switch (what `gradient_checkpointing_enable` sets), so the
    block's kwargs (rotary embeddings, masks) reach the recompute, dropout replays the same RNG
    state (`preserve_rng_state`), and a forward without gradients (KV-cache generation, eval)
    runs the block plainly with its cache. Returns the number of blocks wrapped.

    The recompute runs the whole block (`early_stop=False`, torchtitan's default since its issue 1467):
    stopping at the last saved tensor drops whatever collective the block issued after it unwaited, and
    torch's functional-collective registry keeps each such output for good. Under TP with LoRA that is
    the recomputed down_proj all-reduce, one hidden-sized tensor per block and micro-batch leaked every
    step (measured: tests/parallel/test_apply.py, LoRA tp=2, 1.13-1.17× the plan after one step, growing).
    The time model already counts the recompute's two all-reduces per block.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    count = 0
    for block in blocks:
        if not isinstance(block, GradientCheckpointingLayer):
            raise UnsupportedModelError(
                f"{type(block).__name__} is not a transformers GradientCheckpointingLayer, so hfsplit cannot "
                "recompute it; plan with activation_checkpointing=False")
        block.gradient_checkpointing = True
        block._gradient_checkpointing_func = functools.partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=False, early_stop=False)
        count += 1
    return count


def quantize(modules: Sequence[nn.Module], *, plan: Plan, ctx) -> list[str]:
    """The quantization step (QLoRA): `load` already quantized each block's linears on the device as it read
    them (so no rank ever holds its stage in 16 bits), and, where the plan says so, an MoE block's fused experts
    expert by expert; this checks every block holds what the plan says and returns the step's label."""
    if plan.spec.method != "qlora":
        return []
    from ..quantize import quantized_linear_count
    from ..quantized_experts import experts_modules, is_quantized_experts

    for module in modules:
        for name, block in module.body.layers.items():
            if quantized_linear_count(block) == 0:
                raise PlanError(f"stage {module.stage_index}: block {name} holds no quantized linear layer "
                                "after loading a QLoRA plan; load it with quantization_config")
            experts = [is_quantized_experts(sub) for _, sub in experts_modules(block)]
            if experts and (not plan.fused_experts or all(experts) != plan.spec.experts_in_4bit):
                raise PlanError(f"stage {module.stage_index}: block {name}'s fused experts are "
                                f"{'4-bit' if all(experts) else 'not all 4-bit'}, which the plan (fused_experts="
                                f"{plan.fused_experts}, quantize_experts={plan.spec.quantize_experts}) does not say; "
                                "re-plan for this checkpoint")
    return [quantize_label(plan.spec, experts=plan.fused_experts)]


def apply_lora(modules: Sequence[nn.Module], lora: LoraSetup, *, plan: Plan, ctx) -> None:
    """Inject `lora` into every stage (after TP: the adapters follow the base layers' shards)."""
    from ..training.lora import add_lora

    tp_group = ctx.tp_mesh.get_group() if plan.tp > 1 else None
    for module in modules:
        add_lora(module, lora.config, seed=lora.seed, tp_group=tp_group, tp_rank=ctx.coords.tp, tp_size=plan.tp,
                 tp_plan=getattr(module.config, "base_model_tp_plan", None))


def default_lora(plan: Plan, model_config) -> LoraSetup:
    """The plan's LoRA (its rank and targets; alpha 2r and no dropout) when the caller gives none."""
    from ..training.lora import lora_config

    spec = plan.spec
    return LoraSetup(lora_config(r=spec.lora_r, alpha=2 * spec.lora_r, dropout=0.0, targets=spec.lora_targets,
                                 model_config=model_config))


def apply_plan_to_model(model: nn.Module, plan: Optional[Plan], *, training: str) -> Optional[Plan]:
    """The single-process path (`hfsplit.from_pretrained`): whole blocks, TP = 1, the user adds LoRA with
    peft. Turns on transformers' own gradient checkpointing (non-reentrant) where a training plan says
    so; returns the plan with what was applied recorded."""
    if plan is None:  # a hand-made device map: no decisions to apply
        return None
    applied = ()
    if training != "inference" and plan.spec.activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        applied = (activation_checkpointing_label(),)
    if plan.spec.method == "qlora":  # quantized block by block as read (hfsplit.materialize.quantizer_of)
        applied = (quantize_label(plan.spec, experts=plan.fused_experts),) + applied
    return replace(plan, applied=applied)
