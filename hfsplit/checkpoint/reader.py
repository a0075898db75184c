"""Lazy safetensors reader: index → shard → tensor, or one tensor-parallel slice of it.

Only the shards that hold needed tensors are resolved (downloaded, for hub names) and
opened; only the bytes of the tensors asked for are read.

Headers are parsed and validated with `safetensors.safe_open` (its checks of offsets
and file size are stricter than ours would be), but the bytes themselves are read with
`os.preadv` straight into the destination tensor. Measured on a 64 MiB fp32 tensor:
a 16 MiB column slice through `get_slice` raised peak RSS by ~84 MiB with the mmap
backend (every page of the memory map is faulted in and stays mapped) and ~81 MiB with
safetensors' pread backend (it reads the whole tensor), while preads of bounded row
chunks cost the slice plus one chunk. Full reads into a fresh tensor likewise cost 1×
instead of the mmap's 2× (mapped pages + copy).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterable, Optional, Union

import torch

from hfsplit.budget import torch_device
from hfsplit.checkpoint.index import (
    TensorEntry, meta_state, optional_file, parameter_to_checkpoint_names, persistent_state_names, read_header,
    text_checkpoint_names, weight_map_of,
)
from hfsplit.checkpoint.merged import MergedTensor
from hfsplit.checkpoint.multimodal import wrapper_of
from hfsplit.checkpoint.mxfp4 import (
    DEQUANTIZED_DTYPE, PackedExperts, dequantize_expert, dequantized_shape, packed_experts,
)
from hfsplit.checkpoint.resolve import resolve_file
from hfsplit.errors import CheckpointError

# Bytes of file read per pread when a tensor is cast, sliced by columns, or sent to a
# device: bounds the host RAM a read needs beyond its result.
CHUNK_BYTES = 8 * 2**20
# A column slice whose contiguous runs are at least this long is read run by run (one pread each, straight into
# the result) rather than by whole rows: an expert's rows of a fused [E, 2I, H] tensor.
RUN_BYTES = 4096

Device = Union[str, int, torch.device]


class CheckpointReader:
    """Reads tensors (or TP slices) of a safetensors checkpoint by model parameter name.

    Build it with `CheckpointReader.open(...)`, which validates everything needed before
    returning. Names are the model's parameter names (`model.layers.0.mlp.up_proj.weight`);
    checkpoint names differ only where transformers renames on load, or for tied weights.
    """

    def __init__(self, source: str, weight_map: dict[str, str], names: dict[str, str],
                 revision: Optional[str] = None, layout_file: Optional[Path] = None,
                 merged: Optional[dict[str, MergedTensor]] = None, mxfp4: Optional[dict[str, PackedExperts]] = None):
        self.source = source
        self.revision = revision
        self.layout_file = layout_file  # the index, or the single file: where tensor names come from
        self._weight_map = weight_map  # checkpoint name → shard file name
        self._names = names  # model name → checkpoint name
        self._merged = merged or {}  # model name → the checkpoint tensors transformers merges into it on load
        self._mxfp4 = mxfp4 or {}  # model name → its MXFP4 blocks and scales (gpt-oss experts), dequantized as read
        self._paths: dict[str, Path] = {}
        self._headers: dict[str, dict[str, TensorEntry]] = {}
        self._fds: dict[Path, int] = {}
        self._mapped_files: dict[str, object] = {}  # safe_open handles backing `mapped` views

    # ---- building -------------------------------------------------------------------

    @classmethod
    def open(cls, name_or_path: Union[str, os.PathLike], *, needed: Optional[Iterable[str]] = None,
             model: Optional[torch.nn.Module] = None, revision: Optional[str] = None) -> "CheckpointReader":
        """Open a checkpoint and validate the tensors that will be read.

        Args:
            name_or_path: a local model folder or a hub name ("org/model").
            needed: model parameter names that will be read; only their shards are resolved
                and opened. None means every tensor (every parameter of `model`, when given).
            model: the model (usually on the meta device) the tensors are for; gives the
                checkpoint → parameter renames transformers applies, tied weights, and the
                shapes and dtypes to check against.
            revision: hub revision.

        Raises:
            CheckpointError: missing index/shard/tensor, a corrupt shard header, or a tensor
                whose shape or kind of dtype disagrees with the model.
        """
        source = str(name_or_path)
        layout_file, weight_map = weight_map_of(source, revision)
        wrapper = wrapper_of(optional_file(source, "config.json", revision)) if model is not None else None
        if wrapper is not None:  # a multimodal checkpoint: its language model's tensors only, towers never opened
            names, merged, weight_map = text_checkpoint_names(wrapper, weight_map, model)
        else:
            names, merged = parameter_to_checkpoint_names(weight_map, model)
        try:
            mxfp4 = packed_experts(weight_map, persistent_state_names(model)) if model is not None else {}
        except CheckpointError as exc:
            raise CheckpointError(f"{layout_file}: {exc}") from None
        reader = cls(source, weight_map, names, revision, layout_file, merged, mxfp4)
        wanted = set(needed) if needed is not None else (
            set(names) | set(merged) | set(mxfp4) | set(persistent_state_names(model)) if model is not None
            else set(names))
        reader._validate(wanted, model)
        return reader

    # ---- queries ----------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Model parameter names this checkpoint provides (tied aliases included)."""
        return sorted({*self._names, *self._merged, *self._mxfp4})

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's key for model parameter `name`."""
        try:
            return self._names[name]
        except KeyError:
            raise CheckpointError(f"{self._where()}: no tensor {name!r} in the checkpoint") from None

    def shard_of(self, name: str) -> str:
        """File name of the shard holding `name` (of its first stored piece, for a merged tensor)."""
        return self._weight_map[self._keys_of(name)[0]]

    def shards_for(self, names: Iterable[str]) -> set[str]:
        """File names of the shards holding `names` (every piece of a merged tensor)."""
        return {self._weight_map[key] for n in names for key in self._keys_of(n)}

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._mxfp4:
            return dequantized_shape(self._key_entry(self._mxfp4[name].blocks).shape)
        if name in self._merged:
            return tuple(self._merged_meta(name).shape)
        return self._entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        if name in self._mxfp4:
            return DEQUANTIZED_DTYPE
        if name in self._merged:
            return self._merged_meta(name).dtype
        return self._entry(name).dtype

    def nbytes(self, name: str) -> int:
        return sum(entry.stop - entry.start for entry in map(self._key_entry, self._keys_of(name)))

    # ---- reading ----------------------------------------------------------------------

    def read(self, name: str, dtype: Optional[torch.dtype] = None, device: Device = "cpu") -> torch.Tensor:
        """Tensor `name` as a fresh tensor of `dtype` (default: as stored) on `device`.

        Host RAM beyond the result: at most one CHUNK_BYTES buffer (none for a CPU read in
        the stored dtype, which lands directly in the result).
        """
        if name in self._merged or name in self._mxfp4:  # each stored piece read into its place of the merged tensor
            out = torch.empty(self.shape(name), dtype=dtype or self.dtype(name), device=torch_device(device))
            return self._merge_into(name, out)
        entry = self._entry(name)
        out = torch.empty(entry.shape, dtype=dtype or entry.dtype, device=torch_device(device))
        self._fill_rows(entry, out, name)
        return out

    def mapped(self, name: str) -> torch.Tensor:
        """Tensor `name` as a copy-on-write view of the memory-mapped file (CPU, stored dtype).

        Nothing is copied: pages come from the page cache as they are touched, as
        transformers' own CPU loading does. Writes stay private to this process.
        """
        from safetensors import safe_open

        if name in self._merged or name in self._mxfp4:  # no single view of the file holds it
            return self.read(name)
        entry = self._entry(name)
        path = str(entry.file)
        handle = self._mapped_files.get(path)
        if handle is None:
            handle = self._mapped_files[path] = safe_open(path, framework="pt")
        return handle.get_slice(self.checkpoint_name(name))[:]

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Copy tensor `name` into `out` (any device and floating dtype; shape must match)."""
        if name in self._merged or name in self._mxfp4:
            if tuple(out.shape) != self.shape(name):
                raise CheckpointError(f"{self._where()}: merged tensor {name!r} has shape {list(self.shape(name))}, "
                                      f"the destination {list(out.shape)}")
            return self._merge_into(name, out)
        entry = self._entry(name)
        if tuple(out.shape) != entry.shape:
            raise CheckpointError(
                f"{entry.file}: tensor {self.checkpoint_name(name)!r} has shape {list(entry.shape)}, "
                f"the destination {list(out.shape)}")
        self._fill_rows(entry, out, name)
        return out

    def read_expert_into(self, name: str, expert: int, out: torch.Tensor) -> torch.Tensor:
        """Copy `tensor[expert]` of a fused expert tensor `name` (`[E, d1, d2]`) into `out` (`[d1, d2]`, any device and
        floating dtype), reading that expert's bytes only: its stored pieces where the checkpoint stores the experts
        one by one (merged on load), its MXFP4 blocks and scales dequantized (gpt-oss), else its rows of the stored
        fused tensor."""
        shape = self.shape(name)
        if tuple(out.shape) != tuple(shape[1:]) or not 0 <= expert < shape[0]:
            raise CheckpointError(f"{self._where()}: expert {expert} of tensor {name!r} {list(shape)} does not fit "
                                  f"the destination {list(out.shape)}")
        if name in self._mxfp4:
            return self._dequantize_expert_into(self._mxfp4[name], expert, out)
        if name not in self._merged:
            entry = self._entry(name)
            size = math.prod(shape[1:]) * entry.dtype.itemsize
            begin = entry.start + expert * size
            self._fill_rows(TensorEntry(entry.file, entry.dtype, tuple(shape[1:]), begin, begin + size), out, name)
            return out
        placed = self._merged[name].placement(lambda key: self._key_entry(key).shape)
        if placed is None:  # a merge other than stack-then-concatenate: merged whole, as transformers does
            return out.copy_(self.read(name, dtype=out.dtype)[expert])
        for key, index, dim, start in placed:
            if index == expert:
                entry = self._key_entry(key)
                view = out.narrow(dim, start, entry.shape[dim])
                if view.is_contiguous():
                    self._fill_rows(entry, view, key)
                else:
                    view.copy_(self._read_key(key))
        return out

    def read_slice(self, name: str, dim: int, index: int, parts: int, dtype: Optional[torch.dtype] = None,
                   device: Device = "cpu", *, packed: int = 1) -> torch.Tensor:
        """Part `index` of `parts` equal parts of tensor `name` along `dim` (a TP shard).

        dim=0 takes rows (contiguous bytes); dim>=1 takes columns: each run of at least a page is one pread
        (an expert's rows of a fused `[E, 2I, H]` tensor), shorter ones are read in row chunks of at most
        CHUNK_BYTES, so host RAM stays at the slice plus one chunk. A tensor merged on load from stored pieces
        (MoE experts) is read piece by piece, each piece's slice only.

        Args:
            name: model parameter name.
            dim: dimension to split.
            index: which part, 0-based.
            parts: the number of parts (the TP degree); must divide `shape[dim]`.
            dtype: result dtype (default: as stored).
            device: result device.
            packed: `dim` holds this many equal blocks (fused experts' gate and up halves), each split in
                `parts`; the result is part `index` of every block, in order (transformers' packed column-wise
                layout).
        """
        shape = self.shape(name)
        if not 0 <= dim < len(shape):
            raise ValueError(f"read_slice({name!r}): dim {dim} out of range for shape {list(shape)}")
        if not 0 <= index < parts:
            raise ValueError(f"read_slice({name!r}): index {index} not in [0, {parts})")
        if shape[dim] % (parts * packed):
            what = f"{packed} packed blocks of " if packed > 1 else ""
            raise CheckpointError(
                f"{self._where()}: tensor {name!r} has {shape[dim]} entries along dim {dim}, not divisible into "
                f"{what}{parts} tensor-parallel parts; choose a TP degree that divides {shape[dim] // packed}")
        step = shape[dim] // (parts * packed)
        ranges = [(block * step * parts + index * step, step) for block in range(packed)]
        out_shape = list(shape)
        out_shape[dim] = step * packed
        out = torch.empty(out_shape, dtype=dtype or self.dtype(name), device=torch_device(device))
        if name in self._merged or name in self._mxfp4:
            return self._merged_slice_into(name, dim, ranges, out)
        self._read_ranges(self._entry(name), dim, ranges, out, name)
        return out

    def packed_state_keys(self, name: str) -> list[str]:
        """Checkpoint keys of the bitsandbytes quant state stored beside weight `name` (4-bit: absmax, quant_map,
        `quant_state.bitsandbytes__nf4`, ...; 8-bit: the layer's `SCB` and `weight_format`): empty unless the
        checkpoint stores `name` pre-quantized."""
        if not hasattr(self, "_packed"):
            weights = {k.split(".quant_state.bitsandbytes__")[0] for k in self._weight_map if ".quant_state.bitsandbytes__" in k}
            self._packed = {w: sorted(k for k in self._weight_map if k.startswith(w + ".")) for w in weights}
            layers = {k[:-len(".SCB")] for k in self._weight_map if k.endswith(".SCB")}  # 8-bit: state on the layer
            self._packed.update({f"{w}.weight": [f"{w}.{s}" for s in ("SCB", "weight_format") if f"{w}.{s}" in self._weight_map]
                                 for w in layers})
        return self._packed.get(self._names.get(name, name), [])

    def read_packed(self, name: str, device: Device = "cpu") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Pre-quantized weight `name` as stored (packed bytes) and its quant state {key suffix: tensor}: the
        `quantized_stats` bitsandbytes' `Params4bit.from_prequantized` takes, or an 8-bit layer's {"SCB", ...}."""
        stats = {}
        for key in self.packed_state_keys(name):
            entry = self._header(self._weight_map[key])[key]
            owner = self.checkpoint_name(name)
            suffix = key[len(owner) + 1:] if key.startswith(owner + ".") else key.rsplit(".", 1)[-1]  # 8-bit: the layer's
            stats[suffix] = out = torch.empty(entry.shape, dtype=entry.dtype)
            self._fill_rows(entry, out, key)
        return self.read(name, device=device), stats

    def close(self) -> None:
        """Close the open shard files."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- internals --------------------------------------------------------------------

    def _where(self) -> str:
        if self.layout_file is not None:
            return str(self.layout_file)
        return self.source if self.revision is None else f"{self.source}@{self.revision}"

    def _validate(self, wanted: set[str], model: Optional[torch.nn.Module]) -> None:
        """Raise CheckpointError for the first problem among the `wanted` tensors."""
        missing = sorted(n for n in wanted if n not in self._names and n not in self._merged and n not in self._mxfp4)
        if missing:
            what = f"{type(model).__name__} needs" if model is not None else "was asked for"
            shown = ", ".join(repr(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise CheckpointError(
                f"{self._where()}: the checkpoint lacks tensor(s) {shown} that {what}; "
                "is the checkpoint complete and of the same architecture as config.json?")
        for shard in sorted(self.shards_for(wanted)):
            try:
                self._header(shard)
            except CheckpointError as exc:
                held = sorted(n for n in wanted if self.shard_of(n) == shard)
                more = f" and {len(held) - 3} more" if len(held) > 3 else ""
                raise CheckpointError(f"{exc}; it holds needed tensor(s) {', '.join(map(repr, held[:3]))}{more}") from exc
        params = meta_state(model) if model is not None else {}
        for name in sorted(wanted):
            shape, dtype = self.shape(name), self.dtype(name)
            ref = params.get(name)
            if ref is None or self.packed_state_keys(name):  # packed by bitsandbytes: its quant state has the shape
                continue
            where = (f"{self._where()}: tensor {name!r} merged on load from {len(self._keys_of(name))} stored tensors"
                     if name in self._merged else
                     f"{self._where()}: MXFP4 tensor {name!r} ({self._mxfp4[name].blocks!r})" if name in self._mxfp4
                     else f"{self._entry(name).file}: tensor {self.checkpoint_name(name)!r}")
            if shape != tuple(ref.shape):
                raise CheckpointError(
                    f"{where} has shape {list(shape)} but the config gives {name!r} shape "
                    f"{list(ref.shape)}; the checkpoint and config.json disagree")
            if ref.is_floating_point() != dtype.is_floating_point:
                raise CheckpointError(
                    f"{where} has dtype {dtype} but {name!r} is {ref.dtype}; "
                    "a floating-point parameter cannot be loaded from an integer tensor (or the reverse)")

    def _path(self, shard: str) -> Path:
        if shard not in self._paths:
            local = Path(self.source) / shard
            if Path(self.source).is_dir() and not local.is_file():
                raise CheckpointError(
                    f"{local}: shard file not found, though {self._where()} names it (incomplete download or "
                    "copy?); re-download or copy the whole checkpoint folder")
            self._paths[shard] = resolve_file(self.source, shard, revision=self.revision)
        return self._paths[shard]

    def _header(self, shard: str) -> dict[str, TensorEntry]:
        if shard not in self._headers:
            self._headers[shard] = read_header(self._path(shard))
        return self._headers[shard]

    def _entry(self, name: str) -> TensorEntry:
        return self._key_entry(self.checkpoint_name(name))

    def _key_entry(self, key: str) -> TensorEntry:
        shard = self._weight_map[key]
        header = self._header(shard)
        if key not in header:
            raise CheckpointError(
                f"{self._path(shard)}: the index places tensor {key!r} in this shard but the shard lacks it; "
                "the index and shards are out of step (re-download or re-save the checkpoint)")
        return header[key]

    def _keys_of(self, name: str) -> list[str]:
        """The checkpoint keys model tensor `name` is read from (several for a merged or an MXFP4 tensor)."""
        if name in self._mxfp4:
            return self._mxfp4[name].keys()
        return self._merged[name].keys() if name in self._merged else [self.checkpoint_name(name)]

    def _read_key(self, key: str) -> torch.Tensor:
        entry = self._key_entry(key)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self._fill_rows(entry, out, key)
        return out

    def _merge_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Merged tensor `name` into `out`: each piece pread into its slice (no host copy beyond a cast chunk),
        or, for merges other than stack-then-concatenate, transformers' operations on the pieces read; MXFP4 experts
        dequantized one by one."""
        if name in self._mxfp4:
            return self._dequantize_into(self._mxfp4[name], out)
        merged = self._merged[name]
        placed = merged.placement(lambda key: self._key_entry(key).shape) or []
        slices = [(key, out[index].narrow(dim, start, self._key_entry(key).shape[dim])) for key, index, dim, start in placed]
        if not slices or not all(view.is_contiguous() for _, view in slices):
            return out.copy_(merged.merge(self._read_key))
        for key, view in slices:
            self._fill_rows(self._key_entry(key), view, key)
        return out

    def _dequantize_into(self, packed: PackedExperts, out: torch.Tensor) -> torch.Tensor:
        """MXFP4 tensor `packed` into `out` `[E, in, out]`, one expert at a time (`_dequantize_expert_into`), its
        packed bytes read into one pair of host buffers that every expert reuses."""
        staging = self._expert_staging(packed)
        for expert in range(out.shape[0]):
            self._dequantize_expert_into(packed, expert, out[expert], staging=staging)
        return out

    def _dequantize_expert_into(self, packed: PackedExperts, expert: int, out: torch.Tensor, *,
                                staging: Optional[list[torch.Tensor]] = None) -> torch.Tensor:
        """Expert `expert` `[in, out]` of MXFP4 tensor `packed` into `out`: its blocks and scales read alone (into
        `staging`, host buffers of one expert's) and dequantized on `out`'s device by transformers' dequantizer, in
        `out`'s dtype."""
        staging = staging or self._expert_staging(packed)
        pieces = [self._expert_bytes(self._key_entry(key), key, expert, buffer).to(out.device)
                  for key, buffer in zip(packed.keys(), staging)]
        return out.copy_(dequantize_expert(*pieces, dtype=out.dtype))

    def _expert_staging(self, packed: PackedExperts) -> list[torch.Tensor]:
        entries = [self._key_entry(key) for key in packed.keys()]
        return [torch.empty(entry.shape[1:], dtype=entry.dtype) for entry in entries]

    def _expert_bytes(self, entry: TensorEntry, key: str, expert: int, out: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s slice (dim 0) of stored tensor `entry`, as stored, into `out` (host memory)."""
        size = (entry.stop - entry.start) // entry.shape[0]
        begin = entry.start + expert * size
        self._fill_rows(TensorEntry(entry.file, entry.dtype, entry.shape[1:], begin, begin + size), out, key)
        return out

    def _merged_meta(self, name: str) -> torch.Tensor:
        """Merged tensor `name` on the meta device: its shape and dtype, from the stored pieces' headers."""
        def meta(key: str) -> torch.Tensor:
            entry = self._key_entry(key)
            return torch.empty(entry.shape, dtype=entry.dtype, device="meta")

        merged = self._merged[name]
        try:
            return merged.merge(meta)
        except (RuntimeError, ValueError) as exc:  # pieces that do not stack or concatenate: an expert is missing
            counts = ", ".join(f"{len(keys)} × {pattern.strip('.')}" for pattern, keys in merged.sources.items())
            raise CheckpointError(
                f"{self._where()}: tensor {name!r} is merged on load from {counts}, which do not merge ({exc}); "
                "is the checkpoint complete and of the same architecture as config.json?") from None

    def _merged_slice_into(self, name: str, dim: int, ranges: list[tuple[int, int]], out: torch.Tensor) -> torch.Tensor:
        """`ranges` of merged tensor `name` along `dim` into `out`, each stored piece's part read alone (no piece,
        nor the merged tensor, is read whole); merges other than stack-then-concatenate (and MXFP4 tensors) merge
        first, then slice."""
        merged = self._merged.get(name)
        placed = merged.placement(lambda key: self._key_entry(key).shape) if dim >= 1 and merged else None
        if placed is None:
            full = self.read(name, dtype=out.dtype)
            return out.copy_(torch.cat([full.narrow(dim, first, n) for first, n in ranges], dim))
        for key, expert, piece_dim, start in placed:
            entry = self._key_entry(key)
            self._piece_slice_into(entry, key, out[expert], dim - 1, ranges, piece_dim=piece_dim, start=start)
        return out

    def _piece_slice_into(self, entry: TensorEntry, key: str, dest: torch.Tensor, dim: int,
                          ranges: list[tuple[int, int]], *, piece_dim: int, start: int) -> None:
        """One stored piece's share of `ranges` (of the merged dim `dim`) into `dest`, the merged tensor's slice at
        the piece's index; the piece lands at `start` along `piece_dim` of the merged tensor."""
        def read(sub_ranges):
            part = list(entry.shape)
            part[dim] = sum(n for _, n in sub_ranges)
            tmp = torch.empty(part, dtype=dest.dtype)
            self._read_ranges(entry, dim, sub_ranges, tmp, key)
            return tmp

        if piece_dim != dim:  # the piece spans the sliced dim whole: take every range of it
            dest.narrow(piece_dim, start, entry.shape[piece_dim]).copy_(read(ranges))
            return
        local = 0
        for first, n in ranges:  # the piece covers [start, start + its length) of the sliced dim
            lo, hi = max(first, start), min(first + n, start + entry.shape[dim])
            if lo < hi:
                dest.narrow(dim, local + lo - first, hi - lo).copy_(read([(lo - start, hi - lo)]))
            local += n

    def _read_ranges(self, entry: TensorEntry, dim: int, ranges: list[tuple[int, int]], out: torch.Tensor,
                     name: str) -> None:
        """`ranges` [(first, length), ...] of `entry` along `dim`, concatenated, into `out` (contiguous)."""
        outer, size = math.prod(entry.shape[:dim]), entry.shape[dim]
        inner = math.prod(entry.shape[dim + 1:])
        item = entry.dtype.itemsize
        view = out.view(outer, sum(n for _, n in ranges), inner)
        if outer > 1 and min(n for _, n in ranges) * inner * item < RUN_BYTES:  # short runs: whole rows, chunked
            self._fill_columns(entry, view, ranges, size, inner)
            return
        for row in range(outer):  # each (row, range) is one contiguous run of the file and of `out`
            local = 0
            for first, n in ranges:
                begin = entry.start + (row * size + first) * inner * item
                sub = TensorEntry(entry.file, entry.dtype, (n * inner,), begin, begin + n * inner * item)
                self._fill_rows(sub, view[row, local:local + n], name)
                local += n

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def _fill_rows(self, entry: TensorEntry, out: torch.Tensor, name: str) -> None:
        """Copy the contiguous bytes of `entry` into `out`, CHUNK_BYTES at a time when casting."""
        if not out.is_contiguous():
            raise ValueError("read_into needs a contiguous destination tensor")
        fd = self._fd(entry.file)
        if out.device.type == "cpu" and out.dtype == entry.dtype and out.is_contiguous():
            _pread_into(fd, _bytes_of(out), entry.start, entry.file)
            return
        item = entry.dtype.itemsize
        flat = out.view(-1)
        per_chunk = max(CHUNK_BYTES // item, 1)
        buffer = torch.empty(min(per_chunk, max(flat.numel(), 1)), dtype=entry.dtype)
        for first in range(0, flat.numel(), per_chunk):
            count = min(per_chunk, flat.numel() - first)
            part = buffer[:count]
            _pread_into(fd, _bytes_of(part), entry.start + first * item, entry.file)
            flat[first:first + count].copy_(part)

    def _fill_columns(self, entry: TensorEntry, out: torch.Tensor, ranges: list[tuple[int, int]], size: int,
                      inner: int) -> None:
        """Fill `out` (outer, Σ length, inner) from the column `ranges` [(first, length), ...] of entry viewed
        (outer, size, inner)."""
        fd = self._fd(entry.file)
        row_bytes = size * inner * entry.dtype.itemsize
        rows_per_chunk = max(CHUNK_BYTES // row_bytes, 1)
        outer = out.shape[0]
        buffer = torch.empty(min(rows_per_chunk, outer) * size * inner, dtype=entry.dtype)
        for row in range(0, outer, rows_per_chunk):
            count = min(rows_per_chunk, outer - row)
            part = buffer[:count * size * inner]
            _pread_into(fd, _bytes_of(part), entry.start + row * row_bytes, entry.file)
            rows, local = part.view(count, size, inner), 0
            for first, n in ranges:
                out[row:row + count, local:local + n].copy_(rows[:, first:first + n])
                local += n


# ---- bytes ------------------------------------------------------------------------------


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(bytearray())


def _pread_into(fd: int, buffer: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if got == 0:
            raise CheckpointError(f"{path}: file ends early at byte {offset + done}; the shard is truncated")
        done += got
