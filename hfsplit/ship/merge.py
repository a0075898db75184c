"""`hfsplit merge BASE ADAPTER OUT`: a peft LoRA adapter folded into its base, streamed tensor by tensor.

Each base tensor is read (dequantized from bitsandbytes 4/8-bit, MoE experts fused as the model holds them), gains
its adapter's delta in place (row blocks, expert by expert), is written at its place in the output shards, and is
dropped before the next is read: host RAM stays at the largest tensor plus the adapter plus a row block, whatever
the model's size. The output equals peft's `merge_and_unload` bit for bit (the same float32 arithmetic), in the
layout `save_pretrained` writes; the folder appears only when complete (`atomic_folder`).
"""
from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Union

import torch

from hfsplit.checkpoint.multimodal import Wrapper
from hfsplit.checkpoint.resolve import resolve_file
from hfsplit.checkpoint.writer import DEFAULT_MAX_SHARD_SIZE, StreamingWriter
from hfsplit.errors import CheckpointError
from hfsplit.ship.adapter import LoraDelta, adapter_deltas, read_adapter
from hfsplit.ship.base import BaseCheckpoint, StoredLayout, open_base
from hfsplit.ship.multimodal import Towers, WrappedLayout, wrapper_of_source

# Bytes of float32 delta computed at once: bounds the merge's working memory beyond the tensor itself.
ROW_BLOCK_BYTES = 64 * 2**20
# The files of a model folder besides its weights and config that a merged folder keeps (tokenizer, generation).
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
              "chat_template.json", "preprocessor_config.json", "processor_config.json")


def merge_adapter(base: Union[str, os.PathLike], adapter: Union[str, os.PathLike], out: Union[str, os.PathLike], *,
                  max_shard_size: Union[str, int] = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Merge the peft LoRA adapter in `adapter` into `base` and write a transformers model folder `out`.

    Args:
        base: a model folder or hub name: 16-bit, or bitsandbytes 4-bit / 8-bit (dequantized, as peft merges after
            dequantizing; the output is 16-bit).
        adapter: a folder peft's `save_pretrained` wrote (hfsplit's LoRA runs write one).
        out: the output folder (replaced, atomically, if it exists).
        max_shard_size: shards like `save_pretrained` ("5GB").

    Raises:
        CheckpointError: a missing or unreadable base or adapter, or an adapter trained for another model.
    """
    source = open_base(str(base))
    lora = read_adapter(adapter)
    shapes = _parameter_shapes(source)
    wrapper = wrapper_of_source(str(base))  # a multimodal base: the adapter names its modules as the original class
    ours = {wrapper.name(name) if wrapper else name: name for name in shapes}  # the adapter's names → the base's
    theirs = {ours_name: shapes[name] for ours_name, name in ours.items()}
    transposed = {n for n in ours if ours[n] in _transposed_experts(source.model)}
    deltas = {ours[n]: delta for n, delta in adapter_deltas(lora, theirs, transposed).items()}
    replacements = {ours[n]: tensor for n, tensor in lora.replacements(theirs).items()}
    with atomic_folder(out) as tmp:
        write_merged(source, deltas, tmp, max_shard_size=max_shard_size, replacements=replacements, wrapper=wrapper)
        write_config(source, tmp)
        copy_side_files(str(base), tmp)
    return Path(out)


def write_merged(source: BaseCheckpoint, deltas: dict[str, LoraDelta], folder: Path, *,
                 max_shard_size: Union[str, int], replacements: Optional[dict[str, torch.Tensor]] = None,
                 wrapper: Optional[Wrapper] = None) -> dict[str, str]:
    """Every tensor of `source` (or of `replacements`, the whole tensors an adapter saved), its delta added where
    `deltas` has one, into sharded safetensors in `folder`; for a multimodal base (`wrapper`), under the original
    class's names and followed by its towers as stored."""
    replacements = replacements or {}
    layout = StoredLayout(source.config) if wrapper is None else WrappedLayout(source.config, wrapper)
    towers = Towers(source.source, wrapper) if wrapper is not None else None
    names = source.names()
    specs_by_name = {name: source.spec(name) for name in names}
    specs = [spec for name in names for spec in layout.specs(specs_by_name[name])] + (towers.specs() if towers else [])
    writer = StreamingWriter(folder, specs, max_shard_size=max_shard_size)
    for name in names:
        tensor = replacements[name].to(specs_by_name[name].dtype) if name in replacements else source.read(name)
        if name in deltas:
            add_delta(tensor, deltas[name])
        for key, piece in layout.pieces(name, tensor).items():
            writer.write(key, piece)
        del tensor
    if towers is not None:
        towers.write(writer)
    return writer.close()


def add_delta(weight: torch.Tensor, delta: LoraDelta) -> torch.Tensor:
    """`weight` (the whole tensor, in place) plus `delta`: row blocks of a linear weight, experts one by one."""
    if delta.experts:
        for expert in range(delta.experts):
            weight[expert] = delta.merged_expert(weight, expert)
        return weight
    rows = max(1, ROW_BLOCK_BYTES // (4 * weight.shape[-1]))
    for first in range(0, weight.shape[0], rows):
        count = min(rows, weight.shape[0] - first)
        weight[first:first + count] = delta.merged_rows(weight, first, count)
    return weight


def write_config(source: BaseCheckpoint, folder: Path) -> Path:
    """The base's config.json, less its `quantization_config` (the merged weights are 16-bit)."""
    data = json.loads(resolve_file(source.source, "config.json").read_text())
    data.pop("quantization_config", None)
    path = folder / "config.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def copy_side_files(base: str, folder: Path) -> list[str]:
    """Copy the base's generation config and tokenizer files that exist into `folder`; their names."""
    copied = []
    for name in SIDE_FILES:
        try:
            path = resolve_file(base, name)
        except CheckpointError:  # the base has no such file
            continue
        shutil.copyfile(path, folder / name)
        copied.append(name)
    return copied


@contextmanager
def atomic_folder(out: Union[str, os.PathLike]) -> Iterator[Path]:
    """A temporary folder beside `out`, renamed to `out` when the block succeeds and removed when it fails: an
    interrupted or failed write leaves `out` as it was."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    if old.exists():
        shutil.rmtree(old)


def _parameter_shapes(source: BaseCheckpoint) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in source.model.named_parameters()}


def _transposed_experts(model: torch.nn.Module) -> set[str]:
    """Names of 3-D expert parameters stored (experts, in, out): their module says `is_transposed` (gpt-oss)."""
    return {f"{prefix}.{name}" for prefix, module in model.named_modules() if getattr(module, "is_transposed", False)
            for name, p in module.named_parameters(recurse=False) if p.dim() == 3}

