"""How a fine-tuning option is declared: a dataclass field carrying its `--help` group and text. `FinetuneOptions`
(`hfsplit.training.options`) declares the run's options so, and each objective its own (`hfsplit.objectives`),
mixed into it. Beside them, `OptionRules`: what an objective decides from the options alone, so that building and
checking a run's options loads no torch (`--help`, a refused flag)."""
from __future__ import annotations

from dataclasses import field
from typing import Optional

GROUPS = ("model", "data", "method", "objective", "parallelism", "optimisation", "checkpoints", "faults")


def option(default, group: str, help: str, **metadata):
    """A FinetuneOptions field: its default, the `--help` group it is listed under and its help text (and, as
    metadata, `choices` where they are not a Literal type's)."""
    assert group in GROUPS, group
    return field(default=default, metadata={"group": group, "help": help, **metadata})


class OptionRules:
    """What an objective decides from the options alone: its bundled dataset, the defaults it sets, the combinations
    it refuses, whether its rows pack, what it adds to the plan's spec. The base is the causal-LM objective's (SFT);
    each objective's rules live in `hfsplit.objectives.options` and its `Objective` (torch) inherits them.

    Attributes:
        default_dataset: the bundled file its runs read when no --dataset is given.
    """

    default_dataset: str = "tiny_alpaca.jsonl"

    def defaults(self, options) -> dict:
        """Option values it sets where the user left them unset (None)."""
        return {"micro_batch_size": 1}

    def check_options(self, options) -> None:
        """One `HfsplitError` line where its options contradict each other or the method."""

    def packs(self, options) -> Optional[bool]:
        """Whether its rows are packed under these options; None: the data's format decides."""
        return None

    def spec_fields(self, options) -> dict:
        """`TrainingSpec` fields it sets beside `objective` (its reference, its rollout)."""
        return {}
