"""The host-embedding step: the first stage's input embedding table stays in host RAM (`Stage.host_embedding`).

Under LoRA and QLoRA the table is frozen (bitsandbytes never quantizes it: Llama-3.1-70B's 128256 × 8192 in bf16 is
1.96 GiB of a 24 GiB card), and a lookup is a gather: on the CPU it reads only the rows of the micro-batch's tokens.
So the table is read into host RAM (the loader reads a module marked `hfsplit_device` there), the lookup runs on
the host, and only its rows (one hidden state) are copied to the stage's device, where the first block takes them.
Nothing flows back: the table has no gradient. The module keeps its name and class (its forward is wrapped on the
instance, as the tiled MLP's), so loading, LoRA targets and saving see the model's own names.

On a CPU rank host and device are one: the lookup is made while `host_allocation()` (what a live-tensor counter of
the device's memory leaves out) and copied, so a CPU rank holds on its "device" what a GPU would.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from hfsplit.apply.offload import host_allocation
from hfsplit.plan.steps import Step


def keep_embeddings_on_host(modules: Sequence[nn.Module], step: Step, inputs) -> Step:
    """The step (before load): the stage whose plan stage keeps its embedding on the host gets its table read into
    `inputs.ctx.host` and its lookup run there, the rows handed to `inputs.ctx.device`."""
    by_index = {s.index: s for s in inputs.plan.stages}
    for module in modules:
        if by_index[module.stage_index].host_embedding:
            look_up_on_host(module.body.embed_tokens, host=inputs.ctx.host, device=inputs.ctx.device)
    return step


def look_up_on_host(embedding: nn.Module, *, host: torch.device, device: torch.device) -> None:
    """Run `embedding` (on meta until loaded) on `host`, its output copied to `device`."""
    embedding.hfsplit_device = host  # where the loader reads its weight (`hfsplit.apply.load.device_for`)
    lookup = embedding.forward

    def forward(ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        with host_allocation():
            rows = lookup(ids.to(host), *args, **kwargs)
        return rows.to(device, copy=True)

    embedding.forward = forward
