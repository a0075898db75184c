"""The order and cut of a run's rows: each step's micro-batches, one seeded permutation an epoch, resumable (the same
on every rank)."""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from hfsplit.training.data import DatasetError
from hfsplit.training.packing import TokenRows


def epoch_order(num_rows: int, *, seed: int, epoch: int) -> np.ndarray:
    """The row order of one epoch: a permutation that depends only on (seed, epoch), same on every rank."""
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


class MicroBatches:
    """Endless, resumable batches: per optimizer step, `num_micro_batches * micro_batch_size` rows.

    Every rank built with the same seed draws the same batches. Each epoch visits the rows in a fresh
    order and drops the last rows that do not fill a step. `state_dict()` holds (seed, epoch, step), so
    a resumed run continues with the very next batch.

    Args:
        rows: the training rows.
        micro_batch_size: rows per micro-batch.
        num_micro_batches: micro-batches per optimizer step.
        seed: the shuffling seed.
        epoch: the epoch to start in.
        group: rows that travel together (DPO: 2, a chosen and a rejected row), shuffled as one unit.
    """

    def __init__(self, rows: TokenRows, *, micro_batch_size: int, num_micro_batches: int, seed: int, epoch: int = 0,
                 group: int = 1):
        self.rows, self.group = rows, group
        self.batch_size = micro_batch_size * num_micro_batches
        if micro_batch_size < 1 or num_micro_batches < 1:
            raise DatasetError(
                f"micro_batch_size and num_micro_batches must be ≥ 1, got {micro_batch_size}, {num_micro_batches}"
            )
        self.steps_per_epoch = len(rows) // self.batch_size
        if self.steps_per_epoch == 0:
            raise DatasetError(
                f"the dataset has {len(rows)} rows, fewer than one step of {num_micro_batches} micro-batches × "
                f"{micro_batch_size} rows = {self.batch_size}; lower micro_batch_size or num_micro_batches"
            )
        self.seed, self.epoch, self.step = seed, epoch, 0
        self._order = self._epoch_rows(epoch)

    def _epoch_rows(self, epoch: int) -> np.ndarray:
        """This epoch's row order: the groups in `epoch_order`, each group's rows in place."""
        units = epoch_order(len(self.rows) // self.group, seed=self.seed, epoch=epoch)
        return (units[:, None] * self.group + np.arange(self.group)).reshape(-1)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Batches of `input_ids`, `labels`, `position_ids` (restarting at each packed example), `lengths`
        (each row's real tokens), `index` (each row's index in `rows`) and, where the rows keep them,
        `sequences` (each position's example: DPO's packed pairs, what a precomputed reference is keyed by;
        padded pairs are keyed by `index`)."""
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.step == self.steps_per_epoch:
            self._start_epoch(self.epoch + 1)
        index = torch.from_numpy(self._order[self.step * self.batch_size : (self.step + 1) * self.batch_size])
        self.step += 1
        rows = self.rows.select(index)
        batch = {"input_ids": rows.input_ids, "labels": rows.labels, "position_ids": rows.positions(),
                 "lengths": rows.real_tokens(), "index": index}
        return batch if rows.sequences is None else {**batch, "sequences": rows.sequences}

    def rows_of_steps(self, steps: int) -> np.ndarray:
        """The row indices a run's first `steps` batches draw, `(steps, rows per step)`, from the first epoch's
        start whatever this sampler's position (the same on every rank, and for a resumed run)."""
        epochs = -(-steps // self.steps_per_epoch)
        drawn = [self._epoch_rows(e)[:self.steps_per_epoch * self.batch_size] for e in range(epochs)]
        return np.concatenate(drawn).reshape(-1, self.batch_size)[:steps]

    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.step = epoch, 0
        self._order = self._epoch_rows(epoch)

    def state_dict(self) -> dict[str, int]:
        """Where the batches stand: seed, epoch, and steps already taken in that epoch."""
        return {"seed": self.seed, "epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a `state_dict()`: the next batch is the one that followed it."""
        if not 0 <= state["step"] <= self.steps_per_epoch:
            raise DatasetError(
                f"saved data position step={state['step']} is outside an epoch of {self.steps_per_epoch} steps; "
                "was the dataset, seq_len or batch size changed since the checkpoint?"
            )
        self.seed = state["seed"]
        self._start_epoch(state["epoch"])
        self.step = state["step"]


def micro_batches(
    rows: TokenRows, *, micro_batch_size: int, num_micro_batches: int, seed: int, epoch: int
) -> Iterator[dict[str, torch.Tensor]]:
    """The batches of one epoch, one per optimizer step; see `MicroBatches`.

    Args:
        rows: the training rows.
        micro_batch_size: rows per micro-batch.
        num_micro_batches: micro-batches per optimizer step.
        seed: the shuffling seed.
        epoch: which epoch's order to use.
    """
    batches = MicroBatches(
        rows, micro_batch_size=micro_batch_size, num_micro_batches=num_micro_batches, seed=seed, epoch=epoch
    )
    for _ in range(batches.steps_per_epoch):
        yield next(batches)
