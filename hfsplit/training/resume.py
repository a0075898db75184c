"""Trainer state for exact resumption, under the same split or another one.

Trainable weights (the fp32 masters) and the AdamW moments go through
torch.distributed.checkpoint (DCP), keyed by checkpoint names with tensor-parallel
pieces described as DTensor shards. A run resumed under another split (another
budget, rank count, pp or tp) therefore reads exactly the slices its own parameters
need — weights and optimizer state alike. Step, scheduler, data position and RNG are
small and go to one JSON + safetensors pair per rank: nothing on resume unpickles code
(`hfsplit.training.trainer_state`).

The moments are saved as fp32 whatever the optimizer keeps: bitsandbytes' 8-bit moments dequantized, so any split
and either optimizer can read them. An 8-bit optimizer also saves its codes and absmax as they are, keyed by the
TP piece they belong to (`_piece_key`): a resume whose parameter is split the same way (the same tp, whatever the
pp, budget or replicas) restores them bit for bit and continues exactly; under another tp the blocks of 256 fall
elsewhere in the new pieces, so the fp32 moments are re-quantized there (within one 8-bit step of each value), as
they are when a run moves between fp32 and 8-bit moments.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from torch.distributed.tensor import DTensor

from hfsplit.apply.tp import tp_shard_dim
from hfsplit.apply.tp_experts import PACKED_HALVES
from hfsplit.errors import HfsplitError
from hfsplit.models.families import PACKED_COLWISE, PACKED_ROWWISE, tp_style_of
from hfsplit.training.optimizers import RAW_KEYS, OnLocalPieces, load_moments, moments, raw_state
from hfsplit.training.trainer_state import SafeFileSystemReader, read_small_state, small_state_path, write_small_state

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
STATE = "trainer_state"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    """The complete checkpoint of the highest step in `output_dir` (temporary folders are ignored)."""
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete `checkpoint-N` folders of `output_dir`, oldest step first."""
    found = [(int(m.group(1)), p) for p in Path(output_dir).glob("checkpoint-*")
             if (m := _CHECKPOINT.match(p.name)) and (p / STATE).is_dir()]
    return [p for _, p in sorted(found)]


def prune_checkpoints(output_dir: str | Path, *, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (rank 0 only); the folders removed."""
    import shutil

    if keep <= 0 or dist.get_rank() != 0:
        return []
    old = complete_checkpoints(output_dir)[:-keep]
    for folder in old:
        shutil.rmtree(folder)
    return old


def checkpoint_to_resume(resume: str, output_dir: str) -> Path:
    """The folder `--resume` names: "latest" (in the output dir) or a path."""
    folder = latest_checkpoint(output_dir) if resume == "latest" else Path(resume)
    if folder is None or not (folder / STATE).is_dir():
        where = output_dir if resume == "latest" else resume
        raise HfsplitError(f"--resume {resume}: no complete checkpoint (with {STATE}/) in {where}; "
                           "train with --save-every N first, or name a checkpoint-N folder")
    return folder


def trusted_checkpoint(folder: Path) -> Path:
    """`folder`, once every file a resume will read from it has been read without running code (each rank's small
    state, DCP's metadata: `hfsplit.training.trainer_state`): a crafted checkpoint is refused here, in one line,
    before any weight is read or anything written."""
    for path in sorted((folder / STATE).glob("rank*.json")) + sorted((folder / STATE).glob("rank*.pt")):
        read_small_state(path)
    SafeFileSystemReader(str(folder / STATE / "tensors")).read_metadata()
    return folder


def write_trainer_state(folder: Path, *, model, params, optimizer, scheduler, batches, step: int) -> None:
    """Every rank's state into `folder/trainer_state/` (collective; called inside the atomic save)."""
    import torch.distributed.checkpoint as dcp

    (folder / STATE).mkdir(exist_ok=True)
    names = checkpoint_names(model, params)
    tensors = {}
    for p in params:
        tensors[f"param/{names[p]}"] = _global(model, p.detach(), param=p, name=names[p])
        tensors.update(_moment_tensors(model, optimizer, p, names[p]))
    dcp.save(tensors, checkpoint_id=str(folder / STATE / "tensors"))
    small = {
        "step": step,
        "scheduler": scheduler.state_dict(),
        "batches": batches.state_dict(),
        "rows_per_step": batches.batch_size,
        "rng": torch.get_rng_state(),
    }
    write_small_state(folder / STATE, dist.get_rank(), small)  # JSON + safetensors: nothing to unpickle on resume


def read_trainer_state(folder: Path, *, model, params, optimizer, scheduler, batches) -> int:
    """Restore this rank's state from `folder` (collective), resharding it when the split changed;
    the step it was saved at."""
    import torch.distributed.checkpoint as dcp

    small = _small_state(folder)
    names = checkpoint_names(model, params)
    reader = SafeFileSystemReader(str(folder / STATE / "tensors"))  # DCP's .metadata pickle, DCP's classes only
    saved = reader.read_metadata().state_dict_metadata
    check_trainer_state(folder, model=model, params=params)
    # DCP reads in place: straight into the parameters, and into fresh moments that become the optimizer state.
    targets, moments = {}, {}
    for p in params:
        targets[f"param/{names[p]}"] = _global(model, p.detach(), param=p, name=names[p])
        if f"step/{names[p]}" in saved:
            moments[p] = _blank_moments(model, optimizer, p, names[p], saved)
            targets.update(moments[p]["targets"])
    check_saved_shapes(folder, targets, saved)
    dcp.load(targets, storage_reader=reader)
    for p, blank in moments.items():
        load_moments(optimizer, p, exp_avg=blank["exp_avg"], exp_avg_sq=blank["exp_avg_sq"],
                     step=float(blank["step"]), raw=blank["raw"])
    scheduler.load_state_dict(small["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
    batches.load_state_dict(data_position_for(small, batches, folder=folder))
    torch.set_rng_state(small["rng"].cpu())
    return int(small["step"])


def check_trainer_state(folder: Path, *, model, params) -> None:
    """One line, before the run writes anything, when checkpoint `folder` was written by another run: a trainable
    tensor of this run it lacks (another --method, --lora-targets) or holds in another shape (another model, LoRA
    rank)."""
    names = checkpoint_names(model, params)
    saved = SafeFileSystemReader(str(folder / STATE / "tensors")).read_metadata().state_dict_metadata
    missing = sorted({f"param/{names[p]}" for p in params} - set(saved))
    if missing:
        raise HfsplitError(
            f"{folder}: holds no trainer state for {len(missing)} of this run's trainable tensors (first: "
            f"{missing[0].split('/', 1)[1]}); was it written with another --method or --lora-targets? "
            "Resume with the options of the run that wrote it")
    check_saved_shapes(folder, {f"param/{names[p]}": _global(model, p.detach(), param=p, name=names[p])
                                for p in params}, saved)


def check_saved_shapes(folder: Path, targets: dict, saved: dict) -> None:
    """One line when a tensor of the checkpoint has another shape than this run's (another model, LoRA rank)."""
    differ = [(key, list(saved[key].size), list(tensor.shape)) for key, tensor in targets.items()
              if hasattr(saved.get(key), "size") and tuple(saved[key].size) != tuple(tensor.shape)]
    if differ:
        key, there, here = differ[0]
        raise HfsplitError(f"{folder}: was written for another model or LoRA rank: {key.split('/', 1)[1]} is {there} "
                           f"there and {here} in this run ({len(differ)} tensors differ); resume with the --model and "
                           "--lora-r of the run that wrote it, or start afresh without --resume")


def _moment_tensors(model, optimizer, p, name: str) -> dict[str, torch.Tensor]:
    """What DCP saves of `p`'s optimizer state: the fp32 moments as global tensors, the step, and an 8-bit
    optimizer's codes and absmax under the key of this rank's piece."""
    found = moments(optimizer, p)
    if found is None:
        return {}
    exp_avg, exp_avg_sq, step = found
    out = {f"step/{name}": torch.tensor(float(step))}
    for key, moment in zip(_MOMENTS, (exp_avg, exp_avg_sq)):
        out[f"{key}/{name}"] = _global(model, _like_param(moment, p), param=p, name=name)
    out.update({f"{key}/{name}/{_piece_key(model, p)}": t for key, t in raw_state(optimizer, p).items()})
    return out


def _blank_moments(model, optimizer, p, name: str, saved: dict) -> dict:
    """Fresh tensors DCP reads `p`'s saved optimizer state into ("targets"), and the same by role: fp32 moments
    shaped as the optimizer keeps them (DTensors for torch's AdamW on DTensor parameters, the local piece for
    bitsandbytes'), and the 8-bit codes and absmax of this rank's piece where this run is 8-bit and they were saved
    for a piece split the same way (`raw`; None otherwise: the moments are re-quantized)."""
    local = isinstance(optimizer, OnLocalPieces)  # bitsandbytes': its moments are the local pieces' (optimizers.py)
    like = _local(p.detach()) if local else p.detach()
    blank = {"step": torch.zeros(()), "raw": None}
    for key in _MOMENTS:
        blank[key] = torch.zeros_like(like, dtype=torch.float32 if local else like.dtype)
    targets = {f"step/{name}": blank["step"]}
    targets.update({f"{key}/{name}": _global(model, _like_param(blank[key], p), param=p, name=name) for key in _MOMENTS})
    raw_keys = {key: f"{key}/{name}/{_piece_key(model, p)}" for key in RAW_KEYS}
    if local and all(k in saved for k in raw_keys.values()) and \
            tuple(saved[raw_keys["state1"]].size) == tuple(like.shape):
        blank["raw"] = {key: torch.empty(tuple(saved[k].size), dtype=saved[k].properties.dtype)
                        for key, k in raw_keys.items()}
        targets.update({k: blank["raw"][key] for key, k in raw_keys.items()})
    return {**blank, "targets": targets}


def _piece_key(model, p) -> str:
    """Which piece of parameter `p` this rank holds: "tp{rank}of{tp}" where tensor parallelism splits it, else
    "whole" (the same under every pp, budget and replica count)."""
    split = model.plan.tp > 1 and (isinstance(p, DTensor) or tp_shard_dim(p) is not None)
    return f"tp{model.ctx.coords.tp}of{model.plan.tp}" if split else "whole"


def _like_param(t: torch.Tensor, p) -> torch.Tensor:
    """`t` (a tensor shaped like `p`'s local piece, or `p`'s own kind) as a DTensor placed like `p` when `p` is one."""
    if isinstance(p, DTensor) and not isinstance(t, DTensor):
        return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False)
    return t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def checkpoint_names(model, params) -> dict[torch.nn.Parameter, str]:
    """Each trainable parameter's checkpoint name, the same under every split: a tied lm_head copy
    is named as the embedding it equals."""
    names = {}
    for stage in model.stages:
        for name, p in stage.named_parameters():
            names[p] = name
            if stage.lm_head is not None and p is stage.lm_head.weight and model.plan.tied_embeddings:
                names[p] = f"{stage.body_name}.embed_tokens.weight"
    return {p: names[p] for p in params}


def _small_state(folder: Path) -> dict:
    """This rank's step/scheduler/data/RNG state, else rank 0's (a launch with more ranks than the writer)."""
    return read_small_state(small_state_file(folder, dist.get_rank()))


def small_state_file(folder: Path, rank: int) -> Path:
    """Rank `rank`'s small-state file of checkpoint `folder` (rank 0's when the writer had fewer ranks): JSON, or an
    older hfsplit's pickle (read without running code, `trainer_state.read_small_state`)."""
    for candidate in (rank, 0):
        for path in (small_state_path(folder / STATE, candidate), folder / STATE / f"rank{candidate:05d}.pt"):
            if path.is_file():
                return path
    raise HfsplitError(f"{small_state_path(folder / STATE, 0)}: missing; the checkpoint {folder} is incomplete — "
                       "resume from an earlier one")


def data_position_for(small: dict, batches, *, folder: Path) -> dict:
    """The saved data position in this run's batch size (rows consumed are what carry over)."""
    state = dict(small["batches"])
    rows_now = batches.batch_size
    rows_then = small["rows_per_step"]
    if rows_now != rows_then:
        consumed = state["step"] * rows_then
        if consumed % rows_now:
            raise HfsplitError(
                f"{folder}: saved after {consumed} rows of epoch {state['epoch']}, not a whole number of this "
                f"run's steps ({rows_now} rows each: micro-batches × micro-batch size × data-parallel replicas); "
                f"keep the global batch at {rows_then} rows to resume here")
        state["step"] = consumed // rows_now
    return state


def _global(model, t: torch.Tensor, *, param: torch.nn.Parameter, name: str) -> torch.Tensor:
    """`t` (`param` or a tensor shaped like it) as DCP should see it: DTensors as they are, hand-sharded adapter
    pieces as the DTensor shards they are, fused experts' packed `gate_up_proj` as `[E, 2, I, H]` under every
    split (see `_packed_halves_apart`)."""
    from torch.distributed.tensor import DTensor, Shard

    packed_dim = _packed_dim(model, name)
    if packed_dim is not None:
        return _packed_halves_apart(model, t, packed_dim)
    if isinstance(t, DTensor):
        return t
    dim = tp_shard_dim(param)
    if dim is None or model.plan.tp == 1:
        return t
    return DTensor.from_local(t, model.ctx.tp_mesh, [Shard(dim)], run_check=False)


def _packed_dim(model, name: str) -> Optional[int]:
    """The dim along which parameter `name` packs fused experts' gate and up halves (1 of `[E, 2I, H]` under
    `models.PACKED_COLWISE`, 2 of Llama 4's `[E, H, 2I]` under `models.PACKED_ROWWISE`), else None; the same under
    every split, tp=1 included."""
    prefix = model.stages[0].body_name + "."
    inner = name[len(prefix):] if name.startswith(prefix) else name
    return {PACKED_COLWISE: 1, PACKED_ROWWISE: 2}.get(tp_style_of(model.config, inner))


def _packed_halves_apart(model, t: torch.Tensor, dim: int) -> torch.Tensor:
    """A view of packed `t` ([E, 2I, H]; under TP this rank's [E, 2I/tp, H] = [gate_r; up_r]) as [E, 2, I, H] (the
    halves apart along packed `dim`), each rank's piece then a plain `Shard(dim + 1)`: DCP cannot describe torch's
    `_StridedShard` (its chunks overlap in the plan), and one layout under every split lets a resume under another tp
    read the slices it needs."""
    from torch.distributed.tensor import DTensor, Shard

    def apart(x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:dim], PACKED_HALVES, x.shape[dim] // PACKED_HALVES, *x.shape[dim + 1:])

    if not isinstance(t, DTensor):
        return apart(t)
    return DTensor.from_local(apart(t.to_local()), model.ctx.tp_mesh, [Shard(dim + 1)], run_check=False)
