"""The pipeline: torch.distributed.pipelining stages and the schedule the plan names."""
from __future__ import annotations

import contextlib
import functools
import inspect
import time
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from hfsplit.errors import PlanError
from hfsplit.models.loss import ChunkedHeadLoss, takes_logps
from hfsplit.schedules import TABLE


def schedule_class(name: str):
    """The torch.distributed.pipelining schedule class called `name` in a Plan."""
    import torch.distributed.pipelining as pipelining

    if name not in TABLE:
        raise PlanError(f"schedule {name!r} is unknown; choose one of {sorted(TABLE)}")
    if not hasattr(pipelining, TABLE[name].torch_class):
        raise PlanError(f"schedule {name!r} needs torch.distributed.pipelining.{TABLE[name].torch_class}, which this "
                        f"torch lacks; upgrade torch or choose another schedule")
    return getattr(pipelining, TABLE[name].torch_class)


def pipeline_stages(modules: Sequence[nn.Module], *, indices: Sequence[int], num_stages: int,
                    device: torch.device, group) -> list:
    """PipelineStage wrappers of this rank's stage modules (cheap: the modules are shared)."""
    from torch.distributed.pipelining import PipelineStage

    return [PipelineStage(m, i, num_stages, device, group=group) for m, i in zip(modules, indices)]


def releasing_graph(loss_fn: Callable) -> Callable:
    """`loss_fn` whose loss lets go of its autograd graph once backward has run through it.

    A schedule keeps every micro-batch's loss until the step ends (`_internal_losses`), and with it the last
    stage's whole graph. Saved tensors are freed by backward anyway, but what a custom autograd Function stored
    as a ctx attribute is not: bitsandbytes' 8-bit matmul keeps each linear's input there (`ctx.A`), so an
    8-bit last stage held every micro-batch's linear inputs until the step's end (measured 1.25-1.45x its plan).
    Detaching the loss in place when its own node has run (the value and gradients are unchanged) frees them."""
    import weakref

    def release(_grads_in, _grads_out, loss_ref) -> None:
        loss = loss_ref()
        if loss is not None:
            loss.detach_()

    def with_release(*args, **kwargs):
        loss = loss_fn(*args, **kwargs)
        if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
            ref = weakref.ref(loss)  # no cycle loss -> grad_fn -> hook -> loss
            loss.grad_fn.register_hook(lambda grads_in, grads_out: release(grads_in, grads_out, ref))
        return loss

    return with_release


def _takes_loss_kwargs() -> bool:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return "loss_kwargs" in inspect.signature(PipelineScheduleSingle.step).parameters


# torch 2.12+ hands a step's `loss_kwargs` to the loss; before, a step's keywords all went to the first stage
SCHEDULE_TAKES_LOSS_KWARGS = _takes_loss_kwargs()


def with_step_kwargs(loss_fn: Callable, held: dict) -> Callable:
    """`loss_fn` called with the keywords in `held` as well (the step sets them: its `num_items_in_batch`), for a
    torch whose schedules take no `loss_kwargs` (`SCHEDULE_TAKES_LOSS_KWARGS`)."""
    @functools.wraps(loss_fn)
    def loss(output, target, **kwargs):
        return loss_fn(output, target, **{**held, **kwargs})
    return loss


def build_schedule(name: str, stages: list, *, micro_batches: int, loss_fn: Optional[Callable]):
    """The schedule `name` over `stages` (a list even for single-stage schedules).

    `loss_fn=None` gives a forward-only schedule whose `step` returns the last stage's outputs. Gradients are not
    scaled by the micro-batch count (`scale_grads=False`): each micro-batch's loss is already its part of the
    step's mean (a sum over the step's label tokens, `SplitModel.step`).
    """
    cls = schedule_class(name)
    if TABLE[name].stages_per_rank == 1:
        if len(stages) != 1:
            raise PlanError(f"schedule {name} runs one stage per rank, this rank has {len(stages)}")
        return cls(stages[0], n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False)


class ReducedOutput(nn.Module):
    """A last stage whose output is `reduce(logits, targets)` of its micro-batch (`SplitModel.forward(reduce=)`).

    A forward-only schedule keeps each micro-batch's last-stage output (torch's `output_chunks` and `fwd_cache`)
    until its next step: the logits of every micro-batch would stay. Reduced inside the stage's forward, only the
    reduction stays; the logits (and the reduction's own transients) are one micro-batch's at a time. `seq`: the
    rows' length (a micro-batch joined into one row, `SplitModel.join_rows`, is its rows again here)."""

    def __init__(self, stage: nn.Module, reduce: Callable, seq: int):
        super().__init__()
        self.stage, self.reduce, self.seq = stage, reduce, seq

    def forward(self, x: torch.Tensor, *, position_ids: Optional[torch.Tensor] = None,
                targets: Optional[torch.Tensor] = None):
        logits = self.stage(x, position_ids=position_ids)
        return self.reduce(logits.reshape(-1, self.seq, logits.shape[-1]), targets.reshape(-1, self.seq))


class StageTimer:
    """Seconds this rank spends computing inside its pipeline stages (forward and backward chunks).

    `watch` wraps a PipelineStage's chunk methods before a schedule runs it; the schedule's
    waits on peers fall outside them, so busy time over wall time is the measured non-bubble share.
    While `recording`, each chunk call is also kept as an action `(stage, kind, micro_batch, start, end)`
    (perf_counter seconds; kind as `hfsplit.planning.timeline` names them), a measured timeline's raw rows. A GPU
    runs a chunk's kernels after the call returns: while recording, its stream is waited for at both stamps, so they
    hold the kernels (the recorded step loses its CPU-GPU overlap at a chunk's edges; no number changes).
    """

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.actions: Optional[list] = None

    @contextlib.contextmanager
    def recording(self, actions: Optional[list]):
        """Append the chunk calls made inside the block to `actions` (None: record nothing)."""
        self.actions = actions
        try:
            yield
        finally:
            self.actions = None

    def watch(self, stages: list) -> list:
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name), stage=stage.stage_index, name=name,
                                                     device=getattr(stage, "device", None)))
        return stages

    def _timed(self, fn, *, stage: int, name: str, device: Optional[torch.device]):
        def run(chunk, *args, **kwargs):
            start = self._now(device)
            try:
                return fn(chunk, *args, **kwargs)
            finally:
                end = self._now(device)
                self.busy_s += end - start
                if self.actions is not None:
                    self.actions.append((stage, chunk_kind(name, args, kwargs), chunk, start, end))

        return run

    def _now(self, device: Optional[torch.device]) -> float:
        """perf_counter, once a GPU's queued kernels have run when recording."""
        if self.actions is not None and device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def with_loss_in_forward(self, loss_fn: Callable, *, device: Optional[torch.device] = None) -> Callable:
        """`loss_fn` whose time, while recording, ends the forward it follows: a schedule computes the last stage's
        loss between its forward and backward chunks (torch's `_maybe_compute_loss`), and the time model counts the
        head and the loss in that stage's forward."""
        def timed(*args, **kwargs):
            try:
                return loss_fn(*args, **kwargs)
            finally:
                if self.actions and self.actions[-1][1] == "F":
                    stage, kind, chunk, start, _ = self.actions[-1]
                    self.actions[-1] = (stage, kind, chunk, start, self._now(device))

        return timed


def chunk_kind(name: str, args: tuple, kwargs: dict) -> str:
    """The action a stage's chunk method runs: F, B, or a split backward's input (I) and weight (W) gradients."""
    if name == "forward_one_chunk":
        return "F"
    if name == "backward_weight_one_chunk":
        return "W"
    full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)  # (loss, full_backward, ...)
    return "B" if full else "I"


def chunked_or(loss_fn: Optional[Callable], stages, *, plan) -> Optional[Callable]:
    """The loss the schedule runs: `loss_fn` itself, or, under a `chunked_loss` plan, the chunked causal-LM loss
    of this rank's last stage, or `loss_fn` fed chunked sequence log-probs where it `takes_logps` (DPO's); one
    object per stage and loss, so the schedule cache keeps one entry."""
    last = [s for s in stages if s.has_head]
    if loss_fn is None or not plan.spec.chunked_loss or not last:
        return loss_fn
    if takes_logps(loss_fn):  # DPO's: its sequence log-probs chunk by chunk, one wrapper per loss object
        if getattr(getattr(last[0], "chunked_logps_loss", None), "loss_fn", None) is not loss_fn:
            last[0].chunked_logps_loss = ChunkedHeadLoss(last[0], loss_fn)
        return last[0].chunked_logps_loss
    if not getattr(loss_fn, "causal_lm", False):
        raise PlanError("a chunked_loss plan computes the causal-LM loss (or DPO's log-probs) itself, chunk by "
                        "chunk; pass hfsplit.models.loss.causal_lm_loss or plan with chunked_loss=False")
    if not hasattr(last[0], "chunked_loss"):
        last[0].chunked_loss = ChunkedHeadLoss(last[0])
    return last[0].chunked_loss


@contextlib.contextmanager
def head_in_loss(stages, *, enabled: bool):
    """While a training step runs, the last stage stops at its final norm (its loss applies lm_head); its
    forward outside a step (logits for generation, evaluation) stays whole."""
    heads = [s for s in stages if s.has_head] if enabled else []
    for stage in heads:
        stage.head_in_loss = True
    try:
        yield
    finally:
        for stage in heads:
            stage.head_in_loss = False
