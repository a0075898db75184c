"""The base checkpoint of a merge, read one tensor at a time: 16-bit as stored, bitsandbytes 4-bit and 8-bit weights
dequantized as transformers dequantizes them, MoE experts fused as the model holds them (the lazy reader merges the
stored pieces), and the way back to the layout `save_pretrained` writes (`stored_pieces`).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Optional

import torch

from hfsplit.checkpoint.reader import CheckpointReader
from hfsplit.checkpoint.resolve import load_config
from hfsplit.checkpoint.writer import TensorSpec
from hfsplit.errors import CheckpointError
from hfsplit.models.layout import meta_model, one_layer_config

_QUANT_STATE = ".quant_state.bitsandbytes__"


@dataclass
class BaseCheckpoint:
    """An open base checkpoint: its config, the model on the meta device, the reader, and its quantization method
    (None, "bitsandbytes"; a `gguf` label over float tensors reads as plain)."""

    source: str
    config: object
    model: torch.nn.Module
    reader: CheckpointReader
    quant_method: Optional[str]
    _state_keys: Optional[set[str]] = None

    def names(self) -> list[str]:
        """Model tensor names to write, in the model's order: tied aliases and bitsandbytes quant state left out."""
        keys = set(self.reader.keys())
        kept = [n for n in keys if not self._is_quant_state(n) and not self._alias(n, keys)]
        order = {name: i for i, name in enumerate(self.model.state_dict(keep_vars=True))}
        return sorted(kept, key=lambda n: (order.get(n, len(order)), n))

    def _alias(self, name: str, keys: set[str]) -> bool:
        """Whether `name` is read from another model tensor's stored key (`lm_head.weight` of tied embeddings)."""
        try:
            key = self.reader.checkpoint_name(name)
        except CheckpointError:  # merged on load from several stored tensors (MoE experts): no alias
            return False
        return key != name and key in keys

    def spec(self, name: str) -> TensorSpec:
        """The shape and dtype `name` has once read (dequantized weights: the dtype transformers dequantizes to)."""
        if self.reader.packed_state_keys(name):
            shape = tuple(self.model.get_parameter(name).shape)
            return TensorSpec(name, self._dequantized_dtype(name), shape)
        return TensorSpec(name, self.reader.dtype(name), tuple(self.reader.shape(name)))

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name` as a fresh CPU tensor (dequantized if bitsandbytes stores it packed)."""
        if not self.reader.packed_state_keys(name):
            return self.reader.read(name)
        import bitsandbytes.functional as bnbf

        packed, stats = self.reader.read_packed(name)
        if "SCB" in stats:  # 8-bit: int8 rows times their scales / 127, as transformers' dequantize_bnb_weight
            return bnbf.int8_vectorwise_dequant(packed, stats["SCB"]).to(self._dequantized_dtype(name))
        state = bnbf.QuantState.from_dict(stats, device=torch.device("cpu"))
        return bnbf.dequantize_4bit(packed, state).to(state.dtype)

    def _dequantized_dtype(self, name: str) -> torch.dtype:
        info = [k for k in self.reader.packed_state_keys(name) if _QUANT_STATE in k]
        if info:  # 4-bit: the dtype the weight had when quantized, recorded in its quant state
            return getattr(torch, json.loads(bytes(self.reader.read(info[0]).tolist()).decode())["dtype"])
        return self._float_dtype()

    def _float_dtype(self) -> torch.dtype:
        """The dtype of the checkpoint's unquantized floating tensors (embeddings, norms): what transformers'
        `dequantize()` casts 8-bit weights to (the model's dtype)."""
        for name in self.reader.keys():
            if not self.reader.packed_state_keys(name) and not self._is_quant_state(name):
                dtype = self.reader.dtype(name)
                if dtype.is_floating_point:
                    return dtype
        return torch.float16

    def _is_quant_state(self, name: str) -> bool:
        """Whether `name` is a bitsandbytes quant state tensor stored beside a packed weight (absmax, SCB, ...)."""
        if self._state_keys is None:
            self._state_keys = {k for n in self.reader.keys() for k in self.reader.packed_state_keys(n)}
        return name in self._state_keys or _QUANT_STATE in name


def open_base(source: str) -> BaseCheckpoint:
    """Open `source` (a folder or hub name) for reading tensor by tensor.

    Raises:
        CheckpointError: no such model, or a checkpoint hfsplit cannot read; QuantizationError is not raised here:
            any method other than bitsandbytes (and a `gguf` label over float tensors) is refused by name.
    """
    config = load_config(source)
    raw = getattr(config, "quantization_config", None)
    raw = raw if raw is None or isinstance(raw, dict) else raw.to_dict()
    method = raw.get("quant_method") if raw else None
    if method not in (None, "bitsandbytes", "gguf"):
        raise CheckpointError(f"{source} is quantized with {method!r}; hfsplit merges into 16-bit and bitsandbytes "
                              "checkpoints: use the 16-bit checkpoint")
    plain = copy.deepcopy(config)
    if raw is not None:
        del plain.quantization_config
    model = meta_model(plain)
    reader = CheckpointReader.open(source, model=model)
    return BaseCheckpoint(source, plain, model, reader, None if method == "gguf" else method)


class StoredLayout:
    """The way from the model's tensors back to the checkpoint layout `save_pretrained` writes
    (transformers' `revert_weight_conversion`: an MoE's fused experts one by one), one tensor at a time."""

    def __init__(self, config):
        self._model = meta_model(one_layer_config(config))

    def pieces(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """{stored name: tensor} that `name`'s tensor is saved as (itself, or views of it)."""
        from transformers.core_model_loading import revert_weight_conversion

        return dict(revert_weight_conversion(self._model, {name: tensor}))

    def specs(self, spec: TensorSpec) -> list[TensorSpec]:
        """The stored tensors `spec` becomes, computed on the meta device."""
        meta = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        return [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in self.pieces(spec.name, meta).items()]
