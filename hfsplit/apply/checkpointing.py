"""The activation checkpointing step: each decoder block recomputed in backward (non-reentrant), its saved input
offloaded to host memory where the plan's stage says so (`hfsplit.apply.offload`)."""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from hfsplit.apply.offload import HostBytes, StageOffload
from hfsplit.errors import UnsupportedModelError
from hfsplit.plan.steps import Step


def checkpoint_blocks(modules: Sequence[nn.Module], step: Step, inputs) -> Step:
    """The step: every block of every stage module the plan checkpoints recomputed in backward, its input in host
    memory meanwhile on the stages that offload."""
    checkpoint_stages(modules, plan=inputs.plan, device=inputs.ctx.device)
    return step


def checkpoint_stages(modules: Sequence[nn.Module], *, plan, device: torch.device) -> Optional[HostBytes]:
    """Each stage's checkpointing as the plan decided it (off, on, or on with its block inputs offloaded to host
    memory); the rank's `HostBytes` counter of offloaded bytes (None when no stage of this rank offloads), also
    kept on each offloading module as `module.activation_offload.counter`."""
    counter = None
    by_index = {s.index: s for s in plan.stages}
    for module in modules:
        mode = plan.checkpointing_of(by_index[module.stage_index])
        offload = None
        if mode == "offload":
            counter = counter or HostBytes()
            offload = StageOffload(device=device, keep_first=not module.has_embed, counter=counter)
        if mode != "off":
            apply_activation_checkpointing(module.body.layers.values(), offload=offload)
        module.activation_offload = offload
    return counter


def apply_activation_checkpointing(blocks, *, offload: Optional[StageOffload] = None) -> int:
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

    With `offload`, each block's saved input goes to host memory until its recompute (`hfsplit.apply.offload`).
    """
    count = 0
    for position, block in enumerate(blocks):
        if not isinstance(block, GradientCheckpointingLayer):
            raise UnsupportedModelError(
                f"{type(block).__name__} is not a transformers GradientCheckpointingLayer, so hfsplit cannot "
                "recompute it; plan with activation_checkpointing=False")
        block.gradient_checkpointing = True
        block._gradient_checkpointing_func = offload.checkpoint_function(position) if offload else functools.partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=False, early_stop=False)
        count += 1
    return count
