"""The one place a rank opens the checkpoint: only the tensors its stages hold."""
from __future__ import annotations

from typing import Iterable

from torch import nn


def open_reader(name_or_path: str, *, needed: Iterable[str], model: nn.Module):
    """A CheckpointReader validated for the parameter names `needed` of `model` (a meta-device model).

    Passing the model lets the reader apply transformers' load-time renames and map a tied
    `lm_head.weight` to the embedding matrix it shares.
    """
    from hfsplit.checkpoint import CheckpointReader

    return CheckpointReader.open(name_or_path, needed=list(needed), model=model)
