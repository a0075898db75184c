"""The activation checkpointing step: each decoder block recomputed in backward (non-reentrant)."""
from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from hfsplit.errors import UnsupportedModelError
from hfsplit.plan import Step


def checkpoint_blocks(modules: Sequence[nn.Module], step: Step, inputs) -> Step:
    """The step: every block of every stage module recomputed in backward."""
    for module in modules:
        apply_activation_checkpointing(module.body.layers.values())
    return step


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
