"""The tiled-MLP step: each block's MLP and its own norms on the stages the plan tiles run the sequence a slice at a
time, forward and recompute-backward (`hfsplit.models.tiled_mlp`), so the MLP's intermediates and the norms' fp32
copies never exist for the whole sequence."""
from __future__ import annotations

from typing import Sequence

from torch import nn

from hfsplit.models.tiled_mlp import tile_mlps
from hfsplit.plan.steps import Step


def tile_stage_mlps(modules: Sequence[nn.Module], step: Step, inputs) -> Step:
    """The step: on each stage module whose plan stage tiles its MLP, every block's MLP run in that many slices."""
    by_index = {s.index: s for s in inputs.plan.stages}
    for module in modules:
        chunks = inputs.plan.tiled_mlp_of(by_index[module.stage_index])
        if chunks > 1:
            tile_mlps(module.body.layers.values(), chunks=chunks)
    return step
