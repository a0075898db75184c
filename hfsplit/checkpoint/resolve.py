"""Resolve a model reference (local folder, config.json, hub name) to files.

Hub names go through huggingface_hub, so its cache and `HF_HUB_OFFLINE=1` work as
users expect; only the files asked for are downloaded.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse
from typing import Optional

from hfsplit.errors import CheckpointError
from hfsplit.checkpoint.multimodal import Wrapper, is_multimodal, text_config_of
from hfsplit.checkpoint.mxfp4 import without_mxfp4

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
    return hub_file(str(name_or_path), filename, revision=revision)


def hub_file(name: str, filename: str, *, revision: Optional[str] = None) -> Path:
    """`filename` of hub repo `name` through huggingface_hub (its cache, `HF_HUB_OFFLINE`); without a hub to ask
    (offline, or its endpoint unreachable) the cache alone answers at once, instead of a minute of retries."""
    from huggingface_hub import constants, hf_hub_download

    offline = constants.HF_HUB_OFFLINE or not hub_reachable(constants.ENDPOINT)
    try:
        return Path(hf_hub_download(name, filename, revision=revision, local_files_only=offline))
    except Exception as exc:  # huggingface_hub raises many types: offline, missing repo, missing file
        if offline:
            raise CheckpointError(
                f"{name}/{filename}: not in the local hub cache, and the hub is "
                f"{'off (HF_HUB_OFFLINE=1)' if constants.HF_HUB_OFFLINE else 'unreachable'}; names that answer "
                f"offline (bundled configs): {', '.join(bundled_names())}; or pass a local folder") from exc
        raise CheckpointError(
            f"{name}/{filename}: could not be resolved through the Hugging Face hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "check the name, log in for gated models, or pass a local folder"
        ) from exc


def hub_reachable(endpoint: str, *, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub's `endpoint` opens within `timeout` seconds (behind a proxy: assumed,
    the proxy decides)."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                                       "all_proxy")):
        return True
    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
        return True
    except OSError:
        return False


def bundled_names() -> list[str]:
    """The hub names whose config.json hfsplit bundles (hfsplit/configs): they plan with no network."""
    return sorted(path.stem.replace("--", "/") for path in _BUNDLED.glob("*.json"))


def load_config(model: str | os.PathLike, *, revision: Optional[str] = None):
    """The transformers config of a local folder, a config.json file, or a hub name.

    Well-known hub names whose config.json hfsplit bundles (hfsplit/configs) need no
    network, so planning works offline for them. A multimodal checkpoint's config is its language model's
    (`hfsplit.checkpoint.multimodal`).
    """
    config = text_config_of(_config_from_json(_config_file(model, revision)))  # a multimodal one: as its text
    config._name_or_path = str(model)
    return config


def left_out_of(config) -> Optional[dict]:
    """What the checkpoint `config` was read from (its `_name_or_path`, as `load_config` names it) holds beside the
    language model `config` is: a multimodal checkpoint's towers (`Wrapper.left_out`). None for a causal LM's
    checkpoint, or a config read from nowhere (built in code, or its hub file not in the local cache: no network)."""
    name = getattr(config, "_name_or_path", "")
    try:
        stated = _config_from_json(_config_file(name, None, cached=True)) if name else None
    except CheckpointError:
        return None
    if stated is None or not is_multimodal(stated) or text_config_of(stated).model_type != config.model_type:
        return None
    return Wrapper.of(stated).left_out()


def _config_file(model, revision: Optional[str], *, cached: bool = False) -> Path:
    """The config.json of a local folder, a config.json file, or a hub name (bundled: no network; `cached`: the hub's
    local cache only)."""
    path = Path(model)
    bundled = bundled_config_path(str(model))
    if path.is_file():
        return path
    if path.is_dir():
        return resolve_file(str(path), "config.json")
    if bundled is not None and revision is None:
        # The bundled file is the public config.json itself; asking the hub again
        # would only add a network round trip (or retries, when offline).
        return bundled
    if cached:
        from huggingface_hub import try_to_load_from_cache

        try:
            found = try_to_load_from_cache(str(model), "config.json", revision=revision)
        except ValueError:  # no hub name at all (huggingface_hub's validation)
            found = None
        if not isinstance(found, str):
            raise CheckpointError(f"{model}/config.json: not in the local hub cache")
        return Path(found)
    return resolve_file(str(model), "config.json", revision=revision)


def _config_from_json(path: Path):
    from transformers import AutoConfig, PreTrainedConfig

    try:  # transformers' own reading: it decodes the floats JSON cannot hold (Falcon-H1's infinite time_step_limit)
        data = PreTrainedConfig._dict_from_json_file(path)
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable config.json ({exc})") from exc
    if "model_type" not in data:
        raise CheckpointError(f"{path}: config has no 'model_type'; is this a transformers config.json?")
    data = without_mxfp4(data)  # the reader dequantizes MXFP4 experts as it reads them
    model_type = data.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise CheckpointError(f"{path}: model_type {model_type!r} is unknown to transformers ({exc})") from exc
