"""bitsandbytes checkpoints: what a pre-quantized checkpoint stores, and the bytes a quantized weight holds.

Read before any weight is (the loaders check what is asked against what is stored) and by the cost model
(`quantized_linear_bytes` is what a QLoRA block's weights weigh).
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
    if raw.get("quant_method") != "bitsandbytes":
        raise QuantizationError(f"{where} is pre-quantized with {raw.get('quant_method')!r}; hfsplit loads bitsandbytes "
                                "4-bit and 8-bit checkpoints only: use the 16-bit checkpoint and --method qlora")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig.from_dict(dict(raw))


def quantization_of_checkpoint(source: str, requested, *, method: str):
    """What to load `source` with: `requested` checked against the checkpoint's own quantization (a
    pre-quantized folder needs `--method qlora` and the format it stores); None for a plain 16-bit run."""
    stored = stored_quantization(load_config(source), where=source)
    if stored is None:
        return requested
    if method != "qlora":
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
