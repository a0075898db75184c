"""Rank-side check that a chunked-loss plan stays true (started by tests/parallel/launcher.py)."""
from __future__ import annotations

import torch

from tests.parallel.apply_cases import _train


def chunked_vs_plain(*, checkpoint: str, seq_len: int, micro_batch_size: int, micro_batches: int, steps: int) -> dict:
    """For the plain and the chunked loss: this rank's planned figure, its measured step peak and the losses."""
    from hfsplit.plan import TrainingSpec
    from hfsplit.load.launch import split_from_pretrained
    from hfsplit.plan import rank_total

    out = {}
    for chunked in (False, True):
        spec = TrainingSpec(method="lora", seq_len=seq_len, micro_batch_size=micro_batch_size, dtype="float32",
                            lora_r=8, activation_checkpointing=True, chunked_loss=chunked)
        torch.manual_seed(0)
        model = split_from_pretrained(checkpoint, "2x4GiB", spec=spec, micro_batches=micro_batches, tp=1, pp=2, dp=1,
                                      world_size=2, activation_checkpointing=True, schedule="1F1B")
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        ids = torch.randint(3, model.config.vocab_size, (micro_batch_size * micro_batches, seq_len),
                            generator=torch.Generator().manual_seed(0))
        losses, peak, _, _ = _train(model, optimizer, ids, steps=steps)
        probe = model.forward(ids[:1, :16], broadcast=True)  # outside a step the last stage gives logits
        out[chunked] = {"planned": rank_total([model.plan.stages[i].memory for i in model.stage_indices]),
                        "measured": peak, "losses": losses, "probe_shape": tuple(probe.shape),
                        "has_head": model.has_last, "table": model.plan.table()}
        del model, optimizer
    return out
