"""The load step: this rank's bytes read into its stage modules, and nothing else of the checkpoint.

It runs after tensor parallelism (each DTensor parameter reads only its rank's slice) and, for QLoRA, quantizes
each decoder block right after its tensors arrive (`load_quantized_stage`), so no rank holds its stage in 16 bits.
"""
from __future__ import annotations

import math
import re
from typing import Iterable, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hfsplit.apply.quantize import Staging, quantize_module, quantizes
from hfsplit.apply.tp import shard_layout
from hfsplit.checkpoint.reader import CheckpointReader
from hfsplit.models.layout import holds_experts, meta_model, recompute_buffers
from hfsplit.plan.steps import Step

_LAYER = re.compile(r"^(.*\.layers\.\d+)\.")


def read_weights(modules: Sequence[nn.Module], step: Step, inputs) -> Step:
    """The step: `inputs.load` reads this rank's bytes into its stage modules (`load_stages` for a split)."""
    inputs.load(modules)
    return step


def load_stages(stages: Sequence[nn.Module], *, source: str, config, device: torch.device, dtype: torch.dtype,
                tp_rank: int, tp_size: int, quantization_config=None, experts: bool = True) -> None:
    """Read `stages`' parameters from the checkpoint `source` onto `device`, only what they hold: each TP-sharded
    parameter its slice; with `quantization_config` (a transformers `BitsAndBytesConfig`), each block quantized
    as it is read, an MoE's fused experts too with `experts` (4-bit: `TrainingSpec.quantize_experts`)."""
    needed = [name for m in stages for name in [*(n for n, _ in m.named_parameters()), *checkpoint_buffers(m)]]
    reader = open_reader(source, needed=needed, model=meta_model(config))
    for module in stages:
        if quantization_config is not None:
            load_quantized_stage(module, reader=reader, device=device, dtype=dtype, qconfig=quantization_config,
                                 experts=experts)
            continue
        load_stage_weights(module, reader=reader, device=device, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size)


def checkpoint_buffers(module: nn.Module) -> list[str]:
    """The names of `module`'s persistent buffers still on meta: tensors a checkpoint holds beside the parameters
    (DeepSeek-V3's router `e_score_correction_bias`)."""
    return [f"{owner}.{name}" if owner else name for owner, m in module.named_modules()
            for name, b in m._buffers.items()
            if b is not None and b.is_meta and name not in m._non_persistent_buffers_set]


def read_buffers(module: nn.Module, *, reader, device: torch.device) -> None:
    """Read `module`'s persistent buffers (`checkpoint_buffers`) in their own dtype."""
    for key in checkpoint_buffers(module):
        owner_name, _, leaf = key.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        owner._buffers[leaf] = reader.read(key, dtype=owner._buffers[leaf].dtype, device=device)


def open_reader(name_or_path: str, *, needed: Iterable[str], model: nn.Module):
    """A CheckpointReader validated for the parameter names `needed` of `model` (a meta-device model).

    Passing the model lets the reader apply transformers' load-time renames and map a tied
    `lm_head.weight` to the embedding matrix it shares.
    """
    return CheckpointReader.open(name_or_path, needed=list(needed), model=model)


def materialize_buffers(module: nn.Module, *, device: torch.device) -> None:
    """Rebuild the rotary embedding and the other non-persistent buffers (absent from checkpoints) on `device`."""
    if isinstance(module.rotary_emb, nn.Module) and "rotary_emb" in module._modules:  # a followed stage's is the model's
        with torch.device(device):
            module.rotary_emb = type(module.rotary_emb)(config=module.config)
    fresh = recompute_buffers(module, module._init_weights, device=device)
    if fresh and hasattr(module, "init_decoder_buffers"):  # a followed stage: what the decoder's own init sets
        module.init_decoder_buffers(fresh)


def load_stage_weights(module: nn.Module, *, reader, device: torch.device, dtype: Optional[torch.dtype] = None,
                       tp_rank: int = 0, tp_size: int = 1) -> None:
    """Replace every meta parameter of `module` with this rank's bytes read from `reader`.

    Parameters that TP turned into DTensors are read as this rank's slice only. A tied
    lm_head reads the embedding matrix (the reader maps the name).
    """
    for key, param in list(module.named_parameters()):
        if isinstance(param, DTensor):
            if layout := shard_layout(param):  # (dim, packed halves): fused experts' gate_up_proj holds [gate_r; up_r]
                local = reader.read_slice(key, layout[0], tp_rank, tp_size, dtype=dtype, device=device,
                                          packed=layout[1])
            else:
                local = reader.read(key, dtype=dtype, device=device)
            value = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
        else:
            value = reader.read(key, dtype=dtype, device=device_for(module, key, device))
        set_parameter(module, key, nn.Parameter(value, requires_grad=param.requires_grad))
    if module.shares_embedding:  # named_parameters listed the shared matrix once, under the embedding
        module.lm_head.weight = module.body.embed_tokens.weight
    read_buffers(module, reader=reader, device=device)
    materialize_buffers(module, device=device)


def device_for(module: nn.Module, name: str, device: torch.device) -> torch.device:
    """Where parameter `name` of `module` is read: the rank's `device`, or the device its owner was marked to live on
    (`hfsplit_device`: an input embedding kept in host RAM, `hfsplit.apply.host_embedding`)."""
    owner_name = name.rpartition(".")[0]
    owner = module.get_submodule(owner_name) if owner_name else module
    return getattr(owner, "hfsplit_device", device)


def set_parameter(module: nn.Module, name: str, value: nn.Parameter) -> None:
    """Assign `value` to the dotted parameter `name` of `module`."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    setattr(owner, leaf, value)


def load_quantized_stage(module: nn.Module, *, reader, device: torch.device, dtype: torch.dtype, qconfig,
                         experts: bool = True) -> None:
    """Read `module`'s weights (a stage, tp=1) and quantize each decoder block right after its tensors arrive.

    Embeddings, norms and lm_head stay in `dtype`; so the rank never holds more than one block in 16 bits. With
    `experts` (4-bit), an MoE block's fused experts are not read whole: each expert is read into a one-expert staging
    buffer and quantized (`quantize_module`), so the rank never holds a layer's 16-bit experts either.
    """
    dense = _linear_weights(module)
    staging = Staging(max((sum(math.prod(dense[k]) for k in dense if k.startswith(b + ".")) for b in
                            {_LAYER.match(k).group(1) for k in dense}), default=0), dtype=dtype, device=device)
    current: Optional[str] = None
    per_expert = experts and not qconfig.load_in_8bit
    for key, param in list(module.named_parameters()):
        block = _LAYER.match(key)
        if current is not None and (block is None or block.group(1) != current):
            quantize_module(module.get_submodule(current), qconfig, device=device, prefix=current, reader=reader,
                            experts=experts)
            staging.reset()
        current = block.group(1) if block else None
        if reader.packed_state_keys(key) or (per_expert and block is not None and param.dim() == 3
                                             and holds_experts(module.get_submodule(key.rpartition(".")[0]))):
            continue  # pre-quantized: read packed as stored; fused experts: read expert by expert as quantized
        if key in dense:  # a block's 16-bit linear weight lives only until its block is quantized
            value = reader.read_into(key, staging.take(dense[key]))
        else:
            value = reader.read(key, dtype=dtype, device=device_for(module, key, device))
        set_parameter(module, key, nn.Parameter(value, requires_grad=False))
    if current is not None:
        quantize_module(module.get_submodule(current), qconfig, device=device, prefix=current, reader=reader,
                        experts=experts)
    if getattr(module, "shares_embedding", False):
        module.lm_head.weight = module.body.embed_tokens.weight
    module.is_loaded_in_4bit = not qconfig.load_in_8bit  # peft picks its bitsandbytes LoRA layers by these flags
    module.is_loaded_in_8bit = bool(qconfig.load_in_8bit)
    read_buffers(module, reader=reader, device=device)
    materialize_buffers(module, device=device)


def _linear_weights(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the weights of the plain linears inside `module`'s decoder blocks (what gets quantized)."""
    return {f"{name}.weight": tuple(sub.weight.shape) for name, sub in module.named_modules()
            if quantizes(name, sub) and _LAYER.match(f"{name}.")}
