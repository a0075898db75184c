"""The autocast step: 16-bit QLoRA stage forwards under `torch.autocast`, as transformers' Trainer runs them.

peft keeps LoRA adapters in fp32 (`autocast_adapter_dtype=True`). Outside autocast its bitsandbytes layer
casts every target module's input to fp32 and lora_A saves that copy for backward: q, k and v each keep their
own fp32 copy of the same normed input, and down_proj's is intermediate-sized (Llama-3.1-70B at seq 2048: 608 MiB
of one block's 1210 MiB of saved activations, `scripts/qlora_workspace.py`). Under autocast peft skips the cast on CUDA
(`not torch.is_autocast_enabled()`); that check reads CUDA's state only, so here the adapters' input casting is
turned off by peft's own switch (`cast_input_dtype_enabled`, what `peft.helpers.disable_input_dtype_casting`
sets), and the CPU run does what the CUDA one does. The values are the same either way: autocast casts the fp32
copy straight back to the 16-bit dtype for lora_A's matmul. `torch.utils.checkpoint` replays a block's forward
under the autocast state it first ran with, so the recompute autocasts too.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import nn

from hfsplit.plan.steps import Step


def autocast_stages(modules: Sequence[nn.Module], step: Step, inputs) -> Step:
    """The step (after LoRA: it turns off the adapters' input casts): every stage's forward under autocast
    to the step's dtype."""
    autocast_forwards(modules, dtype=step.value)
    return step


def autocast_forwards(modules: Sequence[nn.Module], *, dtype: str) -> None:
    """Run each stage module's forward under `torch.autocast` to `dtype` on its own device type, its peft
    adapters taking the 16-bit inputs as they come."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # lazy: ~3 s import (inductor)

    compute = getattr(torch, dtype)
    for module in modules:
        for layer in module.modules():
            if isinstance(layer, BaseTunerLayer):
                layer.cast_input_dtype_enabled = False
        device_type = next(module.parameters()).device.type
        module.forward = _under_autocast(module.forward, device_type=device_type, dtype=compute)


def _under_autocast(forward, *, device_type: str, dtype: torch.dtype):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)
    return run
