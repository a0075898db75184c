"""What a training objective is, as the loop sees it (issue 31): the interface every objective implements, and its
defaults, which are the plain causal-LM loop (the token mean of the global batch, as transformers' Trainer has it).

An objective (SFT, DPO, GRPO: `hfsplit.objectives`) owns its rows, the targets of each step, its loss, metrics,
evaluation and option defaults, and declares as data what the planner must count (`hfsplit.plan.ObjectiveCounts`:
rows per example, a reference or generation pass). The loop (`hfsplit.training.trainer`), the data and the
checkpointer call the objective they are given and never name one; `hfsplit.training.run` looks it up by the
`--objective` name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from hfsplit.plan import OBJECTIVE_COUNTS, ObjectiveCounts
from hfsplit.training.data import TokenRows
from hfsplit.training.batches import MicroBatches
from hfsplit.training.evaluation import eval_loss
from hfsplit.training.option_fields import OptionRules
from hfsplit.training.packing import label_tokens


@dataclass
class StepRows:
    """What one optimizer step trains on, on this replica: its rows through the pipeline, the targets the last
    stage's loss reads, the divisor that makes each micro-batch's loss a share of the global batch's
    (`num_items_in_batch`), extra keywords of `SplitModel.step`, and the step's token counts (global batch)."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    divisor: object
    forward: dict = field(default_factory=dict)
    tokens: int = 0  # real tokens of the global batch
    trained_tokens: int = 0  # its label tokens
    positions: int = 0  # its positions (rows × seq_len)


class Objective(OptionRules):
    """A training objective. The base is the causal-LM objective's loop: subclasses override what differs. What it
    decides from the options alone (its dataset, defaults, checks, packing, spec fields) it inherits from its
    `OptionRules`, which the options read without loading torch.

    Class attributes:
        name: the `--objective` name it is registered under (`hfsplit.objectives.OBJECTIVES`).
        metric_names: the names of its per-step metrics (in the bar, `metrics.jsonl` and TensorBoard).
    """

    name: str = "sft"
    metric_names: tuple[str, ...] = ()

    @property
    def counts(self) -> ObjectiveCounts:
        """What the planner counts for it (`hfsplit.plan.OBJECTIVE_COUNTS`, by name)."""
        return OBJECTIVE_COUNTS[self.name]

    # -- options (beside `OptionRules`') ---------------------------------------------------------------------------
    def check_model(self, options, config) -> None:
        """One line, before any weight is read, where the model cannot run it as asked."""

    # -- data ------------------------------------------------------------------------------------------------------
    def load_rows(self, options, tokenizer, *, source: str, packing: bool) -> TokenRows:
        raise NotImplementedError

    def batches(self, options, rows: TokenRows, *, micro_batches: int) -> MicroBatches:
        """Each step's rows: `micro_batches` (all replicas') of --micro-batch-size rows, an example's rows together."""
        group = 1 if self.packs(options) else self.counts.rows_per_example
        return MicroBatches(rows, micro_batch_size=options.micro_batch_size, num_micro_batches=micro_batches,
                            seed=options.seed, group=group)

    def cached_examples(self, options, rows: TokenRows) -> Optional[int]:
        """The examples whose reference log-probs a precomputed reference keeps (for the plan), else None."""
        return None

    # -- the run ---------------------------------------------------------------------------------------------------
    def loss(self, options, model):
        """The last stage's loss function."""
        raise NotImplementedError

    def prepare(self, run, *, progress: bool) -> None:
        """Work before the first step (a precomputed reference)."""

    def step_rows(self, run, batch: dict) -> StepRows:
        """This replica's rows of the global `batch` and their targets; the loss divides by the global batch's label
        tokens. Runs under the step's compute precision."""
        mine = replica_rows(run)
        items = label_tokens(batch["labels"])
        return StepRows(batch["input_ids"][mine], batch["labels"][mine], batch["position_ids"][mine], divisor=items,
                        tokens=int(batch["lengths"].sum()), trained_tokens=items,
                        positions=batch["input_ids"].numel())

    def step_metrics(self, run) -> dict[str, float]:
        """Its figures of the step just run, the same on every rank (collective)."""
        return {}

    def bar(self, metrics: dict) -> dict[str, str]:
        """The progress bar's fields of its `step_metrics`."""
        return {}

    def evaluate(self, run) -> tuple[float, dict[str, float]]:
        """(eval loss, further figures) on the held-out rows, on every rank."""
        return eval_loss(run.model, run.held_out, run.loss_fn, micro_batch_size=run.options.micro_batch_size), {}


def replica_rows(run) -> slice:
    """The rows of a step's global batch that this rank's data-parallel replica trains on."""
    dp = run.model.ctx.coords.dp
    return slice(dp * run.rows_per_replica, (dp + 1) * run.rows_per_replica)

