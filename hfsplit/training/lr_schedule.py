"""The run's learning-rate schedule: linear warmup, then a half cosine to 0.

The same `LambdaLR` (formula, and state dict: a `functools.partial` saves as `{}`) that
`transformers.get_cosine_schedule_with_warmup` builds, without importing `transformers.optimization`:
that module imports `transformers.trainer_utils`, which imports peft, which imports bitsandbytes, which
imports torch's inductor for its `torch.compile` decorators: 7-8 s of every (re)started worker on a
loaded 2-core machine, for a 3-line formula. `tests/training/test_elastic.py` checks it step by step
against transformers'.
"""
from __future__ import annotations

import math
from functools import partial

from torch.optim.lr_scheduler import LambdaLR


def cosine_factor(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    """The LR multiplier at `step`: step/warmup during warmup, then 0.5·(1 + cos(π·progress))."""
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def cosine_schedule_with_warmup(optimizer, num_warmup_steps: int, num_training_steps: int) -> LambdaLR:
    """`transformers.get_cosine_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps)`."""
    return LambdaLR(optimizer, partial(cosine_factor, num_warmup_steps=num_warmup_steps,
                                       num_training_steps=num_training_steps))
