"""The held-out evaluation of the causal-LM loss: its token mean, forward only through the pipeline."""
from __future__ import annotations

import torch

from hfsplit.training.packing import label_tokens
from hfsplit.training.precision import compute_precision


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
