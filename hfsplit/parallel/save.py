"""Saving a split model in the formats everyone loads, atomically.

Full fine-tuning (and `--merge`): a Hugging Face model folder (sharded safetensors + index, config,
generation config, tokenizer). Each pipeline stage writes its own shards through the streaming writer
(`hfsplit.checkpoint.writer`): tensor by tensor, tensor-parallel pieces gathered within the stage's TP
group and LoRA adapters folded in one layer at a time, each written and dropped before the next, so no
rank holds a whole stage. LoRA: a peft adapter folder (adapter_config.json, adapter_model.safetensors).

Writes go into `<dir>.tmp-<step>` and are renamed into place only after every rank has
finished, so a crash mid-save leaves the previous checkpoint as it was.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional, Union

import torch
import torch.distributed as dist

from hfsplit.apply.quantize import dequantized
from hfsplit.apply.tp import full_tensor, local_tensor, tp_shard_dim
from hfsplit.checkpoint.writer import (DEFAULT_MAX_SHARD_SIZE, StreamingWriter, TensorSpec, shard_layout,
                                       write_index_file)
from hfsplit.errors import HfsplitError
from hfsplit.ship.base import StoredLayout
from hfsplit.ship.multimodal import Towers, WrappedLayout, adapter_in_wrapper, save_config, wrapper_of_source

_ADAPTER_NAME = re.compile(r"\.default(?=\.)")


def writable_dir(path: str | os.PathLike) -> Path:
    """`path` created if needed; a clear error when it cannot be written."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".hfsplit-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise HfsplitError(f"output dir {path} is not writable ({exc.strerror}); pass --output-dir to a folder you can write") from exc
    return path


def stage_tensor_names(model, module) -> list[str]:
    """Parameter names of one stage module that a model folder stores: no LoRA matrices, no tied head."""
    return [name for name, _ in module.named_parameters() if ".lora_" not in name
            and not (model.plan.tied_embeddings and name == "lm_head.weight")]  # the head is stored once, as the embedding


def stage_tensor(model, module, name: str, *, merge_lora: bool = False) -> torch.Tensor:
    """Parameter `name` of a stage module as a CPU tensor in the run's dtype, TP pieces joined (collective over the TP
    group); with `merge_lora`, a LoRA layer's weight comes out with its adapter folded in, bitsandbytes weights
    dequantized (QLoRA: merged in 16 bits)."""
    value = _stage_value(module, name, merge_lora=merge_lora)
    # Saved in the run's dtype (bf16 runs keep fp32 master weights in memory, users expect bf16 files).
    return full_tensor(value).to(getattr(torch, model.plan.spec.dtype)).cpu().contiguous()


def _stage_value(module, name: str, *, merge_lora: bool) -> torch.Tensor:
    """`name`'s local value: merged with its LoRA adapter or dequantized, not yet gathered over TP."""
    owner = module.get_submodule(name.rpartition(".")[0])  # an 8-bit layer keeps its scales on itself
    if merge_lora and name.endswith(".base_layer.weight"):
        layer = module.get_submodule(name[:-len(".base_layer.weight")])
        if hasattr(layer, "lora_A") and "default" in layer.lora_A:
            return merged_lora_weight(layer)
    value = dequantized(module.get_parameter(name), owner).detach()
    return value + parameter_lora_delta(module, name) if merge_lora and ".base_layer." in name else value


def parameter_lora_delta(module, name: str):
    """The LoRA delta peft adds to the parameter `name` itself (a fused experts tensor adapted by peft's
    `ParamWrapper`, each adapted parameter one wrapper around the module), 0 where none adapts it."""
    from torch.distributed.tensor import DTensor

    prefix, _, leaf = name.rpartition(".")
    delta = 0
    while prefix.endswith(".base_layer"):
        prefix = prefix[:-len(".base_layer")]
        wrapper = module.get_submodule(prefix)
        if getattr(wrapper, "parameter_name", None) == leaf and "default" in getattr(wrapper, "lora_A", {}):
            if isinstance(module.get_parameter(name), DTensor):
                raise NotImplementedError(f"{name}: merging a LoRA adapted parameter sharded over TP")
            delta = delta + wrapper.get_delta_weight("default").detach()
    return delta


def stage_tensor_specs(model, module, layout) -> list[TensorSpec]:
    """The stored tensors one stage writes, in order, from shapes alone (no collective): checkpoint names, the
    run's dtype, MoE experts one by one as `save_pretrained` writes them (`layout`: hfsplit.ship.base.StoredLayout)."""
    dtype = getattr(torch, model.plan.spec.dtype)
    specs = []
    for name in stage_tensor_names(model, module):
        shape = tuple(_stage_value(module, name, merge_lora=False).shape)  # a DTensor's shape is the global one
        specs += layout.specs(TensorSpec(name.replace(".base_layer.", "."), dtype, shape))
    return specs


def merged_lora_weight(layer) -> torch.Tensor:
    """`W + scaling · B @ A` of one LoRA layer, on this rank's pieces: a column-parallel layer holds rows of W and of B
    (A whole), a row-parallel one columns of W and of A (B whole), so the local product is exactly the local piece."""
    from torch.distributed.tensor import DTensor

    weight = dequantized(layer.base_layer.weight, layer.base_layer).detach()
    delta = layer.lora_B["default"].weight.detach().float() @ layer.lora_A["default"].weight.detach().float()
    local = (local_tensor(weight).float() + delta * layer.scaling["default"]).to(weight.dtype)
    if isinstance(weight, DTensor):
        local = DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False)
    return local


def lora_state_of_stage(model, module) -> dict[str, torch.Tensor]:
    """peft-named adapter tensors of one stage (`base_model.model.<name>` without the adapter name),
    TP pieces joined (collective over the TP group)."""
    state = {}
    for name, p in module.named_parameters():
        if ".lora_" not in name:
            continue
        value = p.detach().contiguous()
        dim = tp_shard_dim(p)
        if dim is not None:
            pieces = [torch.empty_like(value) for _ in range(model.plan.tp)]
            dist.all_gather(pieces, value, group=model.ctx.tp_mesh.get_group())
            value = torch.cat(pieces, dim=dim)
        state["base_model.model." + _ADAPTER_NAME.sub("", name)] = value.cpu()
    return state


def save_split_model(model, folder: str | os.PathLike, *, method: str, lora_config=None, tokenizer=None,
                     base_model: Optional[str] = None, extra=None, merge_lora: bool = False,
                     max_shard_size: Union[str, int] = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Save `model` (a SplitModel, on every rank) into `folder` atomically; the final path.

    `method="full"` writes a Hugging Face model folder (with `merge_lora`, LoRA adapters folded into
    the weights), `"lora"` a peft adapter folder. `extra(tmp_folder)`, when given, runs on every rank
    before the rename (trainer state). Shards hold at most `max_shard_size` bytes each ("5GB", as save_pretrained).
    """
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    try:
        return _save_through(model, folder, tmp, method=method, lora_config=lora_config, tokenizer=tokenizer,
                             base_model=base_model, extra=extra, merge_lora=merge_lora, max_shard_size=max_shard_size)
    except BaseException:  # Ctrl-C, SIGTERM, a lost peer: nothing half-written stays
        # rank 0 alone clears it (as it alone made it): a peer still clearing could delete the folder a retry made
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_through(model, folder: Path, tmp: Path, *, method: str, lora_config, tokenizer, base_model, extra,
                  merge_lora: bool, max_shard_size: Union[str, int]) -> Path:
    """`save_split_model`'s writes: everything into `tmp`, renamed to `folder` once every rank is done."""
    rank = dist.get_rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    if method == "full":
        _write_full(model, tmp, merge_lora=merge_lora, base_model=base_model, max_shard_size=max_shard_size)
    else:
        _write_adapter(model, tmp, lora_config=lora_config, base_model=base_model)
    if rank == 0 and tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    dist.barrier()  # the folder exists on every rank's view before extra writes into it
    if extra is not None:
        extra(tmp)
    dist.barrier()
    if rank == 0:
        old = folder.with_name(folder.name + ".old")
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
        if old.exists():
            shutil.rmtree(old)
    dist.barrier()
    return folder


def _writes(model) -> bool:
    """Whether this rank writes its stages' tensors (one rank per stage: TP and DP rank 0)."""
    return model.ctx.coords.tp == 0 and model.ctx.coords.dp == 0


def _write_full(model, tmp: Path, *, merge_lora: bool, base_model: Optional[str],
                max_shard_size: Union[str, int] = DEFAULT_MAX_SHARD_SIZE) -> None:
    """A Hugging Face model folder in `tmp` (collective): each stage's tensors streamed one at a time into shards of at
    most `max_shard_size` (a shard never spans stages; one writing rank per stage), the index, the configs."""
    wrapper = wrapper_of_source(base_model or getattr(model, "source", None))
    layout = StoredLayout(model.config) if wrapper is None else WrappedLayout(model.config, wrapper)
    stages = list(zip(model.stage_indices, model.stages))
    groups = [group for _, module in stages
              for group in shard_layout(stage_tensor_specs(model, module, layout), max_shard_size)]
    writes = _writes(model)
    # a multimodal checkpoint's towers, as stored, in the first stage's shards after its own tensors
    towers = Towers(base_model or model.source, wrapper) if wrapper and writes and 0 in model.stage_indices else None
    groups += shard_layout(towers.specs(), max_shard_size) if towers is not None else []
    first, total = _shard_numbering(min(model.stage_indices), len(groups) if writes else 0)
    writer = StreamingWriter(tmp, [], layout=groups, first_shard=first, total_shards=total) if writes else None
    for _, module in stages:
        for name in stage_tensor_names(model, module):
            value = stage_tensor(model, module, name, merge_lora=merge_lora)  # collective: every TP rank takes part
            for key, piece in layout.pieces(name.replace(".base_layer.", "."), value).items():
                if writer is not None:
                    writer.write(key, piece)
            del value
    if writer is not None and towers is not None:
        towers.write(writer)
    mine = (writer.close(write_index=False), writer.total_size) if writer is not None else ({}, 0)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        write_index_file(tmp, {k: v for part, _ in gathered for k, v in part.items()},
                         total_size=sum(size for _, size in gathered))
        if wrapper is None:
            model.config.save_pretrained(tmp)
        else:
            save_config(wrapper, tmp)
        _write_generation_config(tmp, base_model, config=model.config)


def _shard_numbering(first_stage: int, shards: int) -> tuple[int, int]:
    """(this rank's first shard number, the shards of all ranks) with the writing ranks' shards in stage order
    (collective)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (first_stage, shards))
    before = sum(n for stage, n in gathered if stage < first_stage)
    return before, sum(n for _, n in gathered)


def _write_adapter(model, tmp: Path, *, lora_config, base_model: Optional[str]) -> None:
    """A peft adapter folder in `tmp`: every stage's adapters gathered to rank 0 (collective)."""
    from safetensors.torch import save_file

    adapters = {}
    for module in model.stages:
        adapters.update(lora_state_of_stage(model, module))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, adapters if _writes(model) else {})
    if dist.get_rank() == 0:
        merged = {k: v for part in gathered for k, v in part.items()}
        wrapper = wrapper_of_source(base_model or getattr(model, "source", None))
        if wrapper is not None:  # under the original multimodal model's names, its towers untouched
            merged, lora_config = adapter_in_wrapper(merged, lora_config, wrapper)
        save_file(merged, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        lora_config.base_model_name_or_path = base_model
        lora_config.save_pretrained(tmp)


def _write_generation_config(folder: Path, base_model: Optional[str], *, config) -> None:
    """The base model's generation config when it has one, else the one transformers derives from the config."""
    if base_model and (Path(base_model) / "generation_config.json").is_file():
        shutil.copyfile(Path(base_model) / "generation_config.json", folder / "generation_config.json")
        return
    from transformers import GenerationConfig

    GenerationConfig.from_model_config(config).save_pretrained(folder)
