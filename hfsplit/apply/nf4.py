"""bitsandbytes 4-bit quantization of one tensor, as bitsandbytes' own `quantize_4bit` does it, in bounded memory.

Shared by the quantized linears (`hfsplit.apply.quantize`) and the quantized fused experts
(`hfsplit.apply.quantized_experts`); the block sizes are the checkpoint format's (`hfsplit.checkpoint.quantized`),
which the cost model counts too.
"""
from __future__ import annotations

import math

import torch

from hfsplit.checkpoint.quantized import BLOCKSIZE, NESTED_BLOCKSIZE

CHUNK_VALUES = 1 << 18  # a multiple of the block size: chunks quantize exactly as the whole weight does


def quantize_4bit_state(weight: torch.Tensor, qconfig) -> tuple[torch.Tensor, object]:
    """(packed uint8 bytes, flat; bitsandbytes `QuantState`) of `weight` in `qconfig`'s 4-bit type, as
    `bitsandbytes.functional.quantize_4bit` gives them, bit for bit. On the CPU it is done CHUNK_VALUES values at a
    time: bitsandbytes' CPU quantizer (`backends/default/ops.py`) makes ~4 fp32 copies of what it quantizes
    (float, abs, scaled, bucket ids), which for a whole 16-bit weight is a transient of ~8× its bytes. Blocks of
    64 values are quantized independently, so chunks on block boundaries concatenate to the same result; double
    quantization then quantizes the whole absmax vector as bitsandbytes does."""
    import bitsandbytes.functional as F  # lazy: importing bitsandbytes compiles kernels with torch._inductor (~3 s)

    if weight.device.type != "cpu":  # the GPU kernels quantize in place: no fp32 copies to bound
        packed, state = F.quantize_4bit(weight, blocksize=BLOCKSIZE, compress_statistics=qconfig.bnb_4bit_use_double_quant,
                                        quant_type=qconfig.bnb_4bit_quant_type, quant_storage=torch.uint8)
        return packed.view(-1), state
    flat = weight.reshape(-1)
    # The results are allocated first and filled chunk by chunk: gathering the chunks' own tensors would leave
    # their freed bytes in the heap between what is kept.
    packed = torch.empty(math.ceil(flat.numel() / 2), dtype=torch.uint8, device=weight.device)
    absmax = torch.empty(math.ceil(flat.numel() / BLOCKSIZE), dtype=torch.float32, device=weight.device)
    for first in range(0, flat.numel(), CHUNK_VALUES):
        part, state = F.quantize_4bit(flat[first:first + CHUNK_VALUES], blocksize=BLOCKSIZE, compress_statistics=False,
                                      quant_type=qconfig.bnb_4bit_quant_type, quant_storage=torch.uint8)
        packed[first // 2:first // 2 + part.numel()] = part.view(-1)
        absmax[first // BLOCKSIZE:first // BLOCKSIZE + state.absmax.numel()] = state.absmax
        del part, state
    code = F.get_4bit_type(qconfig.bnb_4bit_quant_type, device=weight.device)
    nested = {}
    if qconfig.bnb_4bit_use_double_quant:
        offset = absmax.mean()
        absmax, state2 = F.quantize_blockwise(absmax - offset, blocksize=NESTED_BLOCKSIZE)
        nested = dict(offset=offset, state2=state2)
    return packed, F.QuantState(absmax=absmax, shape=weight.shape, dtype=weight.dtype, blocksize=BLOCKSIZE, code=code,
                                quant_type=qconfig.bnb_4bit_quant_type, **nested)
