"""Saving a split model in the formats everyone loads, atomically.

Full fine-tuning: a Hugging Face model folder (sharded safetensors + index, config,
generation config, tokenizer). Each pipeline stage writes its own shard; tensor-parallel
pieces are gathered tensor by tensor within the stage's TP group, so no rank ever holds
the whole model. LoRA: a peft adapter folder (adapter_config.json, adapter_model.safetensors).

Writes go into `<dir>.tmp-<step>` and are renamed into place only after every rank has
finished, so a crash mid-save leaves the previous checkpoint as it was.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from hfsplit.apply.lora import lora_layers
from hfsplit.apply.quantize import dequantized
from hfsplit.apply.tp import full_tensor, local_tensor, tp_shard_dim
from hfsplit.checkpoint.merged import as_stored
from hfsplit.errors import HfsplitError

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


def full_state_of_stage(model, module, *, merge_lora: bool = False) -> dict[str, torch.Tensor]:
    """Checkpoint-named CPU tensors of one stage module, TP pieces joined (collective over the TP group);
    with `merge_lora`, LoRA layers' weights come out with their adapters folded in."""
    # Saved in the run's dtype (bf16 runs keep fp32 master weights in memory, users expect bf16 files).
    dtype = getattr(torch, model.plan.spec.dtype)
    merged = merged_lora_weights(module) if merge_lora else {}
    state = {}
    for name, param in module.named_parameters():
        if ".lora_" in name:
            continue
        if model.plan.tied_embeddings and name == "lm_head.weight":
            continue  # stored once, as the embedding
        owner = module.get_submodule(name.rpartition(".")[0])  # an 8-bit layer keeps its scales on itself
        value = merged[name] if name in merged else dequantized(param, owner).detach()  # QLoRA: merged in 16 bits
        state[name.replace(".base_layer.", ".")] = full_tensor(value).to(dtype).cpu().contiguous()
    return state


def merged_lora_weights(module) -> dict[str, torch.Tensor]:
    """`W + scaling · B @ A` for every LoRA layer of `module`, keyed by the base weight's parameter name.

    Computed on this rank's pieces: a column-parallel layer holds rows of W and of B (A whole), a
    row-parallel one columns of W and of A (B whole), so the local product is exactly the local piece.
    """
    from torch.distributed.tensor import DTensor

    merged = {}
    for prefix, sub in lora_layers(module):
        weight = dequantized(sub.base_layer.weight, sub.base_layer).detach()
        delta = sub.lora_B["default"].weight.detach().float() @ sub.lora_A["default"].weight.detach().float()
        local = (local_tensor(weight).float() + delta * sub.scaling["default"]).to(weight.dtype)
        if isinstance(weight, DTensor):
            local = DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False)
        merged[f"{prefix}.base_layer.weight"] = local
    return merged


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
                     base_model: Optional[str] = None, extra=None, merge_lora: bool = False) -> Path:
    """Save `model` (a SplitModel, on every rank) into `folder` atomically; the final path.

    `method="full"` writes a Hugging Face model folder (with `merge_lora`, LoRA adapters folded into
    the weights), `"lora"` a peft adapter folder. `extra(tmp_folder)`, when given, runs on every rank
    before the rename (trainer state).
    """
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    if method == "full":
        _write_full(model, tmp, merge_lora=merge_lora, base_model=base_model)
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


def _write_full(model, tmp: Path, *, merge_lora: bool, base_model: Optional[str]) -> None:
    """A Hugging Face model folder in `tmp`: one safetensors shard per stage, the index, the configs (collective)."""
    from safetensors.torch import save_file

    pieces = {}
    for index, module in zip(model.stage_indices, model.stages):
        state = full_state_of_stage(model, module, merge_lora=merge_lora)  # collective: every TP rank takes part
        pieces[index] = as_stored(model.config, state)  # MoE experts one by one, as transformers saves them
    writer = _writes(model)
    if writer:
        total = len(model.plan.stages)
        for index, state in pieces.items():
            save_file(state, str(tmp / _shard_name(index, total)), metadata={"format": "pt"})
    names = {index: sorted(state) for index, state in pieces.items()} if writer else {}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    if dist.get_rank() == 0:
        _write_index(tmp, gathered, total=len(model.plan.stages))
        model.config.save_pretrained(tmp)
        _write_generation_config(tmp, base_model, config=model.config)


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
        save_file(merged, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        lora_config.base_model_name_or_path = base_model
        lora_config.save_pretrained(tmp)


def _shard_name(index: int, total: int) -> str:
    return f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def _write_index(folder: Path, gathered: list[dict], *, total: int) -> None:
    weight_map = {}
    for names_by_stage in gathered:
        for index, names in names_by_stage.items():
            for name in names:
                weight_map[name] = _shard_name(int(index), total)
    size = sum((folder / f).stat().st_size for f in set(weight_map.values()))
    index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_generation_config(folder: Path, base_model: Optional[str], *, config) -> None:
    """The base model's generation config when it has one, else the one transformers derives from the config."""
    if base_model and (Path(base_model) / "generation_config.json").is_file():
        shutil.copyfile(Path(base_model) / "generation_config.json", folder / "generation_config.json")
        return
    from transformers import GenerationConfig

    GenerationConfig.from_model_config(config).save_pretrained(folder)
