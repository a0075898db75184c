"""Packed rows through recurrent token mixers, example by example: each example's state starts fresh.

A recurrent mixer (Qwen3.5 / Qwen3-Next's Gated DeltaNet, the Mamba2 mixers of Granite 4, Falcon-H1, Bamba,
Nemotron-H) carries a state along the sequence, and transformers' torch kernels take no example boundaries: a
packed row's second example would start from the first one's state. So in a packed micro-batch (position ids
restarting at each example, as `hfsplit.models.varlen` finds them) each such mixer runs on each example alone,
the examples of equal length of the micro-batch as one batch, and its outputs are put back in row order: what each
example gives alone, by transformers' own module. Without packed rows, or with a cache (generation), the mixer runs
as it is.

A mixer is found by what makes it recurrent, not by name: a decoder block's child holding a depthwise causal
convolution (`nn.Conv1d` with a group per channel), the front of every such mixer transformers builds. The block's
position ids, which the mixer is not given, reach it through a pre-hook on the block, so an activation
checkpointing recompute (the block called again with the same arguments) splits alike; a decoder that hands its
blocks none hands them `seq_idx` instead when a stage gives it one (`hfsplit.models.packed_masks`). Running a mixer
that needed none of this example by example only costs time: the proof (`hfsplit.load.proof.packed_rows_isolated`)
still decides whether a model packs.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from hfsplit.models.packed_masks import lengths_of_index
from hfsplit.models.varlen import example_lengths, is_packed

_EXAMPLES = "_hfsplit_examples"  # the mixer's attribute: this call's example lengths per row, or None


def run_examples_alone(block: nn.Module) -> bool:
    """Make `block`'s recurrent mixer (if it has one) run each example of a packed row alone; whether it has one."""
    mixer = recurrent_mixer(block)
    if mixer is None or hasattr(mixer, _EXAMPLES):
        return mixer is not None
    setattr(mixer, _EXAMPLES, None)
    mixer.forward = functools.partial(_forward_by_example, mixer, mixer.forward)
    block.register_forward_pre_hook(functools.partial(_note_examples, mixer), with_kwargs=True)
    return True


def recurrent_mixer(block: nn.Module) -> Optional[nn.Module]:
    """The child of `block` holding a depthwise causal convolution (a recurrent token mixer), or None."""
    for child in block.children():
        if any(_depthwise(m) for m in child.modules()):
            return child
    return None


def has_recurrent_mixer(module: nn.Module) -> bool:
    """Whether any block under `module` (a stage) holds a recurrent token mixer (a depthwise causal convolution)."""
    return any(_depthwise(m) for m in module.modules())


def _depthwise(module: nn.Module) -> bool:
    return isinstance(module, nn.Conv1d) and module.groups > 1 and module.groups == module.in_channels


def _note_examples(mixer: nn.Module, block: nn.Module, args, kwargs) -> None:
    setattr(mixer, _EXAMPLES, None if kwargs.get("cache") is not None else _packed_lengths(kwargs))


def _packed_lengths(kwargs: dict) -> Optional[list[list[int]]]:
    """Per row, its examples' lengths, from the block's position ids (or `seq_idx`, which a decoder blind to them
    passes on, `hfsplit.models.packed_masks`); None when no row is packed."""
    positions, index = kwargs.get("position_ids"), kwargs.get("seq_idx")
    if torch.is_tensor(positions) and positions.dim() == 3:  # multimodal rope's (sections, batch, seq): all alike
        positions = positions[0]
    if torch.is_tensor(positions) and positions.dim() == 2:
        return example_lengths(positions) if is_packed(positions) else None
    if torch.is_tensor(index) and index.dim() == 2 and bool((index.diff(dim=-1) != 0).any()):
        return lengths_of_index(index)
    return None


def _forward_by_example(mixer: nn.Module, forward, *args, **kwargs):
    if "hidden_states" in kwargs:
        hidden = kwargs.pop("hidden_states")
    else:
        hidden, args = args[0], args[1:]
    lengths = getattr(mixer, _EXAMPLES)
    if lengths is None or kwargs.get("cache") is not None:
        return forward(hidden, *args, **kwargs)
    kwargs.pop("seq_idx", None)  # each example runs alone (transformers' torch kernels refuse an index)
    batch, seq = hidden.shape[:2]
    spans: dict[int, list[tuple[int, int]]] = {}  # example length: (row, start) of each such example
    for row, row_lengths in enumerate(lengths):
        start = 0
        for length in row_lengths:
            spans.setdefault(length, []).append((row, start))
            start += length
    out = torch.empty_like(hidden)
    for length, where in spans.items():
        group = torch.stack([hidden[row, start:start + length] for row, start in where])
        part = forward(group, *args, **{k: _sliced(v, where, length, batch, seq) for k, v in kwargs.items()})
        for i, (row, start) in enumerate(where):
            out[row, start:start + length] = part[i]
    return out


def _sliced(value, where: list[tuple[int, int]], length: int, batch: int, seq: int):
    """A keyword argument cut to the group's examples: a per-token tensor `(batch, seq, ...)` (a padding mask) by
    example; anything else as given."""
    if torch.is_tensor(value) and value.dim() >= 2 and tuple(value.shape[:2]) == (batch, seq):
        return torch.stack([value[row, start:start + length] for row, start in where])
    return value
