"""`hfsplit export-gguf MODEL_DIR OUT.gguf --type f16|bf16|q8_0|q4_0`: a transformers model folder as one GGUF file.

Written with the ggml project's own `gguf` package: tensor names from its `tensor_mapping` (gguf_tensors.py), the
tokenizer through its vocab helpers (gguf_vocab.py), quantization by `gguf.quants`. Streamed: every tensor's GGUF
header entry is computed from the checkpoint's headers first, then each tensor is read (the lazy reader), converted
and written before the next is read. What is checked, per architecture (gguf_arch.py), is that transformers' own GGUF
reader (`from_pretrained(dir, gguf_file=...)`) loads the file to the same logits and rebuilds a tokenizer that encodes
as the original; architectures without that proof, and configs the reader would rebuild differently, are refused.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import numpy as np

from hfsplit.errors import CheckpointError, UnsupportedModelError
from hfsplit.ship.base import open_base
from hfsplit.ship.gguf_arch import add_hyperparameters, ffn_width, gguf_arch, reader_mismatch
from hfsplit.ship.gguf_tensors import gguf_tensors, nbytes, refuse_reader_skipped, tensor_bytes
from hfsplit.ship.gguf_vocab import add_tokenizer

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


def export_gguf(model: Union[str, os.PathLike], out: Union[str, os.PathLike], *, tensor_type: str = "f16") -> Path:
    """Write the transformers model folder (or hub name) `model` as the GGUF file `out`, atomically.

    Args:
        model: a model folder (a merged one, say) or hub name; 16-bit, 32-bit or bitsandbytes (dequantized).
        out: the .gguf file (written beside as `.<name>.tmp-<pid>`, renamed when complete).
        tensor_type: the type of the 2-D weights ("f16", "bf16", "f32", "q8_0", "q4_0"); norms and biases stay f32.

    Raises:
        UnsupportedModelError: an architecture (or rope scaling, config value or tokenizer) whose export is not
            proven.
        CheckpointError: the model folder cannot be read.
    """
    import gguf

    if tensor_type not in TYPES:
        raise CheckpointError(f"--type {tensor_type}: choose one of {', '.join(TYPES)}")
    source = open_base(str(model))
    arch = gguf_arch(source.config)
    tensors = gguf_tensors(source, arch, tensor_type)
    refuse_reader_skipped(source, arch)
    width = ffn_width(source.config, arch, {name: tuple(source.spec(name).shape) for name in source.names()})

    def add_keys(writer):
        add_hyperparameters(writer, source.config, arch, width)
        writer.add_file_type(_file_type(gguf, tensor_type))
        if tensor_type.startswith("q"):
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_tokenizer(writer, str(model), source.config)

    differ = reader_mismatch(source.config, add_keys, [t.name for t in tensors], width)
    if differ:
        raise UnsupportedModelError(f"export-gguf: {source.config.model_type!r} is not exported with these values "
                                    "(the model's, then what transformers' GGUF reader, the proof of the export, "
                                    f"would rebuild from the file): {differ}")
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, arch.name)
    try:
        add_keys(writer)
        for t in tensors:
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes(t), raw_dtype=t.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            writer.write_tensor_data(tensor_bytes(source, arch, t))
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


def _file_type(gguf, tensor_type: str):
    """llama.cpp's `general.file_type` for the weights' type."""
    return {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
            "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[tensor_type]
