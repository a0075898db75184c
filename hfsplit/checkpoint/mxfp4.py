"""MXFP4 experts (gpt-oss): the checkpoint's packed `*_blocks` / `*_scales`, dequantized as they are read.

A gpt-oss checkpoint stores each fused expert parameter of the model, `mlp.experts.gate_up_proj` `[E, H, 2I]` and
`mlp.experts.down_proj` `[E, I, H]`, as two tensors named after it: `gate_up_proj_blocks` uint8 `[E, 2I, H/32, 16]`
(the transposed weight, 32 FP4 e2m1 values a block along its input dim, two a byte, the even one in the low nibble)
and `gate_up_proj_scales` uint8 `[E, 2I, H/32]` (one power-of-two exponent a block, biased by 127). transformers
without its Triton kernels (on CPU, or with `Mxfp4Config(dequantize=True)`) dequantizes them on load with
`integrations.mxfp4.convert_moe_packed_tensors`, to the dtype of the parameter, and drops the quantization config.
hfsplit's reader runs that same function, one expert at a time on the destination device, so a rank holds at most
one expert's transient beyond the parameter it fills; `pack_experts` is its inverse (tiny MXFP4 test checkpoints).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from hfsplit.errors import CheckpointError

BLOCKS, SCALES = "_blocks", "_scales"
VALUES_PER_BLOCK = 32  # one scale per 32 values, 16 bytes of blocks
# What an MXFP4 tensor reads as when no dtype is asked for: transformers' default dequantization dtype, and the
# dtype the published gpt-oss checkpoints keep their other tensors in.
DEQUANTIZED_DTYPE = torch.bfloat16
QUANT_METHOD = "mxfp4"
_EXPONENT_BIAS = 127
_E2M1_EMAX = 2  # the largest FP4 e2m1 magnitude, 6 = 1.5 · 2**2


@dataclass(frozen=True)
class PackedExperts:
    """One model tensor stored as MXFP4: the checkpoint keys of its blocks and scales."""

    target: str  # the model's parameter ("model.layers.0.mlp.experts.gate_up_proj")
    blocks: str
    scales: str

    def keys(self) -> list[str]:
        return [self.blocks, self.scales]


def packed_experts(weight_map: Mapping[str, str], names: Iterable[str]) -> dict[str, PackedExperts]:
    """{model tensor: its MXFP4 pieces} for each of `names` (the model's) that the checkpoint stores as
    `name_blocks` + `name_scales` rather than under its own name.

    Raises:
        CheckpointError: a tensor's blocks without its scales, or the reverse (a truncated or mixed checkpoint).
    """
    found = {}
    for name in names:
        if name in weight_map:
            continue
        blocks, scales = name + BLOCKS, name + SCALES
        if (blocks in weight_map) != (scales in weight_map):
            have, lack = (blocks, scales) if blocks in weight_map else (scales, blocks)
            raise CheckpointError(f"the checkpoint holds {have!r} but not {lack!r}: an MXFP4 tensor needs both its "
                                  "blocks and its scales; re-download the checkpoint")
        if blocks in weight_map:
            found[name] = PackedExperts(name, blocks, scales)
    return found


def dequantized_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The model tensor's shape `[E, in, out]` of blocks `[E, out, in/32, 16]`."""
    experts, out, groups, per = blocks_shape
    return experts, groups * per * 2, out


def dequantize_expert(blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """One expert's `[in, out]` weight from its blocks `[out, in/32, 16]` and scales `[out, in/32]`, by
    transformers' own dequantizer (on the tensors' device)."""
    # imported here: transformers.integrations.mxfp4 costs ~2.5 s on top of transformers' config (measured), which
    # every `hfsplit plan` would pay through the reader's import
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks.unsqueeze(0), scales.unsqueeze(0), dtype=dtype)[0]


def without_mxfp4(config: dict) -> dict:
    """A config.json's fields without an MXFP4 `quantization_config`: hfsplit dequantizes the experts as they are
    read, so the model it builds (and saves) holds them in 16 bits, as transformers drops the config after it
    dequantizes on load."""
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == QUANT_METHOD:
        return {k: v for k, v in config.items() if k != "quantization_config"}
    return config


def pack_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of fused expert weights `[E, in, out]` in the checkpoint's MXFP4 layout: each block of 32
    input values scaled by the power of two that brings its largest magnitude within FP4's [4, 6] (the OCP MX
    shared exponent), each value rounded to the nearest FP4 e2m1 value. `dequantize_expert` inverts it exactly on
    values so quantized."""
    from transformers.integrations.mxfp4 import FP4_VALUES  # imported here: see dequantize_expert

    experts, inp, out = weight.shape
    if inp % VALUES_PER_BLOCK:
        raise ValueError(f"pack_experts: the input dim {inp} is not a multiple of {VALUES_PER_BLOCK}")
    rows = weight.transpose(1, 2).float().reshape(experts, out, inp // VALUES_PER_BLOCK, VALUES_PER_BLOCK)
    amax = rows.abs().amax(dim=-1, keepdim=True)
    exponent = torch.floor(torch.log2(amax.clamp_min(2.0 ** -_EXPONENT_BIAS))) - _E2M1_EMAX
    exponent = exponent.clamp(-_EXPONENT_BIAS, _EXPONENT_BIAS)
    scaled = rows / torch.exp2(exponent)
    magnitudes = torch.tensor(FP4_VALUES[:8])
    index = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)  # nearest magnitude (saturates at 6)
    nibbles = (index + 8 * ((scaled < 0) & (index > 0))).to(torch.uint8)  # codes 9-15: negative values
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    scales = (exponent.squeeze(-1) + _EXPONENT_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()
