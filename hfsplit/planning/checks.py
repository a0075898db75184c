"""The caller's forced degrees, schedule, micro-batches and budgets checked against each other and the model:
one line each (`PlanError`) before anything is searched."""
from __future__ import annotations

import math
from typing import Optional

from hfsplit.budget import format_bytes
from hfsplit.errors import PlanError
from hfsplit.models.expert_lora import expert_lora_tp_error
from hfsplit.models.families import tp_degree_error
from hfsplit.plan import TrainingSpec, checkpointing_mode
from hfsplit.planning.memory_choices import AUTO as AUTO_CHOICE
from hfsplit.schedules import AUTO, TABLE, min_micro_batches


def check_options(schedule: str, micro_batches, global_batch, spec: TrainingSpec, activation_checkpointing,
                   world_size: Optional[int], *, tp, pp, dp) -> None:
    _check_world(world_size, tp=tp, pp=pp, dp=dp)
    if activation_checkpointing != AUTO_CHOICE:
        _check_zero_bubble_checkpointing(schedule, checkpointing_mode(activation_checkpointing))
    if schedule != AUTO and schedule not in TABLE:
        raise PlanError(f"schedule {schedule!r} is unknown; choose auto or one of {', '.join(TABLE)}")
    if micro_batches == AUTO and not global_batch:
        raise PlanError('micro_batches="auto" cuts a given global batch into micro-batches; pass global_batch '
                        "(--global-batch N) or a micro-batch count")
    if micro_batches is not None and micro_batches != AUTO and micro_batches < 1:
        raise PlanError(f"micro_batches={micro_batches}: needs at least 1")
    if global_batch is not None and global_batch < spec.micro_batch_size and micro_batches != AUTO:
        raise PlanError(f"global_batch={global_batch} is smaller than micro_batch_size={spec.micro_batch_size}")
    if spec.seq_len < 1 or spec.micro_batch_size < 1:
        raise PlanError("seq_len and micro_batch_size must be at least 1")


def _check_zero_bubble_checkpointing(schedule: str, mode: str) -> None:
    if mode != "off" and schedule in TABLE and TABLE[schedule].zero_bubble:
        raise PlanError(f"schedule {schedule} keeps the recomputed activations until each deferred weight "
                        "gradient, so activation checkpointing saves nothing there; use --schedule auto / "
                        "1F1B / Interleaved1F1B with checkpointing, or --activation-checkpointing off")


def check_budget_count(world_size: Optional[int], budgets: dict[str, int]) -> None:
    if world_size is not None and world_size > len(budgets):
        each = format_bytes(min(budgets.values())).replace(" ", "")
        raise PlanError(f"{world_size} processes were launched but max_memory names {len(budgets)} device(s); give "
                        f'one budget per process (e.g. "{world_size}x{each}") or launch {len(budgets)}')


def _check_world(world_size: Optional[int], *, tp, pp, dp) -> None:
    """A launch of `world_size` processes must hold the forced degrees exactly (or a multiple of them)."""
    if world_size is None:
        return
    forced = {name: value for name, value in (("tp", tp), ("pp", pp), ("dp", dp)) if value is not None}
    for name, value in forced.items():
        if value < 1:
            raise PlanError(f"{name}={value}: a parallel degree must be at least 1; pass --{name} 1 or more")
    needed = math.prod(forced.values())
    if world_size % needed == 0 and (len(forced) < 3 or needed == world_size):
        return
    degrees = " × ".join(f"{name}={value}" for name, value in forced.items())
    launched = f"{world_size} process{'' if world_size == 1 else 'es'} {'was' if world_size == 1 else 'were'} launched"
    wanted = f"{needed}" if len(forced) == 3 or world_size < needed else f"a multiple of {needed}"
    raise PlanError(f"{degrees} needs {wanted} processes but {launched}; launch {needed} "
                    f"(torchrun --nproc_per_node {needed}) or change {', '.join('--' + n for n in forced)}")


def check_degrees(config, budgets: dict[str, int], *, tp, pp, dp, micro_batches=None, schedule=AUTO,
                  world_size: Optional[int] = None) -> None:
    """The forced degrees and micro-batches against the devices and the model, then the launch against the budgets."""
    devices = len(budgets)
    if tp is not None and (why := tp_degree_error(config, tp)):
        raise PlanError(why)
    needed = (tp or 1) * (pp or 1) * (dp or 1)
    if needed > devices:
        raise PlanError(f"tp={tp or 1} × pp={pp or 1} × dp={dp or 1} needs {needed} devices but the budget names "
                        f"{devices}; add devices to max_memory or lower the degrees")
    need = 1 if schedule == AUTO else min_micro_batches(schedule, pp) if pp else 1
    if pp is not None and pp > 1 and micro_batches is not None and micro_batches < need:
        raise PlanError(f"micro_batches={micro_batches} < {need} with pp={pp}: schedule {schedule} needs at least one "
                        f"micro-batch per stage; raise --micro-batches to at least {need} or use --schedule GPipe")
    if pp is not None and pp > config.num_hidden_layers:
        raise PlanError(f"pp={pp} is more pipeline stages than the model's {config.num_hidden_layers} layers")
    check_budget_count(world_size, budgets)


def check_lora_at_tp(config, spec: TrainingSpec, *, tp: Optional[int]) -> None:
    """A forced tensor-parallel degree against LoRA on fused expert parameters, which trains at tp=1 only."""
    if spec.method in ("lora", "qlora") and (why := expert_lora_tp_error(config, spec.lora_targets, tp or 1)):
        raise PlanError(why)


def checked_headroom(headroom: float) -> float:
    if not 0 <= headroom < 0.5:
        raise PlanError(f"headroom={headroom}: a fraction of each budget to leave free, from 0 to below 0.5 "
                        "(0.03 keeps 3% of every device free)")
    return float(headroom)
