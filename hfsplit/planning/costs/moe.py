"""Grouped experts for the cost model's fake-tensor traces, saving for backward what torch's own op saves.

At run time transformers' fused experts call `torch.nn.functional.grouped_mm` (on CPU, and on CUDA from compute
capability 8.0; torch ≥ 2.10, every dtype). Its autograd saves the routed input rows only when the expert weights need a gradient: with
frozen experts (LoRA on the attention or on other linears, QLoRA) it keeps the weights and the offsets alone.
Under FakeTensorMode torch's meta kernel of `grouped_mm` takes bf16 only, so the trace runs transformers'
fallback op instead, whose autograd always saves the input: for LoRA on a MoE block that counted the gathered
rows (tokens × top-k × hidden) and the down projection's input (tokens × top-k × intermediate), which the real
run never keeps (measured/planned read 0.82-0.86 with checkpointing off). `grouped_mm_as_torch_saves` runs the
same fallback op but saves like torch's, and computes only the gradients that are needed, as torch's does.
Pre-Ampere GPUs run the fallback op itself and so keep those rows: there a frozen-expert plan is short by them.
"""
from __future__ import annotations

import torch


def _fallback(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch.ops.transformers.grouped_mm_fallback(input, weight, offs=offs)


class _GroupedMm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, offs):
        # the weights (parameters, or a view of them) and the offsets are always kept, as torch keeps them
        ctx.save_for_backward(input if ctx.needs_input_grad[1] else None, weight, offs)
        return _fallback(input, weight, offs)

    @staticmethod
    def backward(ctx, grad):
        input, weight, offs = ctx.saved_tensors
        if ctx.needs_input_grad[1]:  # full training or adapters merged into the experts: both, as before
            grad_input, grad_weight = torch.ops.transformers.grouped_mm_fallback_backward(input, weight, offs, grad)
            return (grad_input if ctx.needs_input_grad[0] else None), grad_weight, None
        return _fallback(grad, weight.transpose(-2, -1), offs), None, None


def grouped_mm_as_torch_saves(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """transformers' `integrations.moe._grouped_mm` for a trace: (S, in) rows sorted by expert @ (E, in, out)."""
    return _GroupedMm.apply(input.to(weight.dtype), weight, offs)
