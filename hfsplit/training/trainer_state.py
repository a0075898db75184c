"""A checkpoint's trainer state read without running code from it: no pickle executes on resume.

A checkpoint folder may come from anywhere (a colleague, a shared drive, the hub), and a resume reads it. What it
reads, and how:

- The small state of each rank (step, LR scheduler, data position, RNG): JSON (`rankNNNNN.json`) and safetensors
  (`rankNNNNN.safetensors`, the tensors: the RNG state). Neither format can hold code. A checkpoint written by an
  older hfsplit holds a pickle (`rankNNNNN.pt`) instead: it is read with `torch.load(weights_only=True)`, torch's
  restricted unpickler (tensors, dicts, lists, numbers, strings only), so a crafted pickle is refused, never run.
- The tensors (weights and optimizer moments): torch.distributed.checkpoint (DCP) files. Their data files hold raw
  tensor bytes (and, for non-tensor values, `torch.load(weights_only=True)` payloads); their `.metadata` file is a
  plain pickle, which torch 2.13's `FileSystemReader.read_metadata` reads with `pickle.load`: any code in it would
  run. `SafeFileSystemReader` reads it with an unpickler that builds only DCP's own metadata classes (the classes of
  `torch.distributed.checkpoint.metadata`, `filesystem._StorageInfo`, `torch.Size`, torch dtypes and layouts, paths)
  and refuses every other global by name.
"""
from __future__ import annotations

import collections
import json
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader

from hfsplit.errors import HfsplitError

TENSOR = "__tensor__"  # a JSON value {"__tensor__": key} stands for the tensor saved under key in the safetensors file
FORMAT = 1


class CheckpointTrustError(HfsplitError):
    """A checkpoint file that would need code run to be read (a pickle with arbitrary globals): refused."""


def small_state_path(folder: Path, rank: int) -> Path:
    """The JSON file of rank `rank`'s small trainer state in a checkpoint's trainer_state folder."""
    return folder / f"rank{rank:05d}.json"


def write_small_state(folder: Path, rank: int, state: dict) -> None:
    """`state` (JSON-able values and tensors, nested in dicts and lists) as JSON beside a safetensors file."""
    tensors: dict[str, torch.Tensor] = {}

    def encode(value, key: str):
        if isinstance(value, torch.Tensor):
            tensors[key] = value.detach().cpu().contiguous()
            return {TENSOR: key}
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise TypeError(f"trainer state {key}: JSON keys must be strings, got {list(value)}")
            return {k: encode(v, f"{key}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [encode(v, f"{key}.{i}") for i, v in enumerate(value)]
        return value

    document = {"format": FORMAT, "state": encode(state, "state")}
    save_file(tensors, str(small_state_path(folder, rank).with_suffix(".safetensors")))
    small_state_path(folder, rank).write_text(json.dumps(document, indent=1))


def read_small_state(path: Path) -> dict:
    """A rank's small trainer state from its JSON file (tensors from the safetensors beside it), or from an older
    hfsplit's pickle (`.pt`) under torch's restricted unpickler; a pickle that needs more is refused in one line."""
    if path.suffix == ".pt":
        return _legacy_state(path)
    try:
        document = json.loads(path.read_text())
        tensors = load_file(str(path.with_suffix(".safetensors")))
    except (OSError, ValueError) as exc:
        raise HfsplitError(f"{path}: unreadable trainer state ({str(exc).splitlines()[0][:120]}); resume from "
                           "another checkpoint") from None

    def decode(value):
        if isinstance(value, dict):
            if set(value) == {TENSOR}:
                return tensors[value[TENSOR]]
            return {k: decode(v) for k, v in value.items()}
        if isinstance(value, list):
            return [decode(v) for v in value]
        return value

    return decode(document["state"])


def _legacy_state(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        culprit = str(exc).split("Unsupported global: ")[-1].split(" was not")[0].replace("GLOBAL ", "").strip()[:120]
        raise CheckpointTrustError(
            f"{path}: this pickled trainer state asks to run {culprit}, which a trainer state never holds; refused "
            "(hfsplit reads pickles only with torch's weights_only unpickler). Resume from a checkpoint you trust, "
            "or one written by this hfsplit (JSON + safetensors)") from None
    except (OSError, EOFError, RuntimeError, ValueError) as exc:
        raise HfsplitError(f"{path}: unreadable trainer state ({type(exc).__name__}); resume from another "
                           "checkpoint") from None


def _metadata_classes() -> dict[tuple[str, str], Any]:
    """(module, name) → object of every global DCP's `.metadata` pickle may name."""
    allowed = {(dcp_metadata.__name__, name): obj for name, obj in vars(dcp_metadata).items() if isinstance(obj, type)
               and obj.__module__ == dcp_metadata.__name__}
    allowed[(dcp_filesystem.__name__, "_StorageInfo")] = dcp_filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed.update({("torch", name): obj for name, obj in vars(torch).items() if isinstance(obj, torch.dtype)})
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # name → torch.strided etc.
    allowed.update({("pathlib", name): getattr(pathlib, name)  # DCP stores its checkpoint id as a path
                    for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")})
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    allowed = _metadata_classes()

    def find_class(self, module: str, name: str):
        if (module, name) not in self.allowed:
            raise CheckpointTrustError(f"{module}.{name}")
        return self.allowed[(module, name)]


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, reading `.metadata` with an unpickler that builds only DCP's own metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
        except OSError as exc:
            raise HfsplitError(f"{path}: unreadable ({exc.strerror or exc}); the checkpoint is incomplete — "
                               "resume from an earlier one") from None
        except CheckpointTrustError as exc:
            raise CheckpointTrustError(
                f"{path}: this checkpoint's DCP metadata asks to run {exc}, which DCP metadata never holds; refused. "
                "Resume from a checkpoint you trust") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
            raise HfsplitError(f"{path}: corrupt DCP metadata ({type(exc).__name__}); resume from another "
                               "checkpoint") from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointTrustError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata; refused")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
