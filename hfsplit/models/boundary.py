"""What crosses a pipeline stage boundary, per token: the width of the one tensor a stage sends its neighbour.

The split (`hfsplit.parallel.followed_stage.packed_boundary`) sends it and sizes its receive buffers by it, and the
planner counts its send, receive and kept buffers and its link time by it: one definition, here, where both may
import it (models ← planning, models ← parallel).
"""
from __future__ import annotations

import inspect

import torch


def boundary_width(config) -> int:
    """The last dimension of what a stage sends on: the hidden state, times the hidden streams the model's loop
    keeps (Gemma 3n's AltUp `altup_num_inputs`), plus the per-layer inputs carried to later stages (Gemma 3n's and
    Gemma 4's `hidden_size_per_layer_input` per block); `hidden_size` for every other model."""
    streams = hidden_streams(config)
    per_layer = getattr(config, "hidden_size_per_layer_input", None) or 0
    return streams * text_hidden_size(config) + config.num_hidden_layers * per_layer


def text_hidden_size(config) -> int:
    """The hidden size of the config's language model (a multimodal config keeps it in its text config)."""
    return config.hidden_size if hasattr(config, "hidden_size") else config.get_text_config().hidden_size


def hidden_streams(config) -> int:
    """How many hidden states the model's loop carries from block to block: Gemma 3n's AltUp streams
    (`altup_num_inputs`), DeepSeek-V4's and HY-V4's hyper-connection streams (`hc_mult`), else 1."""
    return getattr(config, "altup_num_inputs", None) or getattr(config, "hc_mult", None) or 1


def streams_first(config) -> bool:
    """Whether the loop stacks its hidden streams on a first dimension (Gemma 3n's AltUp) rather than beside each
    token's hidden state (hyper-connections: `(batch, seq, streams, hidden)`)."""
    return bool(getattr(config, "altup_num_inputs", None))


def hidden_shape(config, batch: int, seq: int) -> tuple[int, ...]:
    """The shape of the hidden state the model's loop hands each block (`hidden_streams`, where `streams_first`)."""
    streams, size = hidden_streams(config), text_hidden_size(config)
    if streams == 1:
        return batch, seq, size
    return (streams, batch, seq, size) if streams_first(config) else (batch, seq, streams, size)


class _Captured(Exception):
    pass


def block_inputs(base: torch.nn.Module, block: torch.nn.Module, input_ids: torch.Tensor, **forward_kwargs) -> dict:
    """The keyword arguments `base`'s own forward hands `block` for `input_ids` (rotary tables, masks, Gemma 3n's and
    Gemma 4's per-layer input, Falcon-H1's Mamba mask: whatever the model computes outside its blocks), the hidden
    state and any cache left out; the forward stops there. The planner's trace and the speed probe run a lone
    block on them."""
    captured = {}

    def capture(module, args, kwargs):
        # by name, what the decoder passes by position too (Gemma 3n's and Gemma 4's per-layer input)
        signature = inspect.signature(module.forward)
        bound = signature.bind_partial(*args, **kwargs).arguments
        bound.pop(next(iter(signature.parameters)), None)  # the hidden state, whatever the block names it
        for name, param in signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                bound.update(bound.pop(name, {}))
            elif param.kind is inspect.Parameter.VAR_POSITIONAL:
                bound.pop(name, None)
        captured.update(bound)
        raise _Captured

    handle = block.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            base(input_ids=input_ids, use_cache=False, **forward_kwargs)
    except _Captured:
        pass
    finally:
        handle.remove()
    for name in ("hidden_states", "past_key_values", "past_key_value"):
        captured.pop(name, None)
    return captured
