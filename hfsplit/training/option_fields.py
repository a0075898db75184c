"""How a fine-tuning option is declared: a dataclass field carrying its `--help` group and text. `FinetuneOptions`
(`hfsplit.training.options`) declares the run's options so, and each objective its own (`hfsplit.objectives`),
mixed into it."""
from __future__ import annotations

from dataclasses import field

GROUPS = ("model", "data", "method", "objective", "parallelism", "optimisation", "checkpoints", "faults")


def option(default, group: str, help: str, **metadata):
    """A FinetuneOptions field: its default, the `--help` group it is listed under and its help text (and, as
    metadata, `choices` where they are not a Literal type's)."""
    assert group in GROUPS, group
    return field(default=default, metadata={"group": group, "help": help, **metadata})
