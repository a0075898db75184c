"""The tiled MLP: a decoder block's MLP runs the sequence a slice at a time, forward and backward.

A dense block's MLP makes the biggest tensors of a long sequence: Llama-3.1-70B at seq 16384 holds its gate and up
projections, their activation and their product, 896 MiB each, while the block's input is 256 MiB. Unsloth's tiled
MLP (and DeepSpeed's `TiledMLP`) run it over slices of the sequence. hfsplit does it with torch's own pieces: each
slice of the MLP's input goes through the MLP under non-reentrant `torch.utils.checkpoint`, so a slice keeps only its
input for backward (a view of the MLP's input, nothing new) and its intermediates exist one slice at a time, in
forward and in the recompute of backward. Gradients flow by plain autograd (peft's adapters, bitsandbytes' 4-bit
weights and DTensor shards alike), and the slices' outputs are concatenated: the values are the MLP's own, token
by token (an MLP is per token), so losses and gradients are those of the untiled run to float rounding.

Inside a checkpointed block (`hfsplit.apply.checkpointing`; the plan's step: `hfsplit.apply.tiled_mlp`) the slices' checkpoints nest in the block's: the block's
recompute runs the MLP slice by slice without keeping anything, and each slice recomputes once more in its own
backward. That is the time the plan charges (`hfsplit.planning.costs.model`): one more forward of the MLP a micro-batch.

The block's own norms run the same way (`block_norms`): per token too, and in eager transformers each keeps an fp32 copy
of the whole sequence and makes more in its backward, the largest rest of a long block's recompute once its MLP is
tiled. The module is not replaced (its parameter names, and so loading, LoRA targets and saving, stay the model's): its
`forward` is wrapped on the instance, and `module.tiled_mlp_chunks` says into how many slices.
"""
from __future__ import annotations

import functools
from typing import Iterable

import torch
from torch import nn

from hfsplit.errors import UnsupportedModelError


def tile_mlps(blocks: Iterable[nn.Module], *, chunks: int) -> int:
    """Wrap the `mlp` of each block, and the block's own norms (`block_norms`), so that each runs its input in `chunks`
    slices of the sequence; the count of blocks wrapped.

    Raises:
        UnsupportedModelError: a block has no `mlp`, or its MLP routes tokens to experts (their load-balancing
            statistics would differ slice by slice).
    """
    count = 0
    for block in blocks:
        mlp = getattr(block, "mlp", None)
        if not isinstance(mlp, nn.Module) or hasattr(mlp, "experts"):
            raise UnsupportedModelError(f"{type(block).__name__} has no dense `mlp` to tile; plan with tiled_mlp off")
        for module in (mlp, *block_norms(block)):
            _tile(module, chunks)
        count += 1
    return count


def block_norms(block: nn.Module) -> list[nn.Module]:
    """The block's own norms (its direct children: `input_layernorm`, `post_attention_layernorm`, Gemma's pre- and
    post-feedforward ones), which run on the block's `[batch, seq, hidden]` states. Each normalises over the last
    dimension only, token by token, so a slice of the sequence gives the same values; in eager transformers each
    upcasts to fp32 and keeps that copy for backward, whose formula makes several more fp32 tensors of the whole
    sequence (Llama-3.1-70B at seq 16384: 512 MiB kept and 2.5 GiB at the peak of the post-attention norm's
    backward, measured by the planner's trace)."""
    return [child for child in block.children() if _is_norm(child)]


def _is_norm(module: nn.Module) -> bool:
    """A norm over the last dimension alone: a weight of at most one dimension (a LayerNorm over two would not be
    per token). Gated norms (Mamba's, with a second input) live inside their mixers, never a block's children."""
    named = isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))
    weight = getattr(module, "weight", None)
    return named and (not isinstance(weight, torch.Tensor) or weight.dim() <= 1)


def _tile(module: nn.Module, chunks: int) -> None:
    if getattr(module, "tiled_mlp_chunks", 0) != chunks:
        module.forward = functools.partial(tiled_forward, type(module).forward.__get__(module), chunks=chunks)
        module.tiled_mlp_chunks = chunks


def tiled_forward(forward, hidden_states: torch.Tensor, *args, chunks: int, **kwargs) -> torch.Tensor:
    """`forward(hidden_states)` computed over `chunks` slices of the sequence (dim -2), each checkpointed. Without
    gradients (generation, evaluation, the outer checkpoint's first pass under no_grad) the slices run plainly."""
    # split (one backward node that concatenates the slices' gradients), not tensor_split (a slice each, whose
    # backward makes a whole-sequence gradient per slice)
    pieces = hidden_states.split(chunk_sizes(hidden_states.shape[-2], chunks), dim=-2)
    if not torch.is_grad_enabled():
        return torch.cat([forward(piece, *args, **kwargs) for piece in pieces], dim=-2)
    run = functools.partial(forward, *(), **kwargs) if not args else functools.partial(_with_args, forward, args, kwargs)
    # early_stop=False: a TP all-reduce in the slice is always waited (as apply.checkpointing's blocks)
    return torch.cat([torch.utils.checkpoint.checkpoint(run, piece, use_reentrant=False, early_stop=False)
                      for piece in pieces], dim=-2)


def chunk_sizes(length: int, chunks: int) -> list[int]:
    """`length` tokens cut into `chunks` slices (at most one a token) whose sizes differ by at most one."""
    count = max(1, min(chunks, length))
    return [length // count + (1 if i < length % count else 0) for i in range(count)]


def _with_args(forward, args, kwargs, piece):
    return forward(piece, *args, **kwargs)
