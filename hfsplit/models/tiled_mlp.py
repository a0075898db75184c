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
tiled. The norm that feeds the MLP (and Gemma's that reads its output: `mlp_neighbours`) runs inside the MLP's own
slices, so its output never exists for the whole sequence either: a slice keeps a view of the residual sum, which the
block holds anyway. The module is not replaced (its parameter names, and so loading, LoRA targets and saving, stay the
model's): its `forward` is wrapped on the instance, and `module.tiled_mlp_chunks` says into how many slices.
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Iterable, Optional

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
        before, after = mlp_neighbours(block)
        _tile(mlp, chunks, before=before, after=after)
        for norm in block_norms(block):
            if norm is before or norm is after:
                _run_in_mlp(norm, chunks)
            else:
                _tile(norm, chunks)
        count += 1
    return count


def mlp_neighbours(block: nn.Module) -> tuple[Optional[nn.Module], Optional[nn.Module]]:
    """The block's norm whose output only the MLP reads, and the one that only reads the MLP's output (None where
    there is none), read from the block's forward source: `hidden_states = self.<norm>(hidden_states)` on the line
    before `hidden_states = self.mlp(hidden_states)` (Llama's `post_attention_layernorm`, Gemma 2/3's
    `pre_feedforward_layernorm`), and on the line after it (Gemma 2/3's and OLMo 2's `post_feedforward_layernorm`).
    Each line overwrites the one variable, so nothing else reads the value passed between them, and the MLP's slices
    can run them: a slice keeps a view of the residual sum (which the block holds anyway), not the norm's output of
    the whole sequence."""
    norms = {id(n) for n in block_norms(block)}
    modules = (getattr(block, name, None) if name else None for name in _neighbour_names(type(block)))
    return tuple(m if m is not None and id(m) in norms else None for m in modules)


@functools.lru_cache(maxsize=None)
def _neighbour_names(block_class: type) -> tuple[Optional[str], Optional[str]]:
    """`mlp_neighbours`' attribute names, read once a block class from its forward's source."""
    try:
        source = inspect.getsource(block_class.forward)
    except (OSError, TypeError):
        return None, None

    def named(pattern: str) -> Optional[str]:
        found = re.search(pattern, source)
        # called once, as the MLP: a norm the block calls elsewhere too must keep its own forward
        once = found is not None and all(source.count(f"self.{name}(") == 1 for name in (found.group(1), "mlp"))
        return found.group(1) if once else None

    call = r"hidden_states = self\.{}\(hidden_states\)\s*\n\s*"
    return (named(call.format(r"(\w+)") + r"hidden_states = self\.mlp\(hidden_states\)\s*\n"),
            named(call.format("mlp") + r"hidden_states = self\.(\w+)\(hidden_states\)\s*\n"))


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


def _tile(module: nn.Module, chunks: int, *, before: Optional[nn.Module] = None,
          after: Optional[nn.Module] = None) -> None:
    """`module`'s forward run in `chunks` slices, with `before`'s forward ahead of it and `after`'s behind it in each
    slice (their class's forwards: the instances' own pass their input through, `_run_in_mlp`)."""
    if getattr(module, "tiled_mlp_chunks", 0) != chunks:
        forward = _own_forward(module)
        if before is not None or after is not None:
            forward = functools.partial(_between, forward, _own_forward(before), _own_forward(after))
        module.forward = functools.partial(tiled_forward, forward, chunks=chunks)
        module.tiled_mlp_chunks = chunks


def _own_forward(module: Optional[nn.Module]):
    return type(module).forward.__get__(module) if module is not None else None


def _between(forward, before, after, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """`after(forward(before(hidden_states)))`, each of `before` and `after` skipped where None."""
    hidden_states = before(hidden_states) if before is not None else hidden_states
    hidden_states = forward(hidden_states, *args, **kwargs)
    return after(hidden_states) if after is not None else hidden_states


def _run_in_mlp(norm: nn.Module, chunks: int) -> None:
    """A norm the MLP's slices run (`mlp_neighbours`): its own call in the block passes its input through."""
    norm.forward = _passthrough
    norm.tiled_mlp_chunks = chunks
    norm.runs_in_mlp_slices = True


def _passthrough(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return hidden_states


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
