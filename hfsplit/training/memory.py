"""Out of memory inside a training step: one line naming the stage, its planned and measured peak,
and a re-plan that fits, instead of a traceback.

Test hook (for tests only, not an option): HFSPLIT_TEST_OOM_AT_STEP="STEP" or "STEP:RANK" makes that
rank (default 0) really fail an allocation (an impossibly large tensor on its device) in the
forward of its first stage during optimizer step STEP, so the handling is exercised on CPU.
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import Optional

import torch
import torch.distributed as dist

from hfsplit.errors import HfsplitError, OutOfMemory
from hfsplit.parallel.mesh import launcher_world
from hfsplit.training.metrics import peak_memory_bytes

INJECT = "HFSPLIT_TEST_OOM_AT_STEP"
_GIB = 1 << 30


def out_of_memory_in(exc: Optional[BaseException]) -> Optional[BaseException]:
    """The CUDA out-of-memory, or the CPU allocator's failure (a plain RuntimeError), behind `exc`:
    torch.distributed.pipelining re-raises a stage's error as a RuntimeError caused by it."""
    while exc is not None:
        if isinstance(exc, torch.OutOfMemoryError) or (
                isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def out_of_memory_is_one_line(model, *, step: int):
    """Run one step; an allocation failure inside it becomes an `OutOfMemory` with the one line."""
    hooks = _inject(model, step)
    try:
        yield
    except RuntimeError as exc:  # torch.OutOfMemoryError is one
        failure = out_of_memory_in(exc)
        if failure is None:
            raise
        raise OutOfMemory(oom_message(model, failure, step=step)) from None
    finally:
        for hook in hooks:
            hook.remove()


def _inject(model, step: int) -> list:
    wanted = os.environ.get(INJECT)
    if not wanted:
        return []
    at, _, rank = wanted.partition(":")
    restarted = launcher_world().restart_count > 0
    if int(at) != step or int(rank or 0) != dist.get_rank() or restarted:  # a fault happens once, as a lost
        return []  # machine does: the launcher's restart then runs on (tests the restart path alone)

    def fail(module, args):
        torch.empty(1 << 62, dtype=torch.uint8, device=model.device)  # a real allocation failure

    return [model.stages[0].register_forward_pre_hook(fail)]


def oom_message(model, exc: BaseException, *, step: int) -> str:
    """Stage, planned and measured peak, budget, and the --max-memory under which the planner fits it."""
    plan, coords = model.plan, model.ctx.coords
    stages = plan.stages_of_rank(coords.pp)
    planned = sum(s.memory.total for s in stages)
    budget = min(s.budget for s in stages)
    measured = peak_memory_bytes(model.device)
    asked = _asked_bytes(str(exc))
    # The planner under-estimated this stage by needed/planned: plan again as if every budget were that
    # much smaller (and by a quarter at least), so its estimates leave the headroom the real step needs.
    # A CPU rank's measure is its process RSS (interpreter and libraries too): not comparable, not used.
    needed = (measured if model.device.type == "cuda" else planned) + asked
    factor = max(needed / planned if planned else 1.0, 1.25)
    layers = ", ".join(f"{s.layers[0]}-{s.layers[1] - 1}" for s in stages)
    return (f"rank {dist.get_rank()} (stage {stages[0].index}, layers {layers}) ran out of memory in step {step}: "
            f"planned peak {planned / _GIB:.2f} GiB, measured {measured / _GIB:.2f} GiB"
            + (f" + {asked / _GIB:.2f} GiB asked" if asked else "")
            + f", budget {budget / _GIB:.2f} GiB; {_replan(plan, budget=int(budget / factor))}")


def _asked_bytes(text: str) -> int:
    """The allocation that failed, as CUDA ("Tried to allocate 2.00 GiB") or the CPU allocator report it."""
    cpu = re.search(r"tried to allocate (\d+) bytes", text)
    if cpu:
        return int(cpu.group(1)) if int(cpu.group(1)) < (1 << 50) else 0  # an injected failure asks the impossible
    cuda = re.search(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB)", text)
    if not cuda:
        return 0
    return int(float(cuda.group(1)) * {"GiB": _GIB, "MiB": 1 << 20, "KiB": 1 << 10}[cuda.group(2)])


def _replan(plan, *, budget: int) -> str:
    """The plan the planner makes with every budget cut to `budget`, as the flags that ask for it."""
    from hfsplit.planning.planner import make_plan  # lazy: the loop loads the planner only to explain an OOM

    flag = f"--max-memory {plan.world_size}x{max(budget, 1 << 20) >> 20}MiB"
    try:
        fits = make_plan(plan.model, f"{plan.world_size}x{budget}B", spec=plan.spec,
                         micro_batches=plan.micro_batches, schedule=plan.schedule, world_size=plan.world_size,
                         activation_checkpointing="auto")
    except HfsplitError:
        return (f"no split fits {flag}; lower --micro-batch-size (and raise --micro-batches to keep the batch) "
                "or add devices")
    return (f"a re-plan that fits: {flag} gives pp={fits.pp} tp={fits.tp} dp={fits.dp}, "
            f"activation checkpointing {fits.spec.checkpointing}, "
            f"planned peak {max(s.memory.total for s in fits.stages) / _GIB:.2f} GiB")
