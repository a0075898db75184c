"""The tensors of a GGUF export: their names (from the `gguf` package's tensor map), shapes and GGML types, and
each one's bytes as llama.cpp stores it (rope-permuted q/k, offset norms, split fused experts, quantized blocks)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from hfsplit.errors import UnsupportedModelError
from hfsplit.ship.base import BaseCheckpoint
from hfsplit.ship.gguf_arch import GgufArch, full_head_dim


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file: its GGUF name, the model tensor it comes from, its shape and GGML type."""

    name: str
    source: str
    shape: tuple[int, ...]
    qtype: object  # gguf.GGMLQuantizationType
    rows: Optional[tuple[int, int]] = None  # (start, length) along dim 1: gate or up half of fused MoE experts


def gguf_tensors(source: BaseCheckpoint, arch: GgufArch, tensor_type: str) -> list[GgufTensor]:
    """Every tensor of the file, named by gguf's tensor map, with its GGML type: `tensor_type` for 2-D weights whose
    rows split into whole quantization blocks, F32 for the rest (norms, biases)."""
    import gguf

    names = gguf.get_tensor_name_map(model_arch(arch.name), source.config.num_hidden_layers)
    wanted = getattr(gguf.GGMLQuantizationType, tensor_type.upper())
    out = []
    for name in source.names():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        renamed = next((name[:-len(a)] + b for a, b in arch.renames if name.endswith(a)), name)
        for lookup, rows in _pieces(renamed, tuple(source.spec(name).shape)):
            gguf_name = names.get_name(lookup, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise UnsupportedModelError(f"export-gguf: gguf's tensor map has no name for {name!r} of "
                                            f"{source.config.model_type!r}")
            gguf_name += "" if lookup.endswith((".weight", ".bias")) else ".weight"
            shape = list(source.spec(name).shape)
            if rows is not None:
                shape[1] = rows[1]
            if name.endswith(arch.squeeze or ("\0",)):
                shape = [n for n in shape if n != 1]
            block = gguf.GGML_QUANT_SIZES[wanted][0]
            qtype = wanted if len(shape) >= 2 and shape[-1] % block == 0 else gguf.GGMLQuantizationType.F32
            out.append(GgufTensor(gguf_name, name, tuple(shape), qtype, rows))
    freqs = rope_freqs(source.config)
    if freqs is not None:
        out.append(GgufTensor("rope_freqs.weight", "", (len(freqs),), gguf.GGMLQuantizationType.F32))
    return out


def rope_freqs(config) -> Optional[torch.Tensor]:
    """llama.cpp's `rope_freqs` tensor of `config`, None where its rope needs none: Llama 3's rope scaling, or Gemma
    4's proportional rope of its full-attention layers."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "llama3":
        return llama3_rope_freqs(config)
    if config.model_type == "gemma4_text" and (rope.get("full_attention") or {}).get("rope_type") == "proportional":
        return proportional_rope_freqs(config)
    return None


def proportional_rope_freqs(config) -> torch.Tensor:
    """llama.cpp's `rope_freqs` for Gemma 4's proportional rope: its full-attention heads rotate only the first
    `partial_rotary_factor` of their pairs, each at plain rope's frequency over the whole head; llama.cpp rotates every
    pair and divides the unrotated ones' frequency by 1e30, turning them to angle 0 (as its converter writes it)."""
    head_dim = full_head_dim(config)
    pairs = head_dim // 2
    rotated = int(head_dim * config.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    return torch.tensor([1.0] * rotated + [1e30] * (pairs - rotated))


def refuse_reader_skipped(source: BaseCheckpoint, arch: GgufArch) -> None:
    """Refuse a model whose tensors that transformers' reader does not load (`arch.reader_skips`, left at their
    initial ones) hold anything but ones: the reader would not read it back."""
    if not arch.reader_skips:
        return
    for name in source.names():
        if name.endswith(arch.reader_skips) and not torch.all((value := source.read(name)) == 1):
            raise UnsupportedModelError(f"export-gguf: {name} of {source.config.model_type!r} is not 1 "
                                        f"({value.flatten()[:4].tolist()}): transformers' GGUF reader, the "
                                        "proof of the export, does not load it (it leaves it at 1)")


def llama3_rope_freqs(config) -> torch.Tensor:
    """llama.cpp's `rope_freqs` for Llama 3's rope scaling: per rotary pair, what it divides plain rope's frequency by
    (plain rope's inverse frequency over Llama 3's, as transformers computes both)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = config.rope_parameters["rope_theta"]
    plain = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    return plain / scaled


def _pieces(name: str, shape: tuple[int, ...]) -> list[tuple[str, Optional[tuple[int, int]]]]:
    """(name to look up in gguf's tensor map, rows along dim 1) of the GGUF tensors `name` becomes: fused MoE experts'
    `gate_up_proj` [E, 2I, H] as llama.cpp's separate gate and up experts, anything else as itself."""
    if not name.endswith("experts.gate_up_proj"):
        return [(name, None)]
    half = shape[1] // 2
    return [(name.replace("gate_up_proj", "gate_proj"), (0, half)), (name.replace("gate_up_proj", "up_proj"), (half, half))]


def tensor_bytes(source: BaseCheckpoint, arch: GgufArch, t: GgufTensor) -> np.ndarray:
    """Tensor `t` read, laid out as llama.cpp stores it, in its GGML type (quantized rows in blocks of rows)."""
    import gguf

    if t.name == "rope_freqs.weight":
        return rope_freqs(source.config).float().numpy()
    value = source.read(t.source)
    if t.rows is not None:
        value = value.narrow(1, *t.rows).contiguous()
    value = value.reshape(t.shape)
    if arch.permute_qk and t.name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = source.config.num_attention_heads if "attn_q" in t.name else source.config.num_key_value_heads
        value = _rope_permuted(value, heads)
    if arch.norm_offset and t.name.endswith("norm.weight"):
        value = value.float() + arch.norm_offset
    if t.qtype == gguf.GGMLQuantizationType.F32:
        return value.float().numpy()
    if t.qtype == gguf.GGMLQuantizationType.F16:
        return value.to(torch.float16).numpy()
    if t.qtype == gguf.GGMLQuantizationType.BF16:
        return value.to(torch.bfloat16).view(torch.uint16).numpy().view(np.uint8).reshape(*value.shape[:-1], -1)
    out = np.empty(gguf.quant_shape_to_byte_shape(t.shape, t.qtype), dtype=np.uint8)
    rows = max(1, (16 * 2**20) // (4 * t.shape[-1]))  # float32 rows quantized at once
    for first in range(0, t.shape[0], rows):
        out[first:first + rows] = gguf.quants.quantize(value[first:first + rows].float().numpy(), t.qtype)
    return out


def _rope_permuted(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows from transformers' rotate-half order to llama.cpp's interleaved pairs, per head."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def model_arch(name: str):
    """gguf's MODEL_ARCH member named `name`."""
    import gguf

    return next(arch for arch, arch_name in gguf.MODEL_ARCH_NAMES.items() if arch_name == name)


def nbytes(t: GgufTensor) -> int:
    """The bytes tensor `t` takes in the file."""
    import gguf

    return int(np.prod(gguf.quant_shape_to_byte_shape(t.shape, t.qtype)))
