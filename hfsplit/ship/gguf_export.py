"""`hfsplit export-gguf MODEL_DIR OUT.gguf --type f16|bf16|q8_0|q4_0`: a transformers model folder as one GGUF file.

Written with the ggml project's own `gguf` package: tensor names from its `tensor_mapping`, the tokenizer through
its vocab helpers (`BpeVocab`, `SpecialVocab`), quantization by `gguf.quants`. Streamed: every tensor's GGUF
header entry is computed from the checkpoint's headers first, then each tensor is read (the lazy reader), converted
and written before the next is read. What is checked, per architecture, is that transformers' own GGUF reader
(`from_pretrained(dir, gguf_file=...)`) loads the file to the same logits and rebuilds a tokenizer that encodes as
the original; architectures without that proof are refused by name.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from hfsplit.checkpoint.resolve import resolve_file
from hfsplit.errors import CheckpointError, UnsupportedModelError
from hfsplit.ship.base import BaseCheckpoint, open_base

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


@dataclass(frozen=True)
class GgufArch:
    """How llama.cpp stores one transformers architecture.

    Args:
        name: GGUF `general.architecture` (a `gguf.MODEL_ARCH_NAMES` value).
        permute_qk: q and k rows interleaved per head (llama.cpp's rope layout for Llama; transformers' reader
            undoes it).
        norm_offset: added to RMSNorm weights (Gemma's norms scale by 1 + w; llama.cpp stores 1 + w).
    """

    name: str
    permute_qk: bool = False
    norm_offset: float = 0.0


# transformers model_type → GGUF architecture; each proven by tests/ship/test_gguf.py against transformers' reader.
ARCHITECTURES = {
    "llama": GgufArch("llama", permute_qk=True),
    "mistral": GgufArch("llama", permute_qk=True),  # llama.cpp converts Mistral as Llama (no sliding window)
    "qwen2": GgufArch("qwen2"),
    "qwen3": GgufArch("qwen3"),
    "gemma2": GgufArch("gemma2", norm_offset=1.0),
    "qwen3_moe": GgufArch("qwen3moe"),
}
# Config values transformers' GGUF reader does not read back (it takes its defaults): exported only when they are.
_READER_DEFAULTS = {"gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                               "query_pre_attn_scalar": 256},
                    "qwen3_moe": {"norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1,
                                  "moe_intermediate_size": 768}}


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file: its GGUF name, the model tensor it comes from, its shape and GGML type."""

    name: str
    source: str
    shape: tuple[int, ...]
    qtype: object  # gguf.GGMLQuantizationType
    rows: Optional[tuple[int, int]] = None  # (start, length) along dim 1: gate or up half of fused MoE experts


def export_gguf(model: Union[str, os.PathLike], out: Union[str, os.PathLike], *, tensor_type: str = "f16") -> Path:
    """Write the transformers model folder (or hub name) `model` as the GGUF file `out`, atomically.

    Args:
        model: a model folder (a merged one, say) or hub name; 16-bit, 32-bit or bitsandbytes (dequantized).
        out: the .gguf file (written beside as `.<name>.tmp-<pid>`, renamed when complete).
        tensor_type: the type of the 2-D weights ("f16", "bf16", "f32", "q8_0", "q4_0"); norms and biases stay f32.

    Raises:
        UnsupportedModelError: an architecture (or rope scaling, or tokenizer) whose export is not proven.
        CheckpointError: the model folder cannot be read.
    """
    import gguf

    if tensor_type not in TYPES:
        raise CheckpointError(f"--type {tensor_type}: choose one of {', '.join(TYPES)}")
    source = open_base(str(model))
    arch = gguf_arch(source.config)
    tensors = gguf_tensors(source, arch, tensor_type)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, arch.name)
    try:
        add_hyperparameters(writer, source.config, tensor_type)
        add_tokenizer(writer, str(model), source.config)
        for t in tensors:
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), _nbytes(t), raw_dtype=t.qtype)
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


def gguf_arch(config) -> GgufArch:
    """The GGUF architecture of `config`; refused by name where no oracle proves the export."""
    model_type = config.model_type
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(f"export-gguf: model type {model_type!r} is not exported yet (exported: "
                                    f"{', '.join(sorted(ARCHITECTURES))}); llama.cpp's convert_hf_to_gguf.py may "
                                    "convert the merged folder")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"export-gguf: rope scaling {rope.get('rope_type')!r} of {model_type!r} is not "
                                    "exported yet (only plain rope)")
    if model_type == "mistral" and getattr(config, "sliding_window", None):
        raise UnsupportedModelError("export-gguf: Mistral with a sliding window is not exported (llama.cpp's "
                                    "Llama layout has none)")
    differ = {k: getattr(config, k, None) for k, v in _READER_DEFAULTS.get(model_type, {}).items()
              if getattr(config, k, None) != v}
    if differ:
        raise UnsupportedModelError(f"export-gguf: {model_type!r} with {differ} is not exported: transformers' GGUF "
                                    f"reader, the proof of the export, takes {_READER_DEFAULTS[model_type]}")
    if model_type == "qwen3" and getattr(config, "head_dim", 128) != 128:
        raise UnsupportedModelError(f"export-gguf: Qwen3 with head_dim {config.head_dim} is not exported: transformers' "
                                    "GGUF reader, the proof of the export, takes Qwen3's head_dim as 128")
    return ARCHITECTURES[model_type]


def gguf_tensors(source: BaseCheckpoint, arch: GgufArch, tensor_type: str) -> list[GgufTensor]:
    """Every tensor of the file, named by gguf's tensor map, with its GGML type: `tensor_type` for 2-D weights whose
    rows split into whole quantization blocks, F32 for the rest (norms, biases)."""
    import gguf

    names = gguf.get_tensor_name_map(_model_arch(arch.name), source.config.num_hidden_layers)
    wanted = _ggml_type(tensor_type)
    out = []
    for name in source.names():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        for lookup, rows in _pieces(name, tuple(source.spec(name).shape)):
            gguf_name = names.get_name(lookup, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise UnsupportedModelError(f"export-gguf: gguf's tensor map has no name for {name!r} of "
                                            f"{source.config.model_type!r}")
            gguf_name += "" if lookup.endswith((".weight", ".bias")) else ".weight"
            shape = list(source.spec(name).shape)
            if rows is not None:
                shape[1] = rows[1]
            block = gguf.GGML_QUANT_SIZES[wanted][0]
            qtype = wanted if len(shape) >= 2 and shape[-1] % block == 0 else gguf.GGMLQuantizationType.F32
            out.append(GgufTensor(gguf_name, name, tuple(shape), qtype, rows))
    return out


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

    value = source.read(t.source)
    if t.rows is not None:
        value = value.narrow(1, *t.rows).contiguous()
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
        return value.to(torch.bfloat16).view(torch.uint16).numpy().view(np.uint8).reshape(value.shape[0], -1)
    out = np.empty(gguf.quant_shape_to_byte_shape(t.shape, t.qtype), dtype=np.uint8)
    rows = max(1, (16 * 2**20) // (4 * t.shape[-1]))  # float32 rows quantized at once
    for first in range(0, t.shape[0], rows):
        out[first:first + rows] = gguf.quants.quantize(value[first:first + rows].float().numpy(), t.qtype)
    return out


def _rope_permuted(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows from transformers' rotate-half order to llama.cpp's interleaved pairs, per head."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def add_hyperparameters(writer, config, tensor_type: str) -> None:
    """The keys llama.cpp (and transformers' reader) take the model's shape from."""
    import gguf

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    # No general.name: transformers' reader takes a file named exactly "mistral" for its own Mistral layout.
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "num_experts", None):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "sliding_window", None) and config.model_type != "mistral":
        writer.add_sliding_window(config.sliding_window)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, key, None):
            getattr(writer, f"add_{key}")(config.__getattribute__(key))
    writer.add_file_type(_FILE_TYPES[tensor_type](gguf))
    if tensor_type.startswith("q"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def add_tokenizer(writer, model: str, config) -> None:
    """The byte-level BPE tokenizer of `model` (tokenizer.json) as llama.cpp reads it: tokens with their types
    (special added tokens CONTROL, other added tokens USER_DEFINED, padding to the embedding's rows UNUSED), the
    pre-tokenizer's name, merges, special token ids and the chat template (`gguf.SpecialVocab`)."""
    import gguf

    folder = resolve_file(model, "tokenizer.json").parent
    try:
        vocab = gguf.vocab.BpeVocab(folder)
    except (FileNotFoundError, ValueError) as exc:
        raise UnsupportedModelError(f"export-gguf: {folder}/tokenizer.json is not a byte-level BPE tokenizer ({exc}); "
                                    "only those are exported yet") from None
    data = json.loads((folder / "tokenizer.json").read_text())
    added = {t["content"]: t for t in data.get("added_tokens", [])}
    tokens, types = [], []
    for text, _, _ in vocab.all_tokens():
        token = text.decode("utf-8") if isinstance(text, bytes) else text
        entry = added.get(token)
        kind = (gguf.TokenType.CONTROL if entry["special"] else gguf.TokenType.USER_DEFINED) if entry else gguf.TokenType.NORMAL
        tokens.append(token)
        types.append(kind)
    if len(tokens) > config.vocab_size:
        raise CheckpointError(f"export-gguf: the tokenizer has {len(tokens)} tokens, the model's embedding "
                              f"{config.vocab_size} rows")
    for i in range(len(tokens), config.vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(data, folder))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=config.vocab_size).add_to_gguf(writer, quiet=True)


def pre_tokenizer_name(tokenizer: dict, folder: Path) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer: "gpt-2" for plain byte-level BPE, else the name whose
    split regex transformers' GGUF reader would rebuild (its `GGUF_PRE_TOKENIZER_SPLITS`)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    pre = tokenizer.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    regex = next((p.get("pattern", {}).get("Regex") for p in parts if p.get("type") == "Split"), None)
    name = next((n for n, split in GGUF_PRE_TOKENIZER_SPLITS.items() if split == regex), None)
    if name is None or not any(p.get("type") == "ByteLevel" for p in parts):
        raise UnsupportedModelError(f"export-gguf: {folder}/tokenizer.json splits text in a way llama.cpp has no name "
                                    "for (its pre-tokenizer is not GPT-2's, Llama 3's, Qwen2's, ...)")
    return name


_FILE_TYPES = {
    "f32": lambda g: g.LlamaFileType.ALL_F32, "f16": lambda g: g.LlamaFileType.MOSTLY_F16,
    "bf16": lambda g: g.LlamaFileType.MOSTLY_BF16, "q8_0": lambda g: g.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": lambda g: g.LlamaFileType.MOSTLY_Q4_0,
}


def _ggml_type(tensor_type: str):
    import gguf

    return getattr(gguf.GGMLQuantizationType, tensor_type.upper())


def _model_arch(name: str):
    import gguf

    return next(arch for arch, arch_name in gguf.MODEL_ARCH_NAMES.items() if arch_name == name)


def _nbytes(t: GgufTensor) -> int:
    import gguf

    return int(np.prod(gguf.quant_shape_to_byte_shape(t.shape, t.qtype)))
