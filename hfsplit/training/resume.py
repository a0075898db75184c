"""Trainer state for exact resumption: each rank's trainable weights, optimizer, scheduler,
data position and RNG, stored beside the HF-format checkpoint of the same step.

States are per rank and tied to the split that wrote them: a resume under another plan
is refused with a message saying what can be reused (the saved model or adapter).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import HfsplitError

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    """The complete checkpoint of the highest step in `output_dir` (temporary folders are ignored)."""
    found = [(int(m.group(1)), p) for p in Path(output_dir).glob("checkpoint-*")
             if (m := _CHECKPOINT.match(p.name)) and (p / "trainer_state").is_dir()]
    return max(found)[1] if found else None


def checkpoint_to_resume(resume: str, output_dir: str) -> Path:
    """The folder `--resume` names: "latest" (in the output dir) or a path."""
    folder = latest_checkpoint(output_dir) if resume == "latest" else Path(resume)
    if folder is None or not (folder / "trainer_state").is_dir():
        where = output_dir if resume == "latest" else resume
        raise HfsplitError(f"--resume {resume}: no complete checkpoint (with trainer_state/) in {where}; "
                           "train with --save-every N first, or name a checkpoint-N folder")
    return folder


def write_trainer_state(folder: Path, *, model, params, optimizer, scheduler, batches, step: int) -> None:
    """This rank's state into `folder/trainer_state/rank<r>.pt` (called inside the atomic save)."""
    (folder / "trainer_state").mkdir(exist_ok=True)
    state = {
        "step": step,
        "plan": model.plan.to_json(indent=None),
        "params": [_local(p.detach()).clone() for p in params],
        "optimizer": _local_optimizer_state(optimizer.state_dict()),
        "scheduler": scheduler.state_dict(),
        "batches": batches.state_dict(),
        "rng": torch.get_rng_state(),
    }
    torch.save(state, folder / "trainer_state" / f"rank{dist.get_rank():05d}.pt")


def read_trainer_state(folder: Path, *, model, params, optimizer, scheduler, batches) -> int:
    """Restore this rank's state from `folder`; the step it was saved at."""
    path = folder / "trainer_state" / f"rank{dist.get_rank():05d}.pt"
    if not path.is_file():
        raise HfsplitError(f"{path}: missing; the checkpoint was written by fewer ranks than this launch has")
    state = torch.load(path, map_location=model.device, weights_only=False)
    if state["plan"] != model.plan.to_json(indent=None):
        raise HfsplitError(
            f"{folder}: saved under another split (budget, rank count or schedule differ); its optimizer state "
            f"cannot be resharded. Start a new run from its weights instead: --model {folder / 'model'} "
            f"(full) or merge {folder / 'adapter'} (LoRA)")
    with torch.no_grad():
        for p, saved in zip(params, state["params"]):
            _local(p).copy_(saved)
    optimizer.load_state_dict(state["optimizer"])
    _restore_dtensor_state(optimizer)
    scheduler.load_state_dict(state["scheduler"])
    batches.load_state_dict(state["batches"])
    torch.set_rng_state(state["rng"].cpu())
    return int(state["step"])


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _local_optimizer_state(state: dict) -> dict:
    return {
        "state": {k: {n: _local(v).clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                  for k, s in state["state"].items()},
        "param_groups": state["param_groups"],
    }


def _restore_dtensor_state(optimizer) -> None:
    """Moments saved as local pieces become DTensors again, laid out like their parameters."""
    from torch.distributed.tensor import DTensor

    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0:
                    optimizer.state[p][key] = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False)
