"""What DPO's reference policy costs a stage, beside the training pass the cost model traces (issue 23).

A DPO micro-batch is its pairs' chosen and rejected rows (`TrainingSpec.micro_batch_size` counts rows), so the
traced activations, masks and logits are those of its rows, and the head is traced with the DPO loss
(`hfsplit.models.loss.dpo_head_loss`: each row's fp32 log-softmax, kept detached for the metrics; under
`chunked_loss` chunk by chunk, `chunked_sequence_logps`).

**adapters-off** (LoRA, QLoRA): before each step's training pass, the run (`hfsplit.objectives.dpo.dpo_targets`)
sends the step's rows through the same stages with no gradients and the adapters off, as the model's forward runs
them (`hfsplit.parallel.split_model.SplitModel.forward`):

- one stage a rank: a forward-only GPipe schedule over the step's micro-batches (its own PipelineStages beside the
  training schedule's), whose stages keep each micro-batch's output (torch's `fwd_cache`) until the next reference
  pass, so through the training pass too, and after the first stage one receive buffer a micro-batch for good
  (`hfsplit.planning.buffers`): a hidden state each, and on the last stage its rows' fp32 log-probs, to which it
  reduces each micro-batch's logits as they leave it (`SplitModel.forward(reduce=sequence_logps)`), so its pass holds one micro-batch's logits, their
  fp32 copy and fp32 log-softmax at a time, whatever the micro-batch count;
- several stages a rank (interleaved, V): one relay forward of all the step's rows at once, nothing kept after it
  but the last stage's log-probs; its last stage holds the step's logits at once.

The stage's peak is then what the reference keeps plus the larger of the training pass's activations and the
reference pass's own transient (the two passes do not overlap). The last stage keeps one fp32 log-prob a row (two
under GPipe: torch's `fwd_cache` holds each micro-batch's beside the joined copy the loss reads).
Time: the reference's forward of each micro-batch on each stage (`forward_fraction` of its training pass); within
the pipelined schedule it is part of the stage's busy time (`Stage.time_s`); the relay forward runs stage after
stage and adds to the step.

**precomputed** (full fine-tuning): one no-grad pass over the data before training (its seconds reported per
global batch in `Plan.reference_s`, not in the step); the last stage keeps 2 fp32 log-probs a pair of the data set
(`TrainingSpec.reference_pairs`).
"""
from __future__ import annotations

FP32 = 4


def reference_rows(spec, micro_batches: int) -> int:
    """Rows of one replica's step: what one reference pass covers."""
    return spec.micro_batch_size * micro_batches


def reference_bytes(costs, *, has_embed: bool, has_head: bool, micro_batches: int, relay: bool) -> tuple[int, int]:
    """(kept, transient): bytes the reference keeps on one rank of a stage through the step, and the peak of its
    own pass beyond them; (0, 0) where the objective declares none (`TrainingSpec.reference_pass`)."""
    spec = costs.spec
    if not spec.reference_pass:
        return 0, 0
    rows = reference_rows(spec, micro_batches)
    if spec.reference == "precomputed":  # the data set's log-probs (one step's where their count is not known)
        pairs = spec.reference_pairs if spec.reference_pairs is not None else rows // spec.counts.rows_per_example
        return (2 * FP32 * pairs if has_head else 0), _pass_transient(costs, has_head, micro_batches, relay)
    if has_head:  # the log-probs the loss reads, and (GPipe) each micro-batch's in torch's fwd_cache beside them
        kept = FP32 * rows * (1 if relay else 2)
    else:
        kept = 0 if relay else micro_batches * costs.boundary_bytes
    if not has_embed and not relay:  # its own schedule's receive buffers, one a micro-batch (planning/buffers.py)
        kept += micro_batches * costs.boundary_bytes
    return kept, _pass_transient(costs, has_head, micro_batches, relay)


def _pass_transient(costs, has_head: bool, micro_batches: int, relay: bool) -> int:
    """The reference pass's peak beyond what it keeps: on the last stage one micro-batch's logits (the relay: the
    step's), their fp32 copy (16-bit compute) and their fp32 log-softmax, beside the head's input (the last block's
    hidden state, alive until the stage's forward returns); elsewhere a block's forward (the relay: of the step's
    rows, its input and output beside it)."""
    if has_head:
        count = micro_batches if relay else 1
        logits = count * costs.logits_bytes
        fp32 = logits * FP32 // _itemsize(costs)
        return logits + fp32 * (2 if _itemsize(costs) < FP32 else 1) + count * costs.boundary_bytes
    block = costs.block.workspace_bytes
    return micro_batches * (block + 2 * costs.boundary_bytes) if relay else block


def _itemsize(costs) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(costs.spec.dtype, 4)


def forward_fraction(costs) -> float:
    """One no-grad forward's time against a training pass's of the same stage (its `time_s` before the reference):
    1 / (forward + backward + the recompute under activation checkpointing), the backward 2 forwards under full
    fine-tuning (input and weight gradients) but about 1 with a frozen base (input gradients; the adapters' are
    small). Measured on the CPU, one thread, LoRA r=8 on a 2-layer Llama: a no-grad forward with the adapters off
    took 0.48 of a training forward + backward at hidden 512 × seq 256 × 2 rows, 0.67 at the tiny recipe's hidden
    128 × seq 64 (per-op overheads); not measured on a GPU."""
    backward = 2 if costs.spec.method == "full" else 1
    return 1.0 / (1 + backward + (costs.spec.checkpointing != "off"))


def per_step(spec) -> bool:
    """Whether the reference runs within every step (adapters-off)."""
    return spec.reference_pass and spec.reference != "precomputed"
