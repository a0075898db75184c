"""Bytes of the optimizer's state per trainable tensor, for the plan: torch's AdamW or bitsandbytes' 8-bit AdamW.

torch's AdamW keeps two fp32 moments (8 bytes a value). bitsandbytes' `AdamW8bit` / `PagedAdamW8bit` keep each
moment as one byte a value, blockwise quantized: one fp32 absmax per block of 256 values and moment, and both
dynamic code maps (256 fp32 each) once per optimizer. A tensor of fewer than `MIN_8BIT_SIZE` values keeps fp32
moments even there (bitsandbytes' `min_8bit_size`), so a tiny model's LoRA matrices cost what torch's do.
Paged moments are counted as device memory: they only page out to the host under memory pressure (CUDA's unified
memory), which a plan does not count on; on CPU ranks bitsandbytes falls back to non-paged ones.
"""
from __future__ import annotations

import math

from hfsplit.plan import is_8bit

FP32_MOMENT_BYTES = 8  # exp_avg + exp_avg_sq, fp32
BLOCKSIZE = 256  # bitsandbytes' blockwise 8-bit optimizers
MIN_8BIT_SIZE = 4096  # bitsandbytes' default min_8bit_size
QMAP_BYTES = 2 * 256 * 4  # the signed and unsigned dynamic code maps, shared by a bitsandbytes optimizer's tensors


def moment_bytes(numel: int, optim: str) -> int:
    """Bytes of the two Adam moments of one trainable tensor of `numel` values under `optim`."""
    if not is_8bit(optim) or numel < MIN_8BIT_SIZE:
        return numel * FP32_MOMENT_BYTES
    return 2 * numel + 2 * 4 * math.ceil(numel / BLOCKSIZE)


def moments_bytes(numels, optim: str) -> int:
    """Bytes of the moments of several trainable tensors (their values each), code maps excluded."""
    return sum(moment_bytes(n, optim) for n in numels)


def shared_bytes(numels, optim: str) -> int:
    """What one optimizer of these tensors holds once: the 8-bit code maps, where any tensor keeps 8-bit moments."""
    return QMAP_BYTES if is_8bit(optim) and any(n >= MIN_8BIT_SIZE for n in numels) else 0
