"""Streaming safetensors writer: a checkpoint written tensor by tensor, sharded as transformers shards.

The shapes and dtypes of every tensor are known before a byte is written (the reader's headers, a meta model), so
the shards are laid out first (`shard_layout`: transformers' greedy split by `max_shard_size`), each file gets its
header and its full size at once, and every tensor is then `pwrite`n at its place and dropped: no shard, nor the
model, is ever held in memory. Files follow transformers' names (`model.safetensors`, or
`model-00001-of-00003.safetensors` with `model.safetensors.index.json`) and the safetensors format (an 8-byte header
length, the JSON header padded to 8 bytes, the tensors' bytes back to back).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import torch

from hfsplit.budget import DEFAULT_MAX_SHARD_SIZE, parse_size
from hfsplit.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
_SAFETENSORS_DTYPES.update({getattr(torch, attr): name for attr, name in (("float8_e4m3fn", "F8_E4M3"),
                                                                        ("float8_e5m2", "F8_E5M2")) if hasattr(torch, attr)})


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its name in the file, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def shard_size_bytes(max_shard_size: Union[str, int]) -> int:
    """Bytes in `max_shard_size` ("5GB" = 5·10⁹ as transformers reads it, "2GiB", or an int)."""
    return parse_size(max_shard_size, what="max_shard_size")


def shard_layout(specs: Sequence[TensorSpec], max_shard_size: Union[str, int]) -> list[list[TensorSpec]]:
    """`specs` in order, cut into shards of at most `max_shard_size` bytes as transformers cuts them: a tensor that
    would overflow the current shard starts the next one; a tensor larger than the limit gets a shard alone."""
    limit = shard_size_bytes(max_shard_size)
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards if shards[0] else []


def shard_file_name(index: int, total: int) -> str:
    """transformers' name of shard `index` (0-based) of `total`; one shard is `model.safetensors`."""
    return SINGLE_FILE if total == 1 else f"model-{index + 1:05d}-of-{total:05d}.safetensors"


class ShardFile:
    """One safetensors file, header written and size fixed at creation; `write` puts a tensor's bytes in place."""

    def __init__(self, path: Path, specs: Sequence[TensorSpec], metadata: Optional[dict] = None):
        self.path = path
        self.specs = {spec.name: spec for spec in specs}
        header, begin = {"__metadata__": metadata or {"format": "pt"}}, 0
        for spec in specs:
            header[spec.name] = {"dtype": _dtype_name(spec), "shape": list(spec.shape),
                                 "data_offsets": [begin, begin + spec.nbytes]}
            begin += spec.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._base = 8 + len(text)
        self._offsets = {name: info["data_offsets"][0] for name, info in header.items() if name != "__metadata__"}
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self._fd, len(text).to_bytes(8, "little") + text, 0)
        os.ftruncate(self._fd, self._base + begin)
        self.missing = set(self.specs)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.specs[name]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise CheckpointError(f"{self.path}: tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, its place in "
                                  f"the shard was laid out for {spec.dtype} {list(spec.shape)}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        view, done, offset = memoryview(data), 0, self._base + self._offsets[name]
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)
        self.missing.discard(name)

    def close(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
        if self.missing:
            raise CheckpointError(f"{self.path}: closed with tensor(s) never written: {sorted(self.missing)[:3]}")


class StreamingWriter:
    """Writes the tensors of `specs` into `folder`, each the moment it comes (`write`), then the index (`close`).

    Args:
        folder: the (temporary) output folder.
        specs: every tensor this writer will write, in file order.
        max_shard_size: the shard limit ("5GB").
        first_shard, total_shards: this writer's shards are numbered from `first_shard` among `total_shards` in all
            (several ranks writing one checkpoint); default: this writer's shards are all of them.
    """

    def __init__(self, folder: Union[str, os.PathLike], specs: Sequence[TensorSpec], *,
                 max_shard_size: Union[str, int] = DEFAULT_MAX_SHARD_SIZE, first_shard: int = 0,
                 total_shards: Optional[int] = None, layout: Optional[list[list[TensorSpec]]] = None):
        self.folder = Path(folder)
        groups = layout if layout is not None else shard_layout(specs, max_shard_size)
        total = total_shards if total_shards is not None else len(groups)
        self.files = [ShardFile(self.folder / shard_file_name(first_shard + i, total), group)
                      for i, group in enumerate(groups)]
        self._file_of = {spec.name: file for file in self.files for spec in file.specs.values()}
        self.total_size = sum(spec.nbytes for group in groups for spec in group)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write tensor `name` (any order); the caller drops it afterwards."""
        try:
            file = self._file_of[name]
        except KeyError:
            raise CheckpointError(f"{self.folder}: tensor {name!r} was not laid out for this checkpoint") from None
        file.write(name, tensor)

    def weight_map(self) -> dict[str, str]:
        return {name: file.path.name for name, file in self._file_of.items()}

    def close(self, *, write_index: bool = True) -> dict[str, str]:
        """Close every shard (each must be complete) and, with more than one shard, write the index; the weight map."""
        for file in self.files:
            file.close()
        weight_map = self.weight_map()
        if write_index and len(self.files) > 1:
            write_index_file(self.folder, weight_map, total_size=self.total_size)
        return weight_map


def write_index_file(folder: Path, weight_map: dict[str, str], *, total_size: int) -> Path:
    """transformers' `model.safetensors.index.json` in `folder`."""
    path = Path(folder) / INDEX_FILE
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    path.write_text(json.dumps(index, indent=2) + "\n")
    return path


def specs_of(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    """The specs of (name, tensor) pairs (meta tensors welcome)."""
    return [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors]


def _dtype_name(spec: TensorSpec) -> str:
    try:
        return _SAFETENSORS_DTYPES[spec.dtype]
    except KeyError:
        raise CheckpointError(f"tensor {spec.name!r}: dtype {spec.dtype} has no safetensors name") from None
