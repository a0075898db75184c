"""What QLoRA's quantized weights cost: the exact bytes of a block under bitsandbytes, the time of dequantizing its
weights each pass, and MoE experts held in 4 bits, with the split LoRA that runs on them
(`hfsplit.apply.quantized_experts`)."""
from __future__ import annotations

import math

from hfsplit.checkpoint.quantized import quantized_experts_bytes, quantized_linear_bytes
from hfsplit.models.expert_lora import expert_lora_numel, expert_parameters
from hfsplit.models.layout import meta_model, one_layer_config
from hfsplit.plan import TrainingSpec
from hfsplit.planning.costs.layout import LORA_ADAPTER_DTYPE, Layout, dtype_of, parts


def experts_4bit(config, spec: TrainingSpec) -> dict:
    """{name: (path, shape)} of the fused expert parameters a `spec` run holds in 4 bits ({} for none)."""
    return expert_parameters(config) if spec.experts_in_4bit else {}


def split_lora_activation_bytes(config, spec: TrainingSpec, *, itemsize: int) -> int:
    """Bytes one block's split LoRA on 4-bit experts keeps for backward per micro-batch: for each targeted expert
    parameter, the routed rows it reads (tokens × top-k × its input width, kept for A's gradient: the frozen 4-bit
    matmul keeps none), their rank-r projection (for B's gradient), B's contiguous copy in the compute dtype (its
    per-expert slices are strided across experts), and A's copy where the adapters' fp32 differs from it."""
    experts = experts_4bit(config, spec)
    targeted = [experts[t][1] for t in dict.fromkeys(spec.lora_targets or ()) if t in experts]
    if not targeted:
        return 0
    rows = spec.micro_batch_size * spec.seq_len * (getattr(config, "num_experts_per_tok", 0) or 0)
    transposed = _is_transposed(config)
    cast = itemsize != LORA_ADAPTER_DTYPE.itemsize
    total = 0
    for experts, d1, d2 in targeted:
        width, out = (d1, d2) if transposed else (d2, d1)
        total += rows * (width + spec.lora_r) * itemsize + experts * spec.lora_r * (out + (width if cast else 0)) * itemsize
    return total


def _is_transposed(config) -> bool:
    """Whether `config`'s fused experts hold `[E, in, out]` (gpt-oss), read from the real class on meta."""
    model = meta_model(one_layer_config(config))
    return any(getattr(sub, "is_transposed", False) for sub in parts(model)[1].modules())


def routed_lora_numel(lora_numel: int, config, spec: TrainingSpec) -> int:
    """Adapter elements a token's matmuls pass through: split LoRA on 4-bit experts runs only the routed experts'
    slices (top-k of E), peft's dense ΔW every expert's."""
    if not spec.experts_in_4bit or spec.method != "qlora":
        return lora_numel
    experts = expert_lora_numel(config, spec.lora_targets, spec.lora_r)
    count = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 1
    return lora_numel - experts + experts * (getattr(config, "num_experts_per_tok", 0) or 0) // count


def quantized_block_bytes(layout: Layout, spec: TrainingSpec, config) -> int:
    """Exact bytes of one block under bitsandbytes (tp=1): its linears' quantized weights and state, an MoE's fused
    experts' where they are 4-bit (`TrainingSpec.experts_in_4bit`, each expert quantized alone), the rest (norms,
    biases, the router) in the spec's dtype."""
    experts = [shape for _, shape in experts_4bit(config, spec).values()]
    weights = sum(lin.in_features * lin.out_features for lin in layout.linears)
    rest = layout.block_numel_replicated + layout.block_numel_sharded - weights - sum(map(math.prod, experts))
    return rest * dtype_of(spec.dtype).itemsize + sum(
        quantized_linear_bytes(lin.in_features, lin.out_features, quant_type=spec.bnb_4bit_quant_type,
                               double_quant=spec.bnb_4bit_use_double_quant, load_in_8bit=spec.load_in_8bit)
        for lin in layout.linears) + sum(
        quantized_experts_bytes(*shape, quant_type=spec.bnb_4bit_quant_type, double_quant=spec.bnb_4bit_use_double_quant)
        for shape in experts)


# Dequantizing one 4-bit value (and its double-quantized absmax share) costs as much time as this many matmul
# FLOPs on the CPU (scripts/profile_qlora.py, one thread: 2816×1024 and 14336×4096 NF4 weights dequantized at
# 6.3–7.6 ns a value against matmuls at 31–39 GFLOP/s, 196–297 FLOPs a value). Not measured on a GPU.
DEQUANTIZE_FLOPS_PER_VALUE = 250.0


def with_dequantize(workspace: int, flops: float, linears, spec, *, itemsize: int, experts=()) -> tuple[int, float]:
    """One QLoRA block's per-micro-batch (workspace bytes, FLOPs) with what dequantizing its `linears` and its 4-bit
    fused `experts` (shapes `[E, d1, d2]`) adds.

    Forward and backward each dequantize one weight at a time to the compute dtype, so the workspace is the
    largest linear weight in 16 bits (4-bit experts' dequantized matrices are in the block's trace, at the moment
    each grouped matmul holds them: `hfsplit.planning.costs.moe`). bitsandbytes dequantizes every 4-bit weight
    afresh in forward, in backward (input gradient) and, under activation checkpointing, in the recompute, for
    each micro-batch: a fixed time per micro-batch, not per token, so fewer and larger micro-batches pay it fewer
    times (what the time model's micro-batch choice weighs). 8-bit weights are not counted (not measured).
    """
    sizes = [lin.in_features * lin.out_features for lin in linears]
    workspace += max(sizes) * itemsize
    sizes += [math.prod(shape) for shape in experts]  # counted as every expert routed, as a long micro-batch does
    if spec.load_in_8bit:
        return workspace, flops
    passes = 3 if spec.activation_checkpointing else 2
    return workspace, flops + DEQUANTIZE_FLOPS_PER_VALUE * sum(sizes) * passes
