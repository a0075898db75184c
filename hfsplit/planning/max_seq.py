"""The longest sequence a job fits at: a binary search on the planner itself.

Every cost the planner counts grows with the sequence (kept activations, workspaces, the pipeline's buffers, the
offload's host bytes) but one: a tiled MLP's slice, which shrinks each time the sequence takes one more slice
(`memory_choices.mlp_tiles`), so "fits" is a saw: monotone between the lengths where the slice count steps, and a
length just past a step can fit where the one before it did not. A binary search finds the end of a tooth; the
length just past the next step is probed, and where it fits the search goes on from there (the planner traces each
length it tries: one trace a probe).
Each probe asks `make_plan` with the optimizer and loss the caller left to it ("auto") at their most frugal
(checkpointing stays auto: offload may lack host RAM where checkpointing on the device fits), and no diagnosis;
the answer is then planned as the caller asked, so its plan is the fastest at that length.
The no-fit diagnosis offers its shorter sequence by the same search (`longest_length`, the same probes, through
make_plan's own search), so the two agree.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

from hfsplit.checkpoint.resolve import load_config
from hfsplit.errors import PlanError
from hfsplit.plan import Plan, TrainingSpec
from hfsplit.planning.memory_choices import MIN_SLICE, mlp_tiles

MULTIPLE = 256  # lengths are searched in steps of this many tokens (sequence lengths are usually such multiples)


def longest_fitting(fits: Callable[[int], bool], *, low: int, high: int, multiple: int = 1) -> Optional[int]:
    """The largest multiple of `multiple` in `[low, high]` at which `fits` holds, for a `fits` that holds up to
    some length and never beyond it; None when it does not hold at `low`. `fits` is called O(log((high-low)/multiple))
    times."""
    low, high = -(-low // multiple), high // multiple  # in units of `multiple`
    if high < low or not fits(low * multiple):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid * multiple):
            low = mid
        else:
            high = mid - 1
    return low * multiple


def max_seq_len(make_plan: Callable[..., Plan], model, max_memory, *, spec: TrainingSpec, limit: Optional[int] = None,
                multiple: int = MULTIPLE, **options) -> Optional[Plan]:
    """The plan of the longest sequence (a multiple of `multiple`, up to `limit`: default the model's
    `max_position_embeddings`) at which `model` fits `max_memory` with `spec` and `options` (`make_plan`'s), or None
    when not even `multiple` tokens fit.

    Args:
        make_plan: `hfsplit.planning.planner.make_plan` (passed in: the planner sits above this search).
        model: what `make_plan` takes (a hub name, folder or config).
        max_memory: the budget.
        spec: what a step does; its `seq_len` is replaced.
        limit: the longest length to consider.
        multiple: lengths are multiples of this.
        **options: further `make_plan` options, kept as given in the answer's plan.
    """
    probe = {**options, **probe_knobs(options), "explain": False}

    def fits(seq: int) -> bool:
        try:
            make_plan(model, max_memory, spec=replace(spec, seq_len=seq), **probe)
        except PlanError:
            return False
        return True

    config = _config(model)
    found = longest_length(fits, config, spec, top=limit or top_length(config), multiple=multiple)
    return None if found is None else make_plan(model, max_memory, spec=replace(spec, seq_len=found), **options)


def longest_length(fits: Callable[[int], bool], config, spec: TrainingSpec, *, top: int,
                   multiple: int = MULTIPLE) -> Optional[int]:
    """The longest multiple of `multiple` up to `top` at which `fits` holds for `config` and `spec`: the end of a
    tooth by binary search, then past each tiled-MLP step that fits (the saw above); None where `multiple` does not
    fit. `--max-seq-len` and the no-fit diagnosis's shorter sequence both ask this, so they agree."""
    fits = lru_cache(maxsize=None)(fits)
    found = longest_fitting(fits, low=multiple, high=top, multiple=multiple)
    while found is not None and (step := past_next_tile_step(config, spec, found, multiple, top)) and fits(step):
        found = longest_fitting(fits, low=step, high=top, multiple=multiple)
    return found


def top_length(config) -> int:
    """The longest sequence searched: the model's `max_position_embeddings`."""
    return getattr(config, "max_position_embeddings", None) or 1 << 20


def past_next_tile_step(config, spec: TrainingSpec, seq: int, multiple: int, high: int) -> Optional[int]:
    """The first multiple of `multiple` after `seq` (up to `high`) at which a tiled MLP of `config` runs one more
    slice than at `seq`; None where the count does not step within a slice's length (capped, or nothing tiled)."""
    tiles = mlp_tiles(config, replace(spec, seq_len=seq))
    stop = min(high, seq + MIN_SLICE + multiple)
    return next((n for n in range(seq + multiple, stop + 1, multiple)
                 if mlp_tiles(config, replace(spec, seq_len=n)) > tiles), None)


def probe_knobs(options: dict) -> dict:
    """The knobs the caller left to the planner, at the setting that holds least: a probe asks whether anything fits."""
    out = {}  # checkpointing stays auto: offload may be short of host RAM where checkpointing on the device fits
    if options.get("optim", "auto") == "auto":
        out["optim"] = "adamw_8bit"
    if options.get("chunked_loss", "auto") == "auto":
        out["chunked_loss"] = True
    return out


def _config(model):
    return load_config(model) if isinstance(model, (str, Path)) else model
