"""Resolve a model reference (local folder, config.json, hub name) to files.

Hub names go through huggingface_hub, so its cache and `HF_HUB_OFFLINE=1` work as
users expect; only the files asked for are downloaded.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from hfsplit.errors import CheckpointError

_BUNDLED = Path(__file__).resolve().parent.parent / "configs"


def bundled_config_path(name: str) -> Optional[Path]:
    """The config.json bundled with hfsplit for hub name `name`, if any."""
    path = _BUNDLED / (name.replace("/", "--") + ".json")
    return path if path.is_file() else None


def resolve_file(name_or_path: str, filename: str, *, revision: Optional[str] = None) -> Path:
    """Local path of `filename` in a model folder or hub repo (downloads only that file).

    Raises:
        CheckpointError: the folder or repo lacks the file, or the hub cannot be reached.
    """
    path = Path(name_or_path)
    if path.is_dir():
        candidate = path / filename
        if not candidate.is_file():
            raise CheckpointError(f"{candidate}: file not found in the model folder {path}")
        return candidate
    if path.exists() or os.sep in str(name_or_path).strip("/").replace("/", "", 1) or str(name_or_path).startswith((".", "/")):
        raise CheckpointError(f"{name_or_path}: not a model folder; give a folder with config.json or a hub name 'org/model'")
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(str(name_or_path), filename, revision=revision))
    except Exception as exc:  # huggingface_hub raises many types: offline, missing repo, missing file
        raise CheckpointError(
            f"{name_or_path}/{filename}: could not be resolved through the Hugging Face hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "check the name, log in for gated models, or pass a local folder"
        ) from exc


def load_config(model: str | os.PathLike, *, revision: Optional[str] = None):
    """The transformers config of a local folder, a config.json file, or a hub name.

    Well-known hub names whose config.json hfsplit bundles (hfsplit/configs) need no
    network, so planning works offline for them.
    """

    path = Path(model)
    bundled = bundled_config_path(str(model))
    if path.is_file():
        config = _config_from_json(path)
    elif path.is_dir():
        config = _config_from_json(resolve_file(str(path), "config.json"))
    elif bundled is not None and revision is None:
        # The bundled file is the public config.json itself; asking the hub again
        # would only add a network round trip (or retries, when offline).
        config = _config_from_json(bundled)
    else:
        config = _config_from_json(resolve_file(str(model), "config.json", revision=revision))
    config._name_or_path = str(model)
    return config


def _config_from_json(path: Path):
    from transformers import AutoConfig

    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable config.json ({exc})") from exc
    if "model_type" not in data:
        raise CheckpointError(f"{path}: config has no 'model_type'; is this a transformers config.json?")
    model_type = data.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise CheckpointError(f"{path}: model_type {model_type!r} is unknown to transformers ({exc})") from exc
