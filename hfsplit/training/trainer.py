"""The fine-tuning loop over a split model: one readable loop, top to bottom (`hfsplit.training.run` builds
the `Run` it works on).

Every rank runs this same loop (SPMD). Each step: the pipeline schedule runs forward
and backward over the micro-batches, gradients are clipped by their global norm across
pipeline and tensor groups, each rank's optimizer steps over its own parameters.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from hfsplit.checkpoint.resolve import load_config
from hfsplit.errors import NonFiniteError, PeerLostError
from hfsplit.load.probes import recheck_speed
from hfsplit.parallel.split_model import SplitModel
from hfsplit.plan import TrainingSpec
from hfsplit.planning.timeline import Timeline
from hfsplit.planning.timing import time_report
from hfsplit.training.checkpointer import Checkpointer
from hfsplit.training.elastic import StopAtBoundary, stop_for_regroup
from hfsplit.training.interrupts import interrupted
from hfsplit.training.memory import out_of_memory_is_one_line
from hfsplit.training.data import TokenRows
from hfsplit.training.batches import MicroBatches
from hfsplit.training.metrics import Metrics, StepOutcome, TrainResult, summary_line
from hfsplit.training.evaluation import eval_loss
from hfsplit.training.objective import Objective
from hfsplit.training.precision import compute_precision
from hfsplit.training.resume import latest_checkpoint
from hfsplit.training.timeline import measured_timeline, recorded_step, write_timeline

if TYPE_CHECKING:  # the annotation only: importing peft costs ~3 s (inductor), which a run pays where it adds adapters
    from peft import LoraConfig

__all__ = ["Run", "compute_precision", "eval_loss", "evaluation", "fit", "train_step"]


def fit(run: Run) -> TrainResult:
    """The loop over a built run (`build_run`): steps, evaluation, checkpoints, the final save; the figures."""
    options = run.options
    stopper = StopAtBoundary()  # torchrun regrouping the ranks: checkpoint at the step's end, then leave
    step = run.first_step - 1
    recorded = recorded_step(options.timeline_step, total_steps=run.total_steps)
    try:
        for step in range(run.first_step, run.total_steps + 1):
            with out_of_memory_is_one_line(run.model, step=step):
                outcome = train_step(run, next(run.batches), record=step == recorded)
            if not outcome.finite:
                skip_or_stop(run, step, outcome)
                continue
            run.metrics.stepped(step, outcome, lr=run.scheduler.get_last_lr()[0], device=run.model.device)
            if options.eval_every and step % options.eval_every == 0:
                run.metrics.evaluated(step, *evaluation(run))
            stop = step < run.total_steps and stopper.now()
            folder = run.checkpointer.after_step(step, total_steps=run.total_steps, force=stop)
            if stop:
                stop_for_regroup(stopper, run.metrics.log, step=step, checkpoint=folder)
        run.metrics.close_bar()
        saved = run.checkpointer.final()
        result = run.metrics.finish()
        result.saved_to = str(saved)
        if run.timeline is not None:  # rank 0's, of the recorded step
            result.timeline_json = str(write_timeline(run.timeline, run.model.plan, options.output_dir, step=recorded))
            print(f"step {recorded} as the ranks ran it: {result.timeline_json}", flush=True)
        # Leave together: a rank tearing down gloo while a peer still talks to it can abort the peer.
        dist.barrier()
    except RuntimeError as exc:  # torch.distributed errors (gloo, nccl, timeouts) are RuntimeErrors
        if not is_peer_failure(exc):
            raise
        raise peer_lost_error(exc, step=step, output_dir=options.output_dir) from None
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (`interrupts.sigterm_interrupts`)
        raise interrupted(options.output_dir, step=step + 1 if step < run.first_step else step) from None
    finally:
        run.metrics.close_bar()  # an error then prints on a line of its own, not after the bar
    if dist.get_rank() == 0:
        print(time_report(run.model.plan, result.step_times_s, result.busy_s_per_rank), flush=True)
        recheck_calibration(run, result)
        print(summary_line(result), flush=True)
    return result


def train_step(run: Run, batch: dict, *, record: bool = False) -> StepOutcome:
    """One optimizer step over `batch` (the global batch; this replica takes its rows, `Objective.step_rows`): forward
    and backward through the pipeline, global-norm clipping, the optimizer and the schedule. The loss is the
    objective's share per micro-batch of the global batch's (the causal-LM loss: the token mean, as transformers'
    Trainer computes it with `num_items_in_batch`). A step whose loss or gradient norm is not finite changes no
    weight (its gradients are dropped). `record`: every rank keeps its pipeline actions of the step, and rank 0 the
    step's measured timeline in `run.timeline` (a barrier and a gather after the step's timing)."""
    model = run.model
    actions = [] if record else None
    busy = model.busy_seconds()
    model.activation_offload_bytes(reset=True)
    start = time.perf_counter()
    with compute_precision(model):
        rows = run.objective.step_rows(run, batch)
        loss = model.step(rows.input_ids, rows.targets, run.loss_fn, position_ids=rows.position_ids,
                          num_items_in_batch=rows.divisor, record=actions, **rows.forward)
    loss = model.reduce_loss(loss)
    norm = model.grad_norm(run.params)
    extra = run.objective.step_metrics(run)
    outcome = StepOutcome(loss=loss, grad_norm=float(norm), seconds=0.0, busy_s=0.0, tokens=rows.tokens,
                          trained_tokens=rows.trained_tokens, positions=rows.positions,
                          offload_bytes=model.activation_offload_bytes(), extra=extra, bar=run.objective.bar(extra))
    if outcome.finite:
        clip_(run.params, norm=norm, max_norm=run.options.max_grad_norm)
        run.optimizer.step()
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    outcome.seconds = time.perf_counter() - start
    outcome.busy_s = model.busy_seconds() - busy
    if actions is not None:
        run.timeline = measured_timeline(model, actions)
    return outcome


def evaluation(run: Run) -> tuple[float, dict[str, float]]:
    """(eval loss, further eval figures) on the held-out rows, as the run's objective evaluates."""
    return run.objective.evaluate(run)


def skip_or_stop(run: Run, step: int, outcome: StepOutcome) -> None:
    """--on-nonfinite: log the non-finite step, then end the run (stop) or go on without it (skip)."""
    run.metrics.nonfinite(step, outcome)
    if run.options.on_nonfinite == "stop":
        raise NonFiniteError(
            f"step {step}: loss {outcome.loss} / gradient norm {outcome.grad_norm} is not finite; the weights are "
            f"those of step {step - 1}. Lower --learning-rate or --max-grad-norm, check the data, "
            "or pass --on-nonfinite skip to drop such steps")
    run.metrics.skipped(step, outcome)


def recheck_calibration(run: Run, result: TrainResult) -> None:
    """Rank 0, which planned: a cached FLOP/s this run's busy time contradicts is replaced by the run's rate."""
    line = recheck_speed(run.model.plan, load_config(run.model_path), run.model.device,
                         step_times_s=result.step_times_s, busy_s=result.busy_s_per_rank, spec=run.calibration_spec)
    if line:
        print(line, flush=True)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc` says another rank is gone or silent (as opposed to a bug on this rank)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()  # gloo reports a vanished peer as a plain RuntimeError
    return any(sign in text for sign in ("connection closed", "connection reset", "broken pipe", "timed out"))


def peer_lost_error(exc: BaseException, *, step: int, output_dir: str) -> PeerLostError:
    """The one-line error a surviving rank ends with, pointing at what is left to resume from."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    reason = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0]  # drop the "[gloo/.../pair.cc:537]" prefix
    last = latest_checkpoint(output_dir)
    resume = f"The last complete checkpoint is {last}; resume with --resume latest" if last else \
        "No checkpoint was saved yet (use --save-every N)"
    return PeerLostError(f"rank {dist.get_rank()} lost contact with another rank during step {step} ({reason[:160]}): "
                         f"a rank died or hung (--peer-timeout bounds the wait). {resume}")


def clip_(params: list[torch.nn.Parameter], *, norm: torch.Tensor, max_norm: float) -> None:
    if max_norm and max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(float(scale))


@dataclass
class Run:
    """Everything one fine-tuning run works with, built by `build_run` (the same fields on every rank)."""

    options: "FinetuneOptions"  # hfsplit.training.options, built above the loop
    model: SplitModel
    model_path: str
    tokenizer: object
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: MicroBatches  # over the training rows
    held_out: Optional[TokenRows]  # for --eval-every, else None
    loss_fn: Callable
    total_steps: int
    metrics: Metrics
    checkpointer: Checkpointer
    lora_config: Optional[LoraConfig] = None  # the adapters' (LoRA / QLoRA runs), saved beside them
    first_step: int = 1
    calibration_spec: Optional[TrainingSpec] = None  # the TrainingSpec the plan's FLOP/s was measured with
    held_out_reference: Optional[torch.Tensor] = None  # the held-out rows' precomputed reference log-probs, by row
    objective: Objective = field(default_factory=Objective)  # what the loop trains for (the causal-LM loss by default)
    timeline: Optional[Timeline] = None  # rank 0: the recorded step as the ranks ran it (`train_step(record=True)`)

    @property
    def rows_per_replica(self) -> int:
        """Rows of one optimizer step that this rank's data-parallel replica trains on."""
        return self.model.plan.micro_batches * self.options.micro_batch_size
