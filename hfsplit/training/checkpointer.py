"""The run's checkpoints: resume at the start, `--save-every` with pruning during, final save and merge at the end."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hfsplit.training.resume import prune_checkpoints, read_trainer_state, write_trainer_state
from hfsplit.parallel.save import save_split_model


@dataclass
class TrainState:
    """What a resumable checkpoint holds beyond the weights: the optimizer and the data position."""

    params: list
    optimizer: object
    scheduler: object
    batches: object


@dataclass
class Checkpointer:
    """Owns every write and read of the run's checkpoints (all methods are collective).

    Args:
        model: the SplitModel being trained.
        state: its optimizer, scheduler and data position.
        output_dir: where `checkpoint-N/`, `adapter/` or `model/`, and `merged/` go.
        method: full | lora (what the final folder holds).
        base_model: the model trained from (recorded in adapter configs).
        lora_config, tokenizer: saved with each checkpoint.
        save_every: save `checkpoint-N` every N steps (None: only the final save).
        keep: keep only the newest K checkpoints (0: all).
        merge: also write `merged/` with the adapters folded in.
        max_shard_size: the largest safetensors shard of `model/` and `merged/` ("5GB").
        metrics: told of each save (a `Metrics`).
    """

    model: object
    state: TrainState
    output_dir: str
    method: str
    base_model: Optional[str] = None
    lora_config: object = None
    tokenizer: object = None
    save_every: Optional[int] = None
    keep: int = 0
    merge: bool = False
    metrics: object = None
    max_shard_size: str = "5GB"

    def resume(self, folder: Optional[Path]) -> int:
        """Restore from checkpoint `folder` (None: a fresh start); the step to run next."""
        if folder is None:
            return 1
        reading = time.perf_counter()
        s = self.state
        step = read_trainer_state(folder, model=self.model, params=s.params, optimizer=s.optimizer,
                                  scheduler=s.scheduler, batches=s.batches)
        self.metrics.resumed(step, folder=folder, seconds=time.perf_counter() - reading)
        return step + 1

    def after_step(self, step: int, *, total_steps: int, force: bool = False) -> Optional[Path]:
        """Save `checkpoint-{step}` when the cadence says so, or `force` (an elastic stop) asks; the folder
        written, if any (the last step gets the final save instead)."""
        if not ((force or self.save_every and step % self.save_every == 0) and step < total_steps):
            return None
        s = self.state
        extra = functools.partial(write_trainer_state, model=self.model, params=s.params, optimizer=s.optimizer,
                                  scheduler=s.scheduler, batches=s.batches, step=step)
        saving = time.perf_counter()
        folder = self._save(Path(self.output_dir) / f"checkpoint-{step}", method=self.method, extra=extra)
        seconds = time.perf_counter() - saving
        self.metrics.saved(step, folder=folder, seconds=seconds, removed=prune_checkpoints(self.output_dir, keep=self.keep))
        return folder

    def final(self) -> Path:
        """The trained weights (`adapter/` or `model/`), and `merged/` when asked; the first folder."""
        folder = self._save(Path(self.output_dir) / ("adapter" if self.method == "lora" else "model"),
                            method=self.method)
        if self.merge:
            self._save(Path(self.output_dir) / "merged", method="full", merge_lora=True)
        return folder

    def _save(self, folder: Path, *, method: str, **kwargs) -> Path:
        lora = self.lora_config if method == "lora" else None
        return save_split_model(self.model, folder, method=method, lora_config=lora, tokenizer=self.tokenizer,
                                base_model=self.base_model, max_shard_size=self.max_shard_size, **kwargs)
