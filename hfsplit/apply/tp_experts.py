"""Tensor parallelism of an MoE layer's fused experts (Mixtral, Qwen3-MoE: `moe_tp_experts` in their TP plan).

Every TP rank keeps every expert, but only its slice of each expert's intermediate dimension, as transformers'
own styles shard them: `gate_up_proj` `[E, 2I, H]` packed column-wise (the gate half and the up half each split,
so rank r holds `[gate_r; up_r]`, a `_StridedShard(dim=1, split_factor=2)` DTensor), `down_proj` `[E, H, I]` row-wise
(`Shard(2)`). The router stays whole on every rank: its logits, the routing and the router auxiliary loss are the
same everywhere. The experts' own forward runs on the local pieces and gives this rank's partial sum of each
token's routed experts (the routing weights multiply each expert's output before the sum, so the partial sums add
up to the layer's output exactly); one all-reduce of the block's output completes it. The input hidden states and
routing weights are replicated, but each rank's backward gives only its experts' share of their gradients, so
those are summed over the TP group.

torch has no ParallelStyle for this: ColwiseParallel / RowwiseParallel shard `nn.Linear` / `nn.Embedding` modules,
while the experts are one module holding 3-D parameters whose forward indexes and loops over them. So this is a
small ParallelStyle of its own built on torch's `distribute_module`, with DTensor doing each collective (the
same `to_local(grad_placements=[Partial()])` and `Partial → Replicate` redistribute the linear styles use).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from hfsplit.errors import UnsupportedModelError

# The packed parameter holds the gate and the up projection one after the other along its output dim.
PACKED_HALVES = 2


class ExpertsParallel(ParallelStyle):
    """ParallelStyle for a fused experts module (a `parallelize_module` plan value).

    Args:
        packed: the parameters packed along one dim, each of their two halves split there ({name: dim}: `[E, 2I, H]`
            `gate_up_proj` on dim 1, or Llama 4's transposed `[E, H, 2I]` on dim 2).
        split: the parameters split along their intermediate dim ({name: dim}: `down_proj` `[E, H, I]` on dim 2, or
            Llama 4's `[E, I, H]` on dim 1).
    """

    def __init__(self, *, packed: dict[str, int], split: dict[str, int]):
        super().__init__()
        self.packed = dict(packed)
        self.split = dict(split)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        placements = {**{name: packed_placement(dim) for name, dim in self.packed.items()},
                      **{name: Shard(dim) for name, dim in self.split.items()}}

        def partition(name, sub, mesh):
            if sub is module:  # only the experts' own 3-D parameters; nothing below them
                for param_name, placement in placements.items():
                    _distribute(sub, param_name, placement, mesh)

        def prepare_input(sub, inputs, mesh):
            # Mixtral's experts take (hidden, expert index, routing weights); Llama 4's the hidden states alone, each
            # token already scaled by its router score.
            hidden, *rest = inputs
            if len(rest) >= 2:
                rest[1] = _grad_summed(rest[1], mesh)
            return (_grad_summed(hidden, mesh), *rest)

        def prepare_output(sub, output, mesh):
            return _summed(output, mesh)

        distribute_module(module, device_mesh, partition, prepare_input, prepare_output)
        own_forward = module.forward

        def forward(*args, **kwargs):
            with _local_params(module, tuple(placements)):
                return own_forward(*args, **kwargs)

        module.forward = forward
        return module


def packed_placement(dim: int = 1):
    """The DTensor placement of a packed expert parameter (`[E, 2I, H]`: both halves split on dim 1)."""
    return _StridedShard(dim=dim, split_factor=PACKED_HALVES)


def _distribute(module: nn.Module, name: str, placement, mesh) -> None:
    param = module._parameters[name]
    if param is None or param.dim() != 3:
        raise UnsupportedModelError(f"{type(module).__name__}.{name}: the experts' tensor-parallel style shards 3-D "
                                    f"[experts, out, in] parameters, found "
                                    f"{None if param is None else list(param.shape)}; use tp=1")
    module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [placement], src_data_rank=None),
                                                 requires_grad=param.requires_grad))


@contextmanager
def _local_params(module: nn.Module, names: tuple[str, ...]):
    """Within: each DTensor parameter `names` of `module` replaced by its local tensor (whose gradient flows back
    into the DTensor's), so the experts' own forward (its expert loop, or transformers' grouped kernels) runs on
    this rank's pieces. Restored however the forward ends: activation checkpointing stops a recompute early by
    raising once it has what backward needs, which a forward hook would never see."""
    sharded = {name: module._parameters[name] for name in names}
    module._parameters.update({name: param.to_local() for name, param in sharded.items()})
    try:
        yield
    finally:
        module._parameters.update(sharded)


def _grad_summed(x: torch.Tensor, mesh) -> torch.Tensor:
    """`x` as it is (replicated), its gradient summed over the TP group (each rank's experts give a share)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _summed(x: torch.Tensor, mesh) -> torch.Tensor:
    """The sum of every rank's partial `x` (all-reduce); its gradient reaches each rank's part unchanged."""
    return DTensor.from_local(x, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()
