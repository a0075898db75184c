"""Multimodal checkpoints (a vision or audio model around a language model), fine-tuned as their language model.

`load_config` hands every part of hfsplit the language model's config (`config.get_text_config()`), so planning,
the proof and the stages see a plain causal LM. Only two places know the checkpoint is wider:

- reading: the language model's parameter names are mapped onto the multimodal class's (where its decoder and head
  sit, found by module type on the meta device), then onto the checkpoint's keys by transformers' own conversion
  mapping for that class (legacy `language_model.model.*` or current `model.language_model.*` layouts alike). Only
  those keys are kept, so the towers are never opened, read, nor counted.
- saving: adapters and weights are written under the multimodal class's module names, so peft applies the adapter
  to the original checkpoint and the original class loads the full weights, whose towers are copied unchanged.
"""
from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from hfsplit.errors import CheckpointError


def is_multimodal(config) -> bool:
    """Whether `config` wraps a language model's config with other towers (vision, audio)."""
    get = getattr(config, "get_text_config", None)
    return get is not None and get() is not config and getattr(config, "text_config", None) is not None


def text_config_of(config):
    """The language model's config of a multimodal `config` (`config` itself otherwise): its dtype inherited when it
    has none, and its head tied exactly when the multimodal class ties it (Mistral 3 ties by the outer flag)."""
    if not is_multimodal(config):
        return config
    text = copy.deepcopy(config.get_text_config())
    if getattr(text, "dtype", None) is None and getattr(config, "dtype", None) is not None:
        text.dtype = config.dtype
    wrapper = Wrapper.of(config)
    text.tie_word_embeddings = wrapper.head_tied()
    return text


def multimodal_class(config) -> type:
    """The transformers class of a multimodal `config`: the checkpoint's own architecture when transformers has it,
    else the class transformers maps its model type to (image-text-to-text, then causal LM)."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    for name in [*(getattr(config, "architectures", None) or [])[:1],
                 auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(config.model_type),
                 auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)]:
        if name and hasattr(transformers, name):
            return getattr(transformers, name)
    raise CheckpointError(f"model_type {config.model_type!r}: transformers has no class that builds this multimodal "
                          "checkpoint")


@dataclass
class Wrapper:
    """A multimodal model on the meta device and where its language model's parameters sit in it.

    Args:
        config: the multimodal config.
        model: its class built on the meta device (names, shapes, tied weights; no memory).
        text: the language model's causal LM on the meta device.
        prefixes: (prefix in `text`, the same module's prefix in `model`), the longest first.
    """

    config: object
    model: nn.Module
    text: nn.Module
    prefixes: list[tuple[str, str]]

    @classmethod
    def of(cls, config) -> "Wrapper":
        """The Wrapper of `config`, built once per process and config (a flagship's meta build takes seconds, and
        `load_config`, the reader and the save each ask)."""
        return _wrapper_of_json(config.to_json_string(use_diff=False))

    def name(self, text_name: str) -> str:
        """The multimodal model's name for the language model's parameter `text_name`."""
        for ours, theirs in self.prefixes:
            if text_name.startswith(ours):
                return theirs + text_name[len(ours):]
        raise CheckpointError(f"{type(self.model).__name__}: the language model's {text_name!r} has no place in it")

    def head_tied(self) -> bool:
        """Whether the multimodal class ties its output head to the input embedding."""
        head = self.name(_path_of(self.text, self.text.get_output_embeddings()) + ".weight")
        return head in (getattr(self.model, "all_tied_weights_keys", None) or {})

    def text_names(self) -> dict[str, str]:
        """{the language model's state name: the multimodal model's}, every one checked to exist with its shape."""
        theirs = self.model.state_dict(keep_vars=True)
        out = {}
        for name, tensor in self.text.state_dict(keep_vars=True).items():
            mapped = self.name(name)
            if mapped not in theirs or tuple(theirs[mapped].shape) != tuple(tensor.shape):
                raise CheckpointError(f"{type(self.model).__name__}: the language model's {name!r} maps to "
                                      f"{mapped!r}, which it lacks or shapes otherwise")
            out[name] = mapped
        return out

    def tower_names(self) -> list[str]:
        """The multimodal model's state names outside the language model (vision/audio towers, projectors)."""
        inside = set(self.text_names().values())
        tied = getattr(self.model, "all_tied_weights_keys", None) or {}
        return [n for n in self.model.state_dict() if n not in inside and n not in tied]

    def left_out(self) -> dict:
        """{"checkpoint": the multimodal model_type, "modules": the outermost modules holding none of the language
        model's tensors (`model.vision_tower`, `model.multi_modal_projector`), "parameters": their parameters in all}:
        what fine-tuning the language model neither plans, loads nor trains, and a full save copies unchanged."""
        around = {".".join(parts[:i]) for parts in (n.split(".") for n in self.text_names().values())
                  for i in range(1, len(parts))}
        modules = list(dict.fromkeys(_outermost(name, around) for name in self.tower_names()))
        count = sum(p.numel() for name, p in self.model.named_parameters()
                    if any(name == m or name.startswith(m + ".") for m in modules))
        return {"checkpoint": self.config.model_type, "modules": modules, "parameters": count}


@functools.lru_cache(maxsize=8)
def _wrapper_of_json(text: str) -> Wrapper:
    from transformers import AutoConfig, AutoModelForCausalLM

    data = json.loads(text)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    kind = config.get_text_config().model_type
    with torch.device("meta"):
        model = multimodal_class(config)(config)
        try:
            language = AutoModelForCausalLM.from_config(config.get_text_config())
        except ValueError as error:  # no causal LM registered for the text model type
            raise CheckpointError(f"model_type {config.model_type!r}: its language model ({kind!r}) has no causal-LM "
                                  f"class in transformers ({str(error).splitlines()[0][:120]}); hfsplit fine-tunes "
                                  "a multimodal checkpoint as its language model only") from None
    return Wrapper(config, model, language, _prefixes(model, language))


def _prefixes(model: nn.Module, text: nn.Module) -> list[tuple[str, str]]:
    """Where `text`'s modules sit in `model`: the whole causal LM when `model` holds one (Llama 4), else its decoder
    and its output head (Gemma 3, Mistral 3, Qwen3.5: `model.language_model`, `lm_head`)."""
    whole = _path_of_type(model, type(text))
    if whole is not None:
        return [("", whole + ".")]
    decoder = _path_of(text, text.get_decoder())
    inside = _path_of_type(model, type(text.get_decoder()))
    if inside is None or model.get_output_embeddings() is None:
        raise CheckpointError(f"{type(model).__name__}: found no {type(text.get_decoder()).__name__} in it; hfsplit "
                              "fine-tunes the language model of a multimodal checkpoint only where it finds it")
    head = _path_of(text, text.get_output_embeddings())
    pairs = [(head + ".", _path_of(model, model.get_output_embeddings()) + "."), (decoder + ".", inside + ".")]
    return sorted(pairs, key=lambda pair: -len(pair[0]))


def _outermost(name: str, around: set[str]) -> str:
    """The shortest prefix of the state name `name` that is no module around the language model's tensors."""
    parts = name.split(".")
    return next(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) not in around)


def _path_of(root: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in root.named_modules() if m is module)


def _path_of_type(root: nn.Module, kind: type) -> Optional[str]:
    return next((name for name, m in root.named_modules() if type(m) is kind and name), None)


# ---- the checkpoint --------------------------------------------------------------------------------------------


def raw_config(path: Optional[Path]):
    """The config as a checkpoint's config.json at `path` states it (multimodal or not); None without one."""
    from transformers import AutoConfig, PreTrainedConfig

    try:  # transformers' own reading: it decodes the floats JSON cannot hold (Falcon-H1's infinite time_step_limit)
        data = PreTrainedConfig._dict_from_json_file(path)
        return AutoConfig.for_model(data.pop("model_type"), **data)
    except (TypeError, OSError, ValueError, KeyError):
        return None


def wrapper_of(config_file: Optional[Path]) -> Optional[Wrapper]:
    """The Wrapper of the checkpoint whose config.json is `config_file` when it is multimodal, else None."""
    config = raw_config(config_file) if config_file is not None else None
    return Wrapper.of(config) if config is not None and is_multimodal(config) else None
