"""bitsandbytes checkpoints: what a pre-quantized checkpoint stores, and the bytes a quantized weight holds.

Read before any weight is (the loaders check what is asked against what is stored) and by the cost model
(`quantized_linear_bytes` is what a QLoRA block's weights weigh, `quantized_experts_bytes` its 4-bit fused
MoE experts).
"""
from __future__ import annotations

import math

from hfsplit.checkpoint.resolve import load_config
from hfsplit.errors import QuantizationError

BLOCKSIZE = 64  # Params4bit's default block size (BitsAndBytesConfig has no knob for it)
NESTED_BLOCKSIZE = 256  # double quantization quantizes the absmax values in blocks of 256


def stored_quantization(config, *, where: str):
    """The `BitsAndBytesConfig` a pre-quantized checkpoint's config.json names (None for a 16-bit checkpoint)."""
    raw = getattr(config, "quantization_config", None)
    if raw is None:
        return None
    raw = raw if isinstance(raw, dict) else raw.to_dict()
    if raw.get("quant_method") == "gguf":  # a folder saved after a GGUF load: the label stays, the tensors are floats
        return None
    if raw.get("quant_method") != "bitsandbytes":
        raise QuantizationError(f"{where} is pre-quantized with {raw.get('quant_method')!r}; hfsplit loads bitsandbytes "
                                "4-bit and 8-bit checkpoints only: use the 16-bit checkpoint and --method qlora")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig.from_dict(dict(raw))


def quantization_of_checkpoint(source: str, requested, *, method: str, config=None):
    """The one place deciding whether `source` is pre-quantized and what to load it with: `requested` checked
    against the checkpoint's own quantization (a pre-quantized folder loads as it stores, for inference or
    QLoRA: training it needs `--method qlora` and the format it stores); `requested` for a 16-bit checkpoint.
    `config`: `source`'s config when already read."""
    stored = stored_quantization(config if config is not None else load_config(source), where=source)
    if stored is None:
        return requested
    if method not in ("qlora", "inference"):
        raise QuantizationError(f"{source} is pre-quantized (bitsandbytes); train it with --method qlora, "
                                "or use its 16-bit checkpoint")
    return for_stored(requested, stored, where=source)


_STORED_FIELDS = (("load_in_8bit", "--load-in-8bit"), ("bnb_4bit_quant_type", "--bnb-4bit-quant-type"),
                  ("bnb_4bit_use_double_quant", "--bnb-4bit-use-double-quant"))


def for_stored(requested, stored, *, where: str):
    """The quantization to load a pre-quantized checkpoint with: `requested` (None: the stored one), refused in
    one line where it asks for another format than the checkpoint stores (the compute dtype may differ)."""
    if requested is None:
        return stored
    for field, flag in _STORED_FIELDS:
        want, have = getattr(requested, field), getattr(stored, field)
        if want != have:
            show = lambda v: ("on" if v else "off") if isinstance(v, bool) else v  # noqa: E731
            raise QuantizationError(f"{where} is pre-quantized with {field}={have!r} but {field}={want!r} was asked "
                                    f"for; hfsplit does not re-quantize: pass {flag} {show(have)}")
    return requested


def quantized_linear_bytes(in_features: int, out_features: int, *, quant_type: str = "nf4",
                           double_quant: bool = True, load_in_8bit: bool = False) -> int:
    """Exact bytes bitsandbytes holds for one quantized weight of `out_features × in_features`.

    4-bit: two values per byte, one absmax per 64 values (fp32, or uint8 under double quantization,
    plus one fp32 absmax per 256 blocks, a 256-entry fp32 code and an fp32 offset), and the 16-entry
    fp32 code of the quant type. 8-bit: one byte per value and one fp32 scale per output row.
    """
    n = in_features * out_features
    if load_in_8bit:
        return n + 4 * out_features
    blocks = math.ceil(n / BLOCKSIZE)
    packed = math.ceil(n / 2)
    code = 16 * 4
    if not double_quant:
        return packed + 4 * blocks + code
    nested = math.ceil(blocks / NESTED_BLOCKSIZE)
    return packed + blocks + 4 * nested + 256 * 4 + 4 + code


def quantized_experts_bytes(experts: int, rows: int, cols: int, *, quant_type: str = "nf4",
                            double_quant: bool = True) -> int:
    """Exact bytes of one fused expert tensor `[experts, rows, cols]` in 4 bits
    (`hfsplit.apply.quantized_experts.ExpertsNF4`): each expert's matrix quantized alone as `quantized_linear_bytes`
    counts a weight, the codes every expert shares (the 4-bit type's 16 values; the nested dynamic map's 256) held
    once."""
    n = rows * cols
    blocks = math.ceil(n / BLOCKSIZE)
    per_expert = math.ceil(n / 2) + (blocks + 4 * math.ceil(blocks / NESTED_BLOCKSIZE) + 4 if double_quant else 4 * blocks)
    return experts * per_expert + 16 * 4 + (256 * 4 if double_quant else 0)
