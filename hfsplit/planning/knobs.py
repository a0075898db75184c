"""The knobs the planner turns beyond each rank's memory choices: the chunked loss and the micro-batches.

Each rank's checkpointing, offload, optimizer moments and tiled MLP are chosen rank by rank inside the split search
(`hfsplit.planning.memory_choices`). Two more decisions belong to the whole plan, and `make_plan` turns them here:

- **the chunked loss** (`TrainingSpec.chunked_loss`, `hfsplit.models.loss`): the last stage never holds a whole
  micro-batch's logits (Llama-3.1-8B at seq 131072: 128256 × 131072 fp32 values, 62 GiB) for one more lm_head
  forward a micro-batch. Under "auto" it is tried when the plan without it does not fit, or fits only by making
  some rank pay for memory (recompute, offload, 8-bit moments, tiles); the faster plan is kept.
- **the micro-batches**, when the caller fixed neither their count nor a global batch: fewer micro-batches mean
  fewer of the pipeline's receive buffers and kept outputs (one hidden state each), a longer bubble; a smaller
  micro-batch (one row) holds a row's activations instead of several. Tried when the default count fits nothing,
  or fits only by paying for memory, the most micro-batches first.

Of every plan that fits, the one with the most tokens a second is kept, as `search.best_plan` keeps among splits.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Union

from hfsplit.budget import format_bytes
from hfsplit.errors import PlanError
from hfsplit.plan import Plan, TrainingSpec, rank_total
from hfsplit.planning.memory_choices import Choice

AUTO = "auto"
FEWER_MICRO_BATCHES = (4, 2, 1)  # counts tried, most first, when the default (4 × pipeline depth) fits nothing

# search(spec, micro_batches) → the fastest fitting plan of `spec` with that micro-batch count (None: the default)
Search = Callable[[TrainingSpec, Optional[int]], Optional[Plan]]


def chunked_loss_setting(value: Union[bool, str, None]) -> str:
    """"auto", "on" or "off" for a `chunked_loss` setting (True / False / "on" / "off" / "auto")."""
    mode = {True: "on", False: "off", None: AUTO}.get(value, str(value).lower())
    if mode not in (AUTO, "on", "off"):
        raise PlanError(f"chunked loss {value!r}: use auto, on or off")
    return mode


def turn_knobs(search: Search, spec: TrainingSpec, *, first: Optional[Plan], fastest: Choice,
               chunked_loss: Union[bool, str] = AUTO, counts_free: bool = False) -> Optional[Plan]:
    """The fastest fitting plan over the plan-wide knobs, `first` (the spec as given) among them; None if none fits.

    Args:
        search: plans a spec at a micro-batch count (None: the caller's).
        spec: what a step does; its `chunked_loss` is the starting point.
        first: `search(spec, None)`, already made.
        fastest: the first memory choice of the ladder: a plan whose every stage runs it pays nothing for memory.
        chunked_loss: "auto" (tried as described above), or fixed: True / "on", False / "off".
        counts_free: the caller fixed neither a micro-batch count nor a global batch, so both may change.
    """
    if first is not None and _pays_nothing(first, fastest):
        return first
    found = [first] if first is not None else []
    for chunked in _chunked_values(spec, chunked_loss_setting(chunked_loss)):
        trial = replace(spec, chunked_loss=chunked)
        plan = first if chunked == spec.chunked_loss else search(trial, None)
        if plan is not None and plan is not first:
            found.append(plan)
        if counts_free:  # fewer micro-batches: a longer bubble, but maybe no tiles, offload or 8-bit moments
            found += _fewer_micro_batches(search, trial, fastest=fastest, fits=plan is not None)
    return max(found, key=tokens_per_second, default=None)


def with_fixed_loss(spec: TrainingSpec, chunked_loss: Union[bool, str] = AUTO) -> TrainingSpec:
    """`spec` with the chunked loss the caller fixed (on / off); under auto, the spec's own."""
    mode = chunked_loss_setting(chunked_loss)
    return spec if mode == AUTO else replace(spec, chunked_loss=mode == "on")


def loss_settings(spec: TrainingSpec, chunked_loss: Union[bool, str] = AUTO) -> list[bool]:
    """The chunked-loss settings a plan of `spec` may run: the fixed one, or under auto the spec's own and on where
    the objective allows it (the chunked loss is not always the smaller: at a short sequence its chunks' buffers can
    outweigh the logits it never holds)."""
    return _chunked_values(spec, chunked_loss_setting(chunked_loss))


def tokens_per_second(plan: Plan) -> float:
    """Tokens a step of `plan` trains over its estimated time: what the knobs are compared by."""
    return plan.dp * plan.micro_batches * plan.spec.micro_batch_size * plan.spec.seq_len / plan.step_time_s


def _pays_nothing(plan: Plan, fastest: Choice) -> bool:
    return all((plan.checkpointing_of(s), plan.optim_of(s), plan.tiled_mlp_of(s), s.host_embedding) ==
               (fastest.checkpointing, fastest.optim, fastest.tiled_mlp, fastest.host_embedding and s.has_embed)
               for s in plan.stages)


def _chunked_values(spec: TrainingSpec, mode: str) -> list[bool]:
    """The chunked-loss settings to try: the spec's own first, then on where auto may turn it on (where the
    objective's head allows it: `ObjectiveCounts.chunked_loss`)."""
    if mode != AUTO:
        return [mode == "on"]
    allowed = spec.counts.chunked_loss
    can = spec.method != "inference" and (allowed == "yes" or (allowed == "padded" and not spec.packing))
    return [spec.chunked_loss] + ([True] if can and not spec.chunked_loss else [])


def _fewer_micro_batches(search: Search, spec: TrainingSpec, *, fastest: Choice, fits: bool) -> list[Plan]:
    """Plans with fewer micro-batches (`FEWER_MICRO_BATCHES`, most first) down to the first that pays nothing for
    memory (or, where none of the default fits, the first that fits at all), then with one row a micro-batch at as
    many rows a step where none fits."""
    found = []
    for count in FEWER_MICRO_BATCHES:
        plan = search(spec, count)
        if plan is not None:
            found.append(plan)
            if not fits or _pays_nothing(plan, fastest):
                return found
    if not found and spec.micro_batch_size > 1:
        plan = search(replace(spec, micro_batch_size=1), None)
        found += [plan] if plan is not None else []
    return found


def any_count_fits(fits: Callable[[dict], bool], options: dict, *, devices: int) -> bool:
    """Whether `fits(make_plan options)` holds at the caller's micro-batches, or (where the caller fixed neither their
    count nor a global batch) at any of `FEWER_MICRO_BATCHES`, as `turn_knobs` would try them: fewer micro-batches
    than `devices` under GPipe, as schedule auto runs them."""
    if fits({}):
        return True
    free = options.get("micro_batches") is None and not options.get("global_batch")
    return free and any(fits({"micro_batches": count, **({"schedule": "GPipe"} if count < devices else {})})
                        for count in FEWER_MICRO_BATCHES)


def knob_fixes(plan_of: Callable[[TrainingSpec, dict], Optional[Plan]], spec: TrainingSpec, *, tiles: int,
               micro_batches) -> list[str]:
    """The knobs a caller held fixed that would make `spec` fit, each with its plan's figures (`figures`): the
    chunked loss, a tiled MLP (`tiles` slices, on checkpointed blocks), fewer micro-batches than the `micro_batches`
    given (the embedding table held off the host: `diagnosis`, with every other knob turned). `plan_of(spec, make_plan
    options)` plans one, or None."""
    trials = []
    if not spec.chunked_loss and _chunked_values(spec, AUTO)[-1]:
        trials.append(("the chunked loss (--chunked-loss on)", replace(spec, chunked_loss=True), {}))
    if tiles > 1 and spec.tiled_mlp <= 1 and spec.checkpointing != "off":
        trials.append((f"a tiled MLP, {tiles} slices a micro-batch (--tiled-mlp on)", replace(spec, tiled_mlp=tiles), {}))
    fixes = [f"{label}: {figures(plan)}" for label, trial, extra in trials if (plan := plan_of(trial, extra))]
    for count in (c for c in FEWER_MICRO_BATCHES if isinstance(micro_batches, int) and c < micro_batches):
        plan = plan_of(spec, {"micro_batches": count})
        if plan is not None:
            return fixes + [f"{count} micro-batches (--micro-batches {count}): {figures(plan)}"]
    return fixes


def figures(plan: Plan) -> str:
    """Each device's planned total against its budget, and the estimated step: what a listed change would give."""
    cards = " / ".join(format_bytes(rank_total(s.memory for s in plan.stages_of_rank(r))) for r in range(plan.pp))
    return f"{cards} per card (of {format_bytes(plan.stages[0].budget)}), est. step {plan.step_time_s:.1f} s"
