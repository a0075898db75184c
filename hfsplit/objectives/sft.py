"""Supervised fine-tuning: the causal-LM loss on the responses, the token mean of the global batch (transformers'
Trainer with `num_items_in_batch`). The loop's defaults (`hfsplit.training.objective.Objective`) are this objective;
it adds its rows (text, instruction or chat, packed by default where the format packs) and its loss."""
from __future__ import annotations

from hfsplit.models.loss import causal_lm_loss
from hfsplit.training.data import TokenRows, load_token_rows
from hfsplit.training.objective import Objective


class Sft(Objective):
    """`--objective sft`."""

    name = "sft"

    def load_rows(self, options, tokenizer, *, source: str, packing: bool) -> TokenRows:
        return load_token_rows(source, tokenizer, seq_len=options.seq_len, format=options.dataset_format,
                               packing=packing, seed=options.seed)

    def loss(self, options, model):
        return causal_lm_loss(model.config.vocab_size)
