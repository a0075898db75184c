"""The launch: plan on rank 0, share the plan with every rank, build this rank's SplitModel.

The one place where running a split meets planning it: `split_model` runs a given Plan and
never imports the planner; this module calls the planner only when no plan is given.
"""
from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from hfsplit import errors
from hfsplit.apply.lora import LoraSetup
from hfsplit.budget import local_share
from hfsplit.apply.quantize import check_quantization, quantization_config_of
from hfsplit.checkpoint.quantized import quantization_of_checkpoint
from hfsplit.errors import PlanError
from hfsplit.parallel.mesh import init_distributed, init_parallel, launcher_world
from hfsplit.parallel.split_model import SplitModel, build_split_model
from hfsplit.checkpoint.resolve import load_config
from hfsplit.load.proof import proven_split
from hfsplit.load.tp_proof import forked_prover, proven_tp
from hfsplit.plan import Plan, TrainingSpec
from hfsplit.planning.planner import make_plan

T = TypeVar("T")


def split_from_pretrained(name_or_path: str, max_memory=None, *, plan: Optional[Plan] = None,
                          dtype: Optional[torch.dtype] = None, lora: Optional[LoraSetup] = None,
                          quantization_config=None, training: str = "inference", lora_seed: int = 0,
                          **plan_options) -> SplitModel:
    """Load `name_or_path` split over the ranks of a distributed launch (torchrun / accelerate launch).

    Rank 0 plans (unless `plan` is given) and shares the plan, so every rank runs the same
    one; a plan that does not match the launch fails on every rank before any weight is read.

    Args:
        name_or_path: hub name or local folder.
        max_memory: per-device budget for the planner (ignored when `plan` is given); None: an equal share of what
            this host's devices have free, one budget a rank, as the recipe's (`hfsplit.budget.local_share`).
        plan: a ready Plan to run instead of planning.
        dtype: override the plan's dtype for the weights.
        lora: the LoRA of a LoRA plan (default: the plan's own, `TrainingSpec` rank, alpha, dropout, targets).
        quantization_config: a transformers `BitsAndBytesConfig`: the blocks' linears are quantized as read (QLoRA);
            default: the QLoRA plan's own (`TrainingSpec`'s knobs), or a pre-quantized checkpoint's.
        training: what the plan budgets memory for when no `spec` is given: "inference" (weights, generation's KV
            cache, one forward), "lora" or "full" (`spec_of_intent`); QLoRA with `quantization_config`.
        lora_seed: what the plan's own LoRA draws its A matrices from.
        **plan_options: passed to `hfsplit.planning.planner.make_plan` (spec, micro_batches, schedule, tp, pp, dp).
    """
    given = launcher_world()  # rank 0 forks its tp proof's prover before it joins the group (`forked_prover`)
    with forked_prover(given.rank == 0 and given.world_size > 1 and (plan is None or plan.tp > 1)) as measure:
        world = init_distributed()  # before the plan broadcast (NCCL: one GPU per rank; the plan's GPU follows)
        proven_split(load_config(name_or_path))  # the split equals transformers on this config, or refused by name
        if plan is None:
            wanted = quantization_of_checkpoint(name_or_path, quantization_config, method="qlora"
                                                if quantization_config is not None else training)  # or as stored
            spec = plan_options.pop("spec", None) or spec_of_intent(
                training, dtype=dtype or load_config(name_or_path).dtype, quantization=wanted)
            plan_options.setdefault("gpus", world.device.type == "cuda")  # CPU ranks: "0", "1" budgets aren't GPUs
            if max_memory is None:
                max_memory = local_share(world.world_size, ranks_here=world.local_world_size)
            plan = shared_plan(name_or_path, max_memory, spec=spec, **plan_options)
        shared_tp_proof(name_or_path, plan, measure)
    ctx = init_parallel(plan)
    qconfig = quantization_of_run(plan, name_or_path, requested=quantization_config, device=ctx.device)
    return build_split_model(plan, name_or_path, ctx=ctx, dtype=dtype, lora=lora, lora_seed=lora_seed,
                             quantization_config=qconfig)


def shared_tp_proof(name_or_path: str, plan: Plan, measure=None) -> None:
    """Under a plan with tp > 1: rank 0 proves the tensor-parallel split on this config (`proven_tp`: two child
    processes with their own rendezvous, never this launch's group; cached; measured by `measure`, as
    `tp_verdict_of`'s) and every rank raises its refusal, or whatever else the proof hit there (`on_rank0`)."""
    if plan.tp > 1:
        on_rank0(lambda: proven_tp(load_config(name_or_path), plan.tp, measure),
                 what="the tensor-parallel proof", failed=errors.UnsupportedModelError)


def quantization_of_run(plan: Plan, source: str, *, requested, device: torch.device):
    """The `BitsAndBytesConfig` a split loads `source` with (None: 16-bit): the caller's, else the QLoRA plan's
    own (`quantization_config_of` its spec), as a pre-quantized checkpoint stores it (`quantization_of_checkpoint`,
    which refuses a pre-quantized base under a LoRA or full plan); refused in one line where bitsandbytes cannot
    serve it on `device`, before any weight is read."""
    if requested is None and plan.spec.method == "qlora":
        requested = quantization_config_of(plan.spec)
    qconfig = quantization_of_checkpoint(source, requested, method=plan.spec.method)
    if qconfig is not None:
        check_quantization(qconfig, device=device)
    return qconfig


def spec_of_intent(training: str, *, dtype, quantization=None) -> TrainingSpec:
    """The TrainingSpec `from_pretrained` plans for its intent `training` ("inference", "lora", "qlora", "full"),
    its weights in `dtype` (a torch dtype or its name; None: bfloat16); with `quantization` (a `BitsAndBytesConfig`:
    the caller's, or a pre-quantized checkpoint's), QLoRA with its knobs."""
    name = str(dtype).removeprefix("torch.") if dtype is not None else "bfloat16"
    if quantization is None:
        return TrainingSpec(method=training, dtype=name)
    return TrainingSpec(method="qlora", dtype=name, load_in_8bit=bool(quantization.load_in_8bit),
                        bnb_4bit_quant_type=quantization.bnb_4bit_quant_type,
                        bnb_4bit_use_double_quant=bool(quantization.bnb_4bit_use_double_quant))


def shared_plan(name_or_path: str, max_memory, **plan_options) -> Plan:
    """The plan made on rank 0 and broadcast; a planning error is raised on every rank (no hang, `on_rank0`)."""
    return Plan.from_json(on_rank0(lambda: make_plan(name_or_path, max_memory, **plan_options).to_json(),
                                   what="planning", failed=PlanError))


def on_rank0(work: Callable[[], T], *, what: str, failed: type[errors.HfsplitError]) -> T:
    """`work()` run on rank 0 alone, its (picklable) result shared with every rank; whatever rank 0 hits is raised
    on every rank, so no rank waits forever in the broadcast.

    An hfsplit error (bad budget, nothing fits, unsupported model...) is raised on every rank with its own type and
    message; anything else rank 0 re-raises as it came (a bug keeps its traceback there), and the other ranks raise
    `failed` naming `what` failed on rank 0 and the error's first line.
    """
    box: list = [None]
    failure: Optional[BaseException] = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", work())
        except Exception as exc:  # raised on every rank below
            failure = exc
            kind = type(exc).__name__ if isinstance(exc, errors.HfsplitError) else ""
            first = (str(exc).strip().splitlines() or [""])[0]
            box[0] = ("error", kind, str(exc) if kind else f"{what} failed on rank 0: {type(exc).__name__}: {first}")
    dist.broadcast_object_list(box, src=0)
    if box[0][0] == "ok":
        return box[0][1]
    if failure is not None:
        raise failure
    _, kind, message = box[0]
    error_type = getattr(errors, kind, None) if kind else None
    raise (error_type if isinstance(error_type, type) and issubclass(error_type, errors.HfsplitError)
           else failed)(message)
