"""What a run reports: the progress bar, `metrics.jsonl`, TensorBoard and the measured bubble.

The trainer hands each event to one `Metrics` object; only rank 0 writes files and only
the rank that holds the loss shows the bar, but every rank calls every method (some
figures, such as peak memory and busy time, are gathered from all ranks).
"""
from __future__ import annotations

import json
import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class TrainResult:
    """What a run reports at the end (on every rank)."""

    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0  # real (non-padding) tokens, over the timed steps
    trained_tokens_per_s: float = 0.0  # label tokens (those the loss counts)
    padding: float = 0.0  # the fraction of the steps' positions that were padding
    padded_padding: Optional[float] = None  # what it would have been with one example a row (packed runs)
    bubble_measured: float = 0.0
    bubble_theory: float = 0.0
    skipped_steps: list[int] = field(default_factory=list)
    peak_memory_bytes: list[int] = field(default_factory=list)
    saved_to: str = ""
    eval_losses: list[float] = field(default_factory=list)
    busy_s_per_rank: list[float] = field(default_factory=list)  # seconds in stage work, per global rank
    timeline_json: str = ""  # rank 0: the recorded step as the ranks ran it (`hfsplit.training.timeline`)


@dataclass
class StepOutcome:
    """One optimizer step as `train_step` saw it."""

    loss: float
    grad_norm: float
    seconds: float
    busy_s: float  # of `seconds`, the time this rank spent computing inside its pipeline stages
    tokens: int = 0  # real (non-padding) tokens of the global batch
    trained_tokens: int = 0  # its label tokens
    positions: int = 0  # its positions (rows × seq_len)
    offload_bytes: int = 0  # peak host bytes this rank's activation offload held during the step
    extra: dict = field(default_factory=dict)  # the objective's metrics (DPO: TRL's rewards/*, logps/*)
    bar: dict = field(default_factory=dict)  # the objective's fields of the progress bar (`Objective.bar`)

    @property
    def finite(self) -> bool:
        import math

        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: the accelerator's allocator peak, else the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Metrics:
    """A run's figures as they come: bar, JSONL + TensorBoard (rank 0), and the `TrainResult`.

    Args:
        output_dir: where `metrics.jsonl` and `tensorboard/` go.
        total_steps, first_step: the bar's length and starting point (a resumed run starts later).
        bubble_theory: the plan's bubble fraction, reported beside the measured one.
        padded_padding: the padding fraction the run's examples would have one a row (a packed run), for the
            final line's account of what packing removed; None when the rows are not packed.
        holds_loss: this rank holds the loss: it writes notes (eval loss, skipped steps) under the bar.
        progress: it also shows the progress bar.
        append: append to an existing `metrics.jsonl` (a resumed run).
        offloads: the plan offloads activations: each step logs `activation_offload_bytes`, per rank the peak
            host bytes its offloaded block inputs held (beside `peak_memory_bytes`, the device's).
    """

    def __init__(self, output_dir: str, *, total_steps: int, bubble_theory: float, holds_loss: bool,
                 padded_padding: Optional[float] = None, progress: bool = True, append: bool = False,
                 offloads: bool = False) -> None:
        self.log = MetricsLog(output_dir, enabled=dist.get_rank() == 0, append=append)
        self.total_steps = total_steps
        self.holds_loss = holds_loss
        self.show_bar = progress and holds_loss
        self.result = TrainResult(bubble_theory=bubble_theory, padded_padding=padded_padding)
        self.bar = None
        self.first_step = 1
        self._busy_total = self._wall_total = 0.0
        self._steps: list[tuple[int, int, int]] = []  # each step's (real tokens, label tokens, positions)
        self.offloads = offloads

    def begin(self, first_step: int) -> None:
        """Show the bar from `first_step` (after a resume, the step after the checkpoint's)."""
        from tqdm.auto import tqdm

        self.first_step = first_step
        self.bar = tqdm(total=self.total_steps, initial=first_step - 1, disable=not self.show_bar,
                        desc="fine-tune", dynamic_ncols=True)

    def resumed(self, step: int, *, folder: Path, seconds: float) -> None:
        self.log.write({"step": step, "resumed_from": str(folder), "resume_s": seconds})
        if dist.get_rank() == 0:
            print(f"resumed from {folder} at step {step}", flush=True)

    def nonfinite(self, step: int, outcome: StepOutcome) -> None:
        self.log.write({"step": step, "skipped": True, "loss": outcome.loss, "grad_norm": outcome.grad_norm})

    def skipped(self, step: int, outcome: StepOutcome) -> None:
        self.result.skipped_steps.append(step)
        self.note(f"step {step}: non-finite loss {outcome.loss} / gradient norm {outcome.grad_norm}; step skipped")

    def stepped(self, step: int, outcome: StepOutcome, *, lr: float, device: torch.device) -> None:
        """Record a completed step (collective: peak memory is gathered from every rank)."""
        if step > self.first_step:  # the first step builds the schedule and warms up
            self._busy_total += outcome.busy_s
            self._wall_total += outcome.seconds
        self.result.losses.append(outcome.loss)
        self.result.step_times_s.append(outcome.seconds)
        self._steps.append((outcome.tokens, outcome.trained_tokens, outcome.positions))
        rate, trained = outcome.tokens / outcome.seconds, outcome.trained_tokens / outcome.seconds
        padding = 1 - outcome.tokens / outcome.positions if outcome.positions else 0.0
        peaks = gather(int(peak_memory_bytes(device)))
        offloaded = {"activation_offload_bytes": gather(int(outcome.offload_bytes))} if self.offloads else {}
        self.log.write({"step": step, "loss": outcome.loss, "lr": lr, "grad_norm": outcome.grad_norm,
                        "tokens_per_s": rate, "trained_tokens_per_s": trained, "padding": padding,
                        "step_s": outcome.seconds, "peak_memory_bytes": peaks, **offloaded, **outcome.extra})
        self.bar.set_postfix(loss=f"{outcome.loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{rate:.0f}", trained_s=f"{trained:.0f}",
                             pad=f"{100 * padding:.0f}%", peak_mib="/".join(str(p >> 20) for p in peaks),
                             **outcome.bar)
        self.bar.update(1)
        self.result.peak_memory_bytes = peaks

    def evaluated(self, step: int, loss: float, extra: Optional[dict] = None) -> None:
        """An evaluation's loss, and its objective's figures (TRL's names, prefixed eval_ as TRL logs them)."""
        self.note(f"step {step}: eval loss {loss:.4f}")
        self.log.write({"step": step, "eval_loss": loss, **{f"eval_{k}": v for k, v in (extra or {}).items()}})
        self.result.eval_losses.append(loss)

    def saved(self, step: int, *, folder: Path, seconds: float, removed: list[Path]) -> None:
        self.log.write({"step": step, "checkpoint": str(folder), "save_s": seconds,
                        "removed": [str(p) for p in removed]})

    def note(self, text: str) -> None:
        """A line under the bar (or alone, without one), on the rank that holds the loss."""
        if self.holds_loss:
            self.bar.write(text)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def finish(self) -> TrainResult:
        """The run's result, with the measured bubble and tokens/s (collective); closes the log."""
        result = self.result
        busy = gather(float(self._busy_total))
        result.busy_s_per_rank = busy
        result.bubble_measured = 1 - (sum(busy) / len(busy)) / self._wall_total if self._wall_total else 0.0
        first = 1 if len(result.step_times_s) > 1 else 0  # the first step builds the schedule and warms up
        seconds = sum(result.step_times_s[first:])
        tokens, trained, _ = (sum(column) for column in zip(*self._steps[first:])) if self._steps else (0, 0, 0)
        result.tokens_per_s = tokens / seconds if seconds else 0.0
        result.trained_tokens_per_s = trained / seconds if seconds else 0.0
        positions = sum(p for _, _, p in self._steps)
        result.padding = 1 - sum(t for t, _, _ in self._steps) / positions if positions else 0.0
        self.log.close()
        return result


def summary_line(result: TrainResult) -> str:
    final = result.losses[-1] if result.losses else float("nan")
    return (f"done: {len(result.losses)} steps, final loss {final:.4f}, {result.tokens_per_s:.0f} tokens/s "
            f"({result.trained_tokens_per_s:.0f} trained), {padding_text(result)}, "
            f"bubble measured {100 * result.bubble_measured:.1f}% (theory {100 * result.bubble_theory:.1f}%), "
            f"skipped steps {result.skipped_steps or 'none'}")


def padding_text(result: TrainResult) -> str:
    """The run's padding, and for packed rows how much of the padding of one example a row packing removed."""
    text = f"padding {100 * result.padding:.1f}%"
    if result.padded_padding is None or result.padded_padding <= 0:
        return text
    # the same examples one a row: positions P = real / (1 - padded); packed: real / (1 - padding)
    removed = 1 - (result.padding / (1 - result.padding)) / (result.padded_padding / (1 - result.padded_padding))
    return f"{text} (one example a row: {100 * result.padded_padding:.1f}%; packing removed {100 * removed:.0f}% of it)"


def gather(value):
    """`value` of every rank, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class MetricsLog:
    """Metrics to `metrics.jsonl` and accelerate's TensorBoard tracker, from rank 0."""

    def __init__(self, output_dir: str, *, enabled: bool, append: bool = False) -> None:
        self.enabled = enabled
        self.file = None
        self.writer = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.file = open(out / "metrics.jsonl", "a" if append else "w")
        try:
            from accelerate.tracking import TensorBoardTracker

            self.writer = TensorBoardTracker("hfsplit", str(out / "tensorboard"))
            self.writer.start()
        except Exception:  # tensorboard missing: the JSONL file still has everything
            self.writer = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            self.writer.log(scalars, step=record["step"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.writer is not None:
            self.writer.finish()
