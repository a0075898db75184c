"""Saving a multimodal checkpoint's language model, fine-tuned as text, in the original checkpoint's terms.

The split holds the language model under its own names (`model.layers.0...`); what it saves names the modules as the
original multimodal class does (`model.language_model.layers.0...`, Llama 4's `language_model.model.layers.0...`),
found by `hfsplit.checkpoint.multimodal.Wrapper`, so:

- the adapter's keys and `target_modules` (a pattern matching the language model's modules only, not the towers'
  projections of the same short names) are what peft applies to the original checkpoint;
- full weights hold the language model's tensors and every other tensor of the original checkpoint (vision or audio
  towers, projectors) read as stored and written unchanged, byte for byte, through the same streaming writer, with
  the original config: the original class loads the folder.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Optional

import torch

from hfsplit.checkpoint.index import optional_file, parameter_to_checkpoint_names, weight_map_of
from hfsplit.checkpoint.multimodal import Wrapper, wrapper_of
from hfsplit.checkpoint.reader import CheckpointReader
from hfsplit.checkpoint.writer import TensorSpec
from hfsplit.errors import CheckpointError
from hfsplit.ship.base import StoredLayout

_PEFT_PREFIX = "base_model.model."


def wrapper_of_source(source: Optional[str]) -> Optional[Wrapper]:
    """The Wrapper of the checkpoint `source` (a folder or hub name) when it is multimodal, else None."""
    return wrapper_of(optional_file(str(source), "config.json", None)) if source else None


class WrappedLayout(StoredLayout):
    """`StoredLayout` whose stored names are the multimodal class's (the language model's tensors inside it)."""

    def __init__(self, config, wrapper: Wrapper):
        super().__init__(config)
        self.wrapper = wrapper

    def pieces(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self.wrapper.name(key): value for key, value in super().pieces(name, tensor).items()}


def adapter_in_wrapper(state: dict[str, torch.Tensor], lora_config, wrapper: Wrapper):
    """(the adapter's tensors under the multimodal model's names, its LoraConfig targeting the language model's
    modules only): peft's `target_modules` pattern is full-matched against module names, so the towers' projections
    of the same short names (a vision tower's `q_proj`) get no adapter."""
    lora_config = copy.deepcopy(lora_config)  # the run's own config keeps the language model's names
    renamed = {_PEFT_PREFIX + wrapper.name(key[len(_PEFT_PREFIX):]): value for key, value in state.items()}
    targets = lora_config.target_modules
    if isinstance(targets, str):  # already a pattern over the language model's names: over the wrapper's now
        return renamed, lora_config
    paths = [theirs.rstrip(".") for _, theirs in wrapper.prefixes]
    inside = "|".join(map(re.escape, paths))
    leaves = "|".join(re.escape(t) for t in sorted(targets))
    whole = [re.escape(p) for p in paths if p.rpartition(".")[2] in targets]  # the head itself targeted
    lora_config.target_modules = "|".join([rf"(?:{inside})\.(?:.*\.)?(?:{leaves})", *whole])
    return renamed, lora_config


class Towers:
    """The original checkpoint's tensors outside the language model, read as stored (dtype and bytes unchanged)."""

    def __init__(self, source: str, wrapper: Wrapper):
        _, weight_map = weight_map_of(str(source), None)
        names, _ = parameter_to_checkpoint_names(weight_map, wrapper.model)
        missing = [name for name in wrapper.tower_names() if name not in names]
        if missing:  # the original class would load the saved folder with these drawn at random
            raise CheckpointError(f"{source}: the checkpoint lacks {len(missing)} tensor(s) of its "
                                  f"{type(wrapper.model).__name__} outside the language model ({missing[0]!r} first); "
                                  "the saved folder would not load as the original")
        self.keys = {name: names[name] for name in wrapper.tower_names()}
        self.source = str(source)

    def specs(self) -> list[TensorSpec]:
        """The towers' tensors under the multimodal class's names, with their stored dtypes and shapes."""
        with self._reader() as reader:
            return [TensorSpec(name, reader.dtype(key), tuple(reader.shape(key))) for name, key in self.keys.items()]

    def write(self, writer) -> None:
        """Every tower tensor into `writer`, one at a time, exactly as stored."""
        with self._reader() as reader:
            for name, key in self.keys.items():
                writer.write(name, reader.read(key))

    def _reader(self) -> CheckpointReader:
        return CheckpointReader.open(self.source, needed=list(self.keys.values()))


def save_config(wrapper: Wrapper, folder: Path) -> None:
    """The original multimodal config (its class and towers as they were) into `folder`."""
    wrapper.config.save_pretrained(folder)
