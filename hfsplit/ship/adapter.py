"""A peft LoRA adapter folder, read as the deltas it adds to named base tensors.

peft saves `base_model.model.<module>.lora_A.weight` / `lora_B.weight` for a LoRA on a linear layer, and for LoRA on
a parameter (`LoraConfig(target_parameters=...)`, an MoE's fused experts) the same under the module holding the
parameter, one `.base_layer` deeper per parameter wrapped before it (peft nests its `ParamWrapper`s in the order of
`target_parameters`). The delta each adds is peft's own arithmetic (`peft.tuners.lora.layer`): `B @ A · scaling` in
float32 for a linear layer, added to the weight in float32 and rounded once; an expert parameter's delta per expert,
rounded to the parameter's dtype before the addition (`ParamWrapper.get_delta_weight`).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from hfsplit.errors import CheckpointError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)(?P<nest>(?:\.base_layer)*)\.lora_(?P<ab>[AB])\.weight$")
# Merging these needs arithmetic other than W + B·A·scaling: refused by name rather than merged wrong.
_UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "lora_bias", "use_qalora": "QA-LoRA", "use_bdlora": "BD-LoRA"}


@dataclass(frozen=True)
class LoraDelta:
    """What one adapted base tensor gains.

    Args:
        target: the model's parameter name ("model.layers.0.self_attn.q_proj.weight", "...mlp.experts.gate_up_proj").
        A, B: the adapter's matrices as saved.
        scaling: lora_alpha / r (or / √r under rsLoRA).
        experts: 0 for a linear layer; the expert count of a 3-D parameter.
        transposed: an expert parameter stored (experts, in, out) (gpt-oss) rather than (experts, out, in).
        fan_in_fan_out: a linear layer whose weight is stored (in, out) (GPT-2's Conv1D).
    """

    target: str
    A: torch.Tensor
    B: torch.Tensor
    scaling: float
    experts: int = 0
    transposed: bool = False
    fan_in_fan_out: bool = False

    def merged_rows(self, weight: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """Rows [first, first + count) of `weight` (2-D, the whole weight) plus the delta, as peft's unsafe merge:
        float32 `B @ A · scaling` added in float32, rounded once to the weight's dtype."""
        a, b = self.A.float(), self.B.float()
        if self.fan_in_fan_out:
            delta = (b @ a).T[first:first + count] * self.scaling
        else:
            delta = (b[first:first + count] @ a) * self.scaling
        return (weight[first:first + count].float() + delta).to(weight.dtype)

    def merged_expert(self, weight: torch.Tensor, expert: int) -> torch.Tensor:
        """Expert `expert` of a fused expert parameter plus its delta: the expert's slice of peft's einsum, rounded to
        the parameter's dtype, then added."""
        a = self.A.float().reshape(self.experts, -1, self.A.shape[-1])[expert]  # (r, in)
        b = self.B.float().reshape(self.B.shape[0], -1, self.experts)[:, :, expert]  # (out, r)
        delta = torch.einsum("o r, r i -> i o" if self.transposed else "o r, r i -> o i", b, a) * self.scaling
        return weight[expert] + delta.to(weight.dtype)

    def expected_shape(self) -> tuple[int, ...]:
        """The shape the adapted tensor must have."""
        out, inp = self.B.shape[0], self.A.shape[-1]
        if self.experts:
            return (self.experts, inp, out) if self.transposed else (self.experts, out, inp)
        return (inp, out) if self.fan_in_fan_out else (out, inp)


@dataclass(frozen=True)
class LoraAdapter:
    """A peft LoRA adapter folder: its config (as saved) and raw tensors {key without `base_model.model.`: tensor}."""

    folder: Path
    config: dict
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def scaling(self, module: str, r: int) -> float:
        """peft's scaling of `module`'s adapter of rank `r` (alpha_pattern and rsLoRA honoured)."""
        alpha = self.config.get("lora_alpha", 8)
        patterns = self.config.get("alpha_pattern") or {}
        key = next((k for k in patterns if re.match(rf"(.*\.)?({k})$", module)), None)
        alpha = patterns[key] if key is not None else alpha
        return alpha / math.sqrt(r) if self.config.get("use_rslora") else alpha / r

    def pairs(self) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
        """{(module, nesting depth): {"A": lora_A, "B": lora_B}} of every adapted module or parameter wrapper."""
        out: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        for key, tensor in self.tensors.items():
            match = _KEY.match(key)
            if match is None:
                continue  # a whole base tensor the adapter saved (`replacements`)
            depth = match["nest"].count(".base_layer")
            out.setdefault((match["module"], depth), {})[match["ab"]] = tensor
        incomplete = sorted(m for (m, _), ab in out.items() if len(ab) != 2)
        if incomplete:
            raise CheckpointError(f"{self.folder / WEIGHTS_FILE}: module {incomplete[0]!r} has lora_A or lora_B but "
                                  "not both; the adapter file is incomplete")
        return out


    def replacements(self, parameters: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """{model parameter name: tensor} of the whole base tensors the adapter stores, which peft loads over the
        base's (`save_embedding_layers`: the embeddings and head beside a LoRA on them).

        Raises:
            CheckpointError: a tensor that is neither a LoRA matrix nor a tensor of the base of the same shape.
        """
        out = {}
        for key, tensor in self.tensors.items():
            if _KEY.match(key) is not None:
                continue
            name = key.replace(".base_layer.", ".")
            if tuple(parameters.get(name, ())) != tuple(tensor.shape):
                raise CheckpointError(f"{self.folder / WEIGHTS_FILE}: tensor {key!r} {list(tensor.shape)} is neither a "
                                      "LoRA matrix nor a tensor of the base of that shape; hfsplit merges LoRA "
                                      "adapters (no trainable tokens or embedding LoRA) into their base")
            out[name] = tensor
        return out


def read_adapter(folder) -> LoraAdapter:
    """The peft LoRA adapter in `folder` (its config and tensors, held whole: an adapter is small).

    Raises:
        CheckpointError: no such folder, no adapter_config.json or weights, not a LoRA, or a LoRA variant whose merge
            is not W + B·A·scaling.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such adapter folder; give the folder peft's save_pretrained wrote")
    config_path, weights = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{folder}: no {CONFIG_FILE}; is this a peft adapter folder?")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_path}: not readable JSON ({exc})") from exc
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{config_path}: peft_type {config.get('peft_type')!r}; hfsplit merges LoRA adapters")
    used = [name for key, name in _UNSUPPORTED.items() if config.get(key)]
    if used or config.get("modules_to_save"):
        what = used[0] if used else "modules_to_save"
        raise CheckpointError(f"{config_path}: the adapter uses {what}, which hfsplit's merge does not support; merge "
                              "it with peft's merge_and_unload")
    if not weights.is_file():
        raise CheckpointError(f"{folder}: no {WEIGHTS_FILE}; hfsplit reads adapters saved as safetensors")
    from safetensors.torch import load_file

    tensors = {key.removeprefix("base_model.model."): t for key, t in load_file(str(weights)).items()}
    return LoraAdapter(folder, config, tensors)


def adapter_deltas(adapter: LoraAdapter, parameters: dict[str, tuple[int, ...]],
                   transposed_experts: Optional[set[str]] = None) -> dict[str, LoraDelta]:
    """{target parameter name: LoraDelta} of `adapter` against a base whose parameters are `parameters`
    ({model name: shape}).

    Raises:
        CheckpointError: the adapter adapts a module the base lacks, or its matrices do not fit the base's shapes
            (an adapter trained for another model).
    """
    transposed_experts = transposed_experts or set()
    wrapped = _wrapped_parameters(adapter.config.get("target_parameters") or [])
    deltas = {}
    for (module, depth), ab in sorted(adapter.pairs().items()):
        target = _target_of(module, depth, wrapped, parameters)
        if target is None:
            raise CheckpointError(f"{adapter.folder}: the adapter adapts {module!r}, which the base model lacks; "
                                  "is the adapter for this base model?")
        # peft's saved target_parameters may not keep its wrapping order (a set on its side): among the module's
        # wrapped parameters, the one whose shape the matrices fit
        fitting = [t for t in [target, *(f"{module}.{leaf}" for leaf in wrapped)] if t in parameters and
                   _delta(adapter, module, ab, t, parameters, transposed_experts).expected_shape() == tuple(parameters[t])]
        target = fitting[0] if fitting else target
        shape = parameters[target]
        delta = _delta(adapter, module, ab, target, parameters, transposed_experts)
        if delta.expected_shape() != tuple(shape):
            raise CheckpointError(
                f"{adapter.folder}: the adapter's {module!r} (A {list(ab['A'].shape)}, B {list(ab['B'].shape)}) fits a "
                f"tensor of shape {list(delta.expected_shape())}, the base's {target!r} is {list(shape)}; the adapter "
                "was trained on another model")
        deltas[target] = delta
    return deltas


def _delta(adapter: LoraAdapter, module: str, ab: dict, target: str, parameters: dict, transposed_experts: set):
    """The LoraDelta of `module`'s matrices `ab` read as adapting `target`."""
    shape = parameters[target]
    experts = shape[0] if len(shape) == 3 else 0
    r = ab["A"].shape[0] // max(experts, 1)
    return LoraDelta(target, ab["A"], ab["B"], adapter.scaling(module, r), experts,
                     transposed=target in transposed_experts, fan_in_fan_out=bool(adapter.config.get("fan_in_fan_out")))


def _wrapped_parameters(targets: list[str]) -> list[str]:
    """Leaf names of `target_parameters`, outermost wrapper first (peft wraps them in list order)."""
    return [t.rsplit(".", 1)[-1] for t in reversed(targets)]


def _target_of(module: str, depth: int, wrapped: list[str], parameters: dict[str, tuple[int, ...]]) -> Optional[str]:
    """The parameter an adapter of `module` at nesting `depth` adapts: the linear's weight, or the wrapped parameter."""
    if depth == 0 and f"{module}.weight" in parameters:
        return f"{module}.weight"
    present = [leaf for leaf in wrapped if f"{module}.{leaf}" in parameters]
    return f"{module}.{present[depth]}" if depth < len(present) else None
