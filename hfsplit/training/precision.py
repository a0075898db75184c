"""The precision a step computes in: the plan's autocast where the weights are fp32 masters."""
from __future__ import annotations

import contextlib

import torch


def compute_precision(model):
    """Autocast to the plan's 16-bit dtype where the weights are fp32 masters (`TrainingSpec.full_autocast_dtype`,
    decided in planning); a no-op otherwise."""
    wanted = model.plan.spec.full_autocast_dtype
    if wanted is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=model.device.type, dtype=getattr(torch, wanted))
