"""Where a safetensors checkpoint keeps its tensors and what the model calls them: the index (or single file),
each shard's header (dtype, shape, byte range), and the model parameter → checkpoint key names transformers applies
on load. The reader (`hfsplit.checkpoint.reader`) reads bytes through these; nothing here reads a tensor.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from hfsplit.checkpoint.merged import MergedTensor, split_checkpoint_names
from hfsplit.checkpoint.resolve import resolve_file
from hfsplit.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


@dataclass(frozen=True)
class TensorEntry:
    """Where one checkpoint tensor lives: file, dtype, shape, absolute byte range."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    stop: int


# ---- checkpoint layout ------------------------------------------------------------------


def weight_map_of(source: str, revision: Optional[str]) -> tuple[Path, dict[str, str]]:
    """(index or single file, checkpoint tensor name → shard file name)."""
    index_path = optional_file(source, INDEX_FILE, revision)
    if index_path is not None:
        try:
            data = json.loads(index_path.read_text())
            weight_map = data["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: not a readable safetensors index ({exc})") from exc
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: 'weight_map' is empty or not a mapping")
        return index_path, dict(weight_map)
    single = optional_file(source, SINGLE_FILE, revision)
    if single is None:
        raise CheckpointError(
            f"{source}: neither {INDEX_FILE} nor {SINGLE_FILE} found; hfsplit reads safetensors checkpoints "
            "(convert .bin weights with `save_pretrained(..., safe_serialization=True)`)")
    return single, {key: SINGLE_FILE for key in read_header(single)}


def optional_file(source: str, filename: str, revision: Optional[str]) -> Optional[Path]:
    path = Path(source)
    if path.is_dir():
        candidate = path / filename
        return candidate if candidate.is_file() else None
    try:
        return resolve_file(source, filename, revision=revision)
    except CheckpointError:
        return None


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Tensor entries of one safetensors file; CheckpointError names the file when it is corrupt."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise CheckpointError(f"{path}: shard file not found; the index names it but it is missing "
                              "(incomplete download or copy?)")
    try:
        # safe_open checks the header against the file (offsets, sizes, dtypes); we keep
        # no handle, so no memory map stays open.
        with safe_open(str(path), framework="pt") as handle:
            names = list(handle.keys())
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header ({exc}); re-download or re-save this shard") from exc
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    base = 8 + length
    out = {}
    for name in names:
        info = header[name]
        if info["dtype"] not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which hfsplit cannot read")
        start, stop = info["data_offsets"]
        out[name] = TensorEntry(path, _DTYPES[info["dtype"]], tuple(info["shape"]), base + start, base + stop)
    return out


# ---- names ------------------------------------------------------------------------------


def parameter_to_checkpoint_names(weight_map: dict[str, str], model: Optional[torch.nn.Module] = None
                                  ) -> tuple[dict[str, str], dict[str, MergedTensor]]:
    """(model parameter name → checkpoint name, model name → MergedTensor).

    Applies the renames transformers applies on load for the model's class (none for
    dense Llama/Qwen2/Mistral), groups the tensors it merges on load (MoE experts stored one by
    one), and maps tied weights absent from the checkpoint (`lm_head.weight`) to their source
    (`model.embed_tokens.weight`).

    Raises:
        ConvertedOnLoadError: a tensor is split into several on load (only merges are read).
    """
    names, merged = ({key: key for key in weight_map}, {}) if model is None else split_checkpoint_names(weight_map, model)
    for target, source in _tied_pairs(model).items():
        if target not in names and source in names:
            names[target] = names[source]
    return names, merged


def _tied_pairs(model: Optional[torch.nn.Module]) -> dict[str, str]:
    """Tied weights {target: source}; without a model, the usual lm_head ← embed_tokens."""
    if model is None:
        return {"lm_head.weight": "model.embed_tokens.weight"}
    pairs = getattr(model, "all_tied_weights_keys", None)
    if isinstance(pairs, dict):
        return dict(pairs)
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False):
        return {"lm_head.weight": "model.embed_tokens.weight"}
    return {}


def meta_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name (tied duplicates included)."""
    return dict(model.state_dict(keep_vars=True))


def persistent_state_names(model: torch.nn.Module) -> list[str]:
    return list(meta_state(model))


def text_checkpoint_names(wrapper, weight_map: dict[str, str], text_model: torch.nn.Module):
    """(the language model's parameter name → checkpoint key, its merged tensors, the weight map cut to the language
    model's keys) of a multimodal checkpoint, `wrapper` its `hfsplit.checkpoint.multimodal.Wrapper`: through the
    multimodal class's own names and transformers' renames for it, so the towers' keys are left out."""
    names, merged = parameter_to_checkpoint_names(weight_map, wrapper.model)
    ours = {}
    for text_name in text_model.state_dict(keep_vars=True):
        theirs = wrapper.name(text_name)
        if theirs in names:
            ours[text_name] = names[theirs]
    our_merged = {t: merged[wrapper.name(t)] for t in text_model.state_dict() if wrapper.name(t) in merged}
    keys = set(ours.values()) | {k for m in our_merged.values() for k in m.keys()}
    return ours, our_merged, {k: v for k, v in weight_map.items() if k in keys}
