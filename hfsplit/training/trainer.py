"""The fine-tuning loop over a split model: one readable loop, top to bottom (`hfsplit.training.run` builds
the `Run` it works on).

Every rank runs this same loop (SPMD). Each step: the pipeline schedule runs forward
and backward over the micro-batches, gradients are clipped by their global norm across
pipeline and tensor groups, each rank's optimizer steps over its own parameters.
"""
from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from hfsplit.checkpoint.resolve import load_config
from hfsplit.errors import NonFiniteError, PeerLostError
from hfsplit.load.probes import recheck_speed
from hfsplit.parallel.router import stats_of
from hfsplit.parallel.split_model import SplitModel
from hfsplit.plan import TrainingSpec
from hfsplit.planning.timing import time_report
from hfsplit.training.checkpointer import Checkpointer
from hfsplit.training.elastic import StopAtBoundary, stop_for_regroup
from hfsplit.training.interrupts import interrupted
from hfsplit.training.memory import out_of_memory_is_one_line
from hfsplit.training.data import MicroBatches, TokenRows
from hfsplit.training.metrics import Metrics, StepOutcome, TrainResult, summary_line
from hfsplit.training.options import FinetuneOptions
from hfsplit.training.packing import label_tokens
from hfsplit.training.preference import (DPO_METRICS, DpoLoss, adapters_disabled, batch_sequences, indexed_labels,
                                         local_keys, pairs_of, reference_reduce, segment_tokens, sequence_values)
from hfsplit.training.resume import latest_checkpoint

if TYPE_CHECKING:  # the annotation only: importing peft costs ~3 s (inductor), which a run pays where it adds adapters
    from peft import LoraConfig

__all__ = ["Run", "dpo_eval", "eval_loss", "evaluation", "fit", "train_step"]


def fit(run: Run) -> TrainResult:
    """The loop over a built run (`build_run`): steps, evaluation, checkpoints, the final save; the figures."""
    options = run.options
    stopper = StopAtBoundary()  # torchrun regrouping the ranks: checkpoint at the step's end, then leave
    step = run.first_step - 1
    try:
        for step in range(run.first_step, run.total_steps + 1):
            with out_of_memory_is_one_line(run.model, step=step):
                outcome = train_step(run, next(run.batches))
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


def train_step(run: Run, batch: dict) -> StepOutcome:
    """One optimizer step over `batch` (the global batch; this replica takes its rows): forward and
    backward through the pipeline, global-norm clipping, the optimizer and the schedule. The loss is the token mean
    of the global batch, as transformers' Trainer computes it with `num_items_in_batch`. A step whose loss or
    gradient norm is not finite changes no weight (its gradients are dropped)."""
    model = run.model
    mine = slice(model.ctx.coords.dp * run.rows_per_replica, (model.ctx.coords.dp + 1) * run.rows_per_replica)
    items = label_tokens(batch["labels"])  # the global batch's: the loss is its token mean, on every replica
    busy = model.busy_seconds()
    model.activation_offload_bytes(reset=True)
    start = time.perf_counter()
    ids, labels, positions = batch["input_ids"][mine], batch["labels"][mine], batch["position_ids"][mine]
    mask = {}
    with compute_precision(model):
        if isinstance(run.loss_fn, DpoLoss):  # the loss is the mean over the global batch's pairs
            sequences = batch_sequences(batch)
            labels = dpo_targets(run, ids, labels, positions, sequences=sequences[mine])
            divisor = pairs_of(sequences)  # the global batch's: packed rows hold varying numbers of pairs
            if stats_of(model.stages):  # an MoE's router loss over the pairs' real tokens (TRL's attention mask)
                mask = {"router_mask": torch.arange(ids.shape[1])[None] < batch["lengths"][mine][:, None]}
        else:
            divisor = items
        loss = model.step(ids, labels, run.loss_fn, position_ids=positions, num_items_in_batch=divisor, **mask)
    loss = model.reduce_loss(loss)
    norm = model.grad_norm(run.params)
    outcome = StepOutcome(loss=loss, grad_norm=float(norm), seconds=0.0, busy_s=0.0, tokens=int(batch["lengths"].sum()),
                          trained_tokens=items, positions=batch["input_ids"].numel(),
                          offload_bytes=model.activation_offload_bytes(),
                          extra=dpo_step_metrics(run) if isinstance(run.loss_fn, DpoLoss) else {})
    if outcome.finite:
        clip_(run.params, norm=norm, max_norm=run.options.max_grad_norm)
        run.optimizer.step()
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    outcome.seconds = time.perf_counter() - start
    outcome.busy_s = model.busy_seconds() - busy
    return outcome


def dpo_step_metrics(run: Run) -> dict[str, float]:
    """TRL's DPO metrics of the step on every rank (collective): each replica's last stage holds its pairs'
    means, weighted by its pairs (packed rows give replicas different numbers), so their mean is the global
    batch's."""
    local = run.loss_fn.step_metrics(calls=run.rows_per_replica // run.options.micro_batch_size)
    pairs = local.get("pairs", 0)
    total = run.model.reduce_loss(torch.tensor(float(pairs)))
    return {name: run.model.reduce_loss(torch.tensor(local.get(name, 0.0) * pairs)) / max(total, 1.0)
            for name in DPO_METRICS}


def dpo_targets(run: Run, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, *,
                sequences: torch.Tensor) -> torch.Tensor:
    """The reference log-probs of these rows' sequences (`sequences`: each position's global sequence number,
    `batch_sequences`) for the loss: read from the precomputed table (`--reference precomputed`, keyed by
    sequence), else a no-grad pipeline forward of them with every stage's adapters off, whose last stage reduces
    each micro-batch's logits as they leave it (`SplitModel.forward(reduce=)`: one micro-batch's logits at a
    time) to its rows' log-probs (`reference_reduce`), summed by sequence. Returns the targets the loss reads
    (`indexed_labels`: the labels, each position's sequence key in this batch appended)."""
    run.loss_fn.seen = []  # this step's pairs only (the plan's probes may have run the loss before)
    present, keys = local_keys(sequences)
    if run.loss_fn.precomputed is not None:
        run.loss_fn.reference = run.loss_fn.precomputed[present]
        return indexed_labels(labels, keys)
    packed = run.batches.rows.sequences is not None
    with torch.no_grad(), adapters_disabled(run.model.stages):  # each micro-batch's logits reduced as they come
        reduced = run.model.forward(ids, position_ids=positions, reduce=reference_reduce(packed), targets=labels)
    if reduced is not None:
        run.loss_fn.reference = sequence_values(reduced, keys.to(reduced.device), packed=packed)
    return indexed_labels(labels, keys)


def evaluation(run: Run) -> tuple[float, dict[str, float]]:
    """(eval loss, further eval figures) on the held-out rows: the SFT token mean, or DPO's (`dpo_eval`)."""
    if isinstance(run.loss_fn, DpoLoss):
        return dpo_eval(run.model, run.held_out, run.loss_fn, micro_batch_size=run.options.micro_batch_size,
                        reference=run.held_out_reference)
    return eval_loss(run.model, run.held_out, run.loss_fn, micro_batch_size=run.options.micro_batch_size), {}


@torch.no_grad()
def dpo_eval(model, rows, loss_fn: DpoLoss, *, micro_batch_size: int,
             reference: Optional[torch.Tensor] = None) -> tuple[float, dict[str, float]]:
    """DPO on the held-out pairs, forward only: the mean pair loss against the same reference (`reference`: the
    held-out rows' precomputed log-probs, by sequence; None: the stages with their adapters off) and TRL's metrics
    of those pairs, on every rank."""
    size = micro_batch_size * model.plan.micro_batches  # the training step's shape: same micro-batch count
    seen, packed = [], rows.sequences is not None
    for start in range(0, len(rows) - size + 1, size):
        batch = rows.select(slice(start, start + size))
        logps = dict(position_ids=batch.positions(), reduce=reference_reduce(packed), targets=batch.labels)
        with compute_precision(model):
            if reference is None:
                with adapters_disabled(model.stages):
                    ref = model.forward(batch.input_ids, **logps)
            else:
                ref = None
            policy = model.forward(batch.input_ids, **logps)
        if policy is not None:
            present, keys = local_keys(rows_sequences(batch, start))
            keys, labels = keys.to(policy.device), batch.labels.to(policy.device)
            ref = reference[present] if reference is not None else sequence_values(ref, keys, packed=packed)
            seen.append((sequence_values(policy, keys, packed=packed), ref.to(policy.device),
                         segment_tokens(labels, keys)))
    local = loss_fn.evaluate(*(torch.cat(t) for t in zip(*seen))) if seen else {}
    figures = {name: model.reduce_loss(torch.tensor(local.get(name, 0.0)), replicas=False)
               for name in ("loss", *DPO_METRICS)}
    return figures.pop("loss"), figures


def rows_sequences(rows: TokenRows, first: int) -> torch.Tensor:
    """Each position's sequence number in `rows`: its packed `sequences`, else its row's index (from `first`)."""
    if rows.sequences is not None:
        return rows.sequences
    return torch.arange(first, first + len(rows))[:, None].expand(rows.labels.shape)


@torch.no_grad()
def eval_loss(model, rows, loss_fn, *, micro_batch_size: int) -> float:
    """The token mean of the loss over the held-out rows (forward only through the pipeline), on every rank."""
    size = micro_batch_size * model.plan.micro_batches  # the training step's shape: same micro-batch count
    starts = range(0, len(rows) - size + 1, size)
    items = label_tokens(rows.labels[:len(starts) * size])
    total = 0.0
    for start in starts:
        batch = rows.select(slice(start, start + size))
        with compute_precision(model):
            logits = model.forward(batch.input_ids, position_ids=batch.positions())
        loss = loss_fn(logits, batch.labels.to(logits.device), num_items_in_batch=items) if logits is not None else None
        total += model.reduce_loss(loss, replicas=False)
    return total


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


def compute_precision(model):
    """Autocast to the plan's 16-bit dtype where the weights are fp32 masters (`TrainingSpec.full_autocast_dtype`,
    decided in planning); a no-op otherwise."""
    wanted = model.plan.spec.full_autocast_dtype
    if wanted is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=model.device.type, dtype=getattr(torch, wanted))


def clip_(params: list[torch.nn.Parameter], *, norm: torch.Tensor, max_norm: float) -> None:
    if max_norm and max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(float(scale))


@dataclass
class Run:
    """Everything one fine-tuning run works with, built by `build_run` (the same fields on every rank)."""

    options: FinetuneOptions
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

    @property
    def rows_per_replica(self) -> int:
        """Rows of one optimizer step that this rank's data-parallel replica trains on."""
        return self.model.plan.micro_batches * self.options.micro_batch_size
