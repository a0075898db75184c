"""Apply a Plan to this rank's stages: `plan.steps()` in order, each looked up in one table (as torchtitan's
`parallelize_llama` applies what its config names):

    tensor parallelism → activation checkpointing (block inputs offloaded where a stage says) → tiled MLPs →
    the input embedding kept in host RAM (where the first stage says) → load weights →
    quantization → LoRA → autocast (16-bit QLoRA)

TP and checkpointing act on the stage while it is still on the meta device (TP so each rank
reads only its slices); quantization needs real weights; LoRA comes after them because peft wraps
whatever linear layer it finds (a TP-sharded one, later a quantized one), and autocast after LoRA because it
turns off the adapters' input casts. Every step returns
the `Step` it applied, and the run records them (`Plan.applied`): a test compares them with `plan.steps()`,
so nothing the planner counts is left undone.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Protocol, Sequence

import torch
from torch import nn

from hfsplit.apply.autocast import autocast_stages
from hfsplit.apply.checkpointing import checkpoint_blocks
from hfsplit.apply.host_embedding import keep_embeddings_on_host
from hfsplit.apply.load import read_weights
from hfsplit.apply.lora import LoraSetup, add_adapters, check_expert_lora
from hfsplit.apply.quantize import check_quantized
from hfsplit.apply.tiled_mlp import tile_stage_mlps
from hfsplit.apply.tp import shard_stages
from hfsplit.errors import PlanError
from hfsplit.plan import Plan
from hfsplit.plan.steps import Step

# Step kind → the function applying it: `(modules, step, inputs) -> the Step applied`.
STEPS: dict[str, Callable[[Sequence[nn.Module], Step, "StepInputs"], Step]] = {
    "tp": shard_stages,
    "checkpointing": checkpoint_blocks,
    "tiled_mlp": tile_stage_mlps,
    "host_embedding": keep_embeddings_on_host,
    "load": read_weights,
    "quantize": check_quantized,
    "lora": add_adapters,
    "autocast": autocast_stages,
}


class StageContext(Protocol):
    """What the steps read of this rank's place in the launch; `hfsplit.parallel.mesh.ParallelContext` is one (typed
    here, not imported: apply sits below parallel)."""

    device: torch.device  # where this rank's stages run
    coords: "object"  # this rank's (dp, pp, tp) coordinates: `.tp` its index in the TP group

    @property
    def tp_mesh(self) -> "object":  # the 1-D DeviceMesh of this rank's TP group
        ...


@dataclass(frozen=True)
class StepInputs:
    """What the steps read beside the stage modules.

    Args:
        plan: the plan being run.
        ctx: this rank's ParallelContext (TP mesh and coordinates).
        load: reads this rank's bytes into the modules (after TP, before quantization).
        lora: the LoRA to add; None with a LoRA plan means the plan's own (`TrainingSpec`'s rank, alpha, dropout
            and targets).
        lora_seed: what the plan's own LoRA draws its A matrices from.
    """

    plan: Plan
    ctx: StageContext
    load: Callable[[Sequence[nn.Module]], None]
    lora: Optional[LoraSetup] = None
    lora_seed: int = 0


def apply_plan(modules: Sequence[nn.Module], *, plan: Plan, ctx: StageContext,
               load: Callable[[Sequence[nn.Module]], None],
               lora: Optional[LoraSetup] = None, lora_seed: int = 0) -> tuple[Step, ...]:
    """Apply `plan`'s steps to this rank's stage modules (on meta); `load` gives them their weights.

    Args:
        modules: this rank's StageModules, still on the meta device.
        plan: the plan being run.
        ctx: this rank's ParallelContext (TP mesh and coordinates).
        load: reads this rank's bytes into the modules (after TP, before quantization).
        lora: the LoRA to add; None with a LoRA plan means the plan's own.
        lora_seed: what the plan's own LoRA draws its A matrices from.

    Returns:
        The steps applied, in order (compare `plan.steps()`).
    """
    check_expert_lora(modules, lora, plan=plan)
    inputs = StepInputs(plan=plan, ctx=ctx, load=load, lora=lora, lora_seed=lora_seed)
    return tuple(STEPS[step.kind](modules, step, inputs) for step in plan.steps())


# What the single-process model (`hfsplit.from_pretrained`) leaves to its caller, as transformers' models do: the
# user adds LoRA with peft (`get_peft_model`), and peft's adapters then run as transformers' Trainer runs them.
LEFT_TO_PEFT = ("lora", "autocast")


def apply_plan_to_model(model: nn.Module, plan: Optional[Plan]) -> Optional[Plan]:
    """The single-process path (`hfsplit.from_pretrained`): whole blocks, TP = 1, read (and quantized, QLoRA) block
    by block by the loader, then transformers' own gradient checkpointing (non-reentrant) where the plan says so.
    Returns the plan with what was applied recorded: `plan.steps()` in order, less `LEFT_TO_PEFT`."""
    if plan is None:  # a hand-made device map: no decisions to apply
        return None
    if plan.spec.method != "inference" and plan.spec.checkpointing == "offload":
        raise PlanError("the single-process model does not offload activations; plan it with "
                        "activation_checkpointing=True (offload runs on split stages, under a launcher)")
    applied = tuple(step for step in plan.steps() if step.kind not in LEFT_TO_PEFT)
    if any(step.kind == "checkpointing" for step in applied):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return replace(plan, applied=applied)
