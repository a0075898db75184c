"""Direct preference optimisation (issue 23), as TRL's `DPOTrainer` has it: each prompt/chosen/rejected example is
two sequences (two padded rows of one micro-batch, or two isolated sequences of a packed row); the loss is the mean
over the global batch's pairs of -log σ(β·(policy log-ratio − reference log-ratio)), with the reference the same
stages with their adapters off (LoRA) or log-probs precomputed before training (`hfsplit.training.reference`).
The data and the loss are `hfsplit.training.preference`'s; this module is what the loop calls.
"""
from __future__ import annotations

from typing import Optional

import torch

from hfsplit.errors import HfsplitError
from hfsplit.parallel.router import stats_of
from hfsplit.training.data import TokenRows
from hfsplit.objectives.options import DpoRules, reference_of
from hfsplit.training.objective import Objective, StepRows, replica_rows
from hfsplit.training.packing import label_tokens
from hfsplit.training.precision import compute_precision
from hfsplit.training.preference import (DPO_METRICS, DpoLoss, adapters_disabled, batch_sequences, indexed_labels,
                                         load_paired_rows, local_keys, pairs_of, reference_reduce, segment_tokens,
                                         sequence_values)
from hfsplit.training.reference import precompute_reference


class Dpo(DpoRules, Objective):
    """`--objective dpo`."""

    name = "dpo"
    metric_names = DPO_METRICS

    def check_model(self, options, config) -> None:
        check_dpo_router_eval(options, config)

    def load_rows(self, options, tokenizer, *, source: str, packing: bool) -> TokenRows:
        return load_paired_rows(source, tokenizer, seq_len=options.seq_len, packing=packing, seed=options.seed)

    def cached_examples(self, options, rows: TokenRows) -> Optional[int]:
        """Every sequence's pair, training and held-out (`precompute_reference` keeps one fp32 log-prob of each:
        packed rows hold several pairs)."""
        if reference_of(options) != "precomputed":
            return None
        return (rows.examples if rows.sequences is not None else len(rows)) // 2

    def loss(self, options, model):
        return DpoLoss(beta=options.beta, loss_type=options.dpo_loss)

    def prepare(self, run, *, progress: bool) -> None:
        if reference_of(run.options) == "precomputed":  # the starting weights', not a resume's
            run.loss_fn.precomputed, run.held_out_reference = precompute_reference(run, progress=progress)

    def step_rows(self, run, batch: dict) -> StepRows:
        """The loss is the mean over the global batch's pairs; the targets carry the reference log-probs' keys."""
        mine, model = replica_rows(run), run.model
        ids, positions = batch["input_ids"][mine], batch["position_ids"][mine]
        sequences = batch_sequences(batch)
        targets = dpo_targets(run, ids, batch["labels"][mine], positions, sequences=sequences[mine])
        mask = {}
        if stats_of(model.stages):  # an MoE's router loss over the pairs' real tokens (TRL's attention mask)
            mask = {"router_mask": torch.arange(ids.shape[1])[None] < batch["lengths"][mine][:, None]}
        # the global batch's pairs: packed rows hold varying numbers of them
        return StepRows(ids, targets, positions, divisor=pairs_of(sequences), forward=mask,
                        tokens=int(batch["lengths"].sum()), trained_tokens=label_tokens(batch["labels"]),
                        positions=batch["input_ids"].numel())

    def step_metrics(self, run) -> dict[str, float]:
        return dpo_step_metrics(run)

    def bar(self, metrics: dict) -> dict[str, str]:
        """The reward margin and the pairs ranked right."""
        if "rewards/margins" not in metrics:
            return {}
        return {"margin": f"{metrics['rewards/margins']:.3f}", "acc": f"{metrics['rewards/accuracies']:.2f}"}

    def evaluate(self, run) -> tuple[float, dict[str, float]]:
        return dpo_eval(run.model, run.held_out, run.loss_fn, micro_batch_size=run.options.micro_batch_size,
                        reference=run.held_out_reference)


def check_dpo_router_eval(options, config) -> None:
    """One line for --eval-every under DPO on an MoE adding its router loss: TRL's eval_loss adds the router term
    of each held-out pair's forward, which the forward-only pipeline evaluation does not compute."""
    if options.objective == "dpo" and options.eval_every and getattr(config, "output_router_logits", False):
        raise HfsplitError("--eval-every under --objective dpo on an MoE with output_router_logits: the evaluation "
                           "runs forward only and has no router auxiliary loss for eval_loss (TRL's includes it); "
                           "drop --eval-every, or set output_router_logits false in the model's config")


def dpo_step_metrics(run) -> dict[str, float]:
    """TRL's DPO metrics of the step on every rank (collective): each replica's last stage holds its pairs'
    means, weighted by its pairs (packed rows give replicas different numbers), so their mean is the global
    batch's."""
    local = run.loss_fn.step_metrics(calls=run.rows_per_replica // run.options.micro_batch_size)
    pairs = local.get("pairs", 0)
    total = run.model.reduce_loss(torch.tensor(float(pairs)))
    return {name: run.model.reduce_loss(torch.tensor(local.get(name, 0.0) * pairs)) / max(total, 1.0)
            for name in DPO_METRICS}


def dpo_targets(run, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, *,
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
