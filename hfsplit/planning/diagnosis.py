"""Why nothing fits, and what would: the closest split, each over-budget stage, and the changes that fit (knobs,
headroom, host RAM, QLoRA, a shorter sequence by binary search, a smaller micro-batch, more or larger devices),
each checked by planning it. The closest split is planned with the knobs make_plan turns at their most frugal, and
each change of size with make_plan's own search (passed in), so what it offers make_plan accepts."""
from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Callable, Optional, Sequence

from hfsplit.budget import format_bytes
from hfsplit.models.expert_lora import expert_parameters
from hfsplit.plan import Plan, TrainingSpec, is_8bit
from hfsplit.planning.costs.model import model_costs, weight_bytes
from hfsplit.planning.knobs import FEWER_MICRO_BATCHES, any_count_fits, figures, knob_fixes
from hfsplit.planning.max_seq import MULTIPLE, longest_length, top_length
from hfsplit.planning.memory_choices import Choice, frugal_choices, mlp_tiles
from hfsplit.schedules import AUTO, virtual_stages
from hfsplit.planning.search import (
    best_plan, device_orders, forced_count, micro_batch_count, plan_of_split, split_layers, stage_slots, tp_degrees_for,
)


# search(budgets, spec, probe=False, **changes) → the plan make_plan makes of `spec` on `budgets` (None: nothing
# fits), every memory choice and knob turned as make_plan turns them (`planner._search_of`, passed in: the planner
# sits above this module). `changes` override make_plan's knobs (optim, chunked_loss...) or options (micro_batches...); probe: the
# knobs the caller left to the planner at their most frugal, as `--max-seq-len` probes (`max_seq.probe_knobs`).
Search = Callable[..., Optional[Plan]]


def explain_no_fit(config, budgets: dict[str, int], spec: TrainingSpec, *, name: str, options: dict, search: Search,
                   choices: Sequence[Choice], losses: Sequence[bool], host_table: bool = False) -> str:
    """The no-fit message: the closest split's stages against their budgets, and the changes that fit. `choices`:
    each rank's memory choices and `losses`: the chunked-loss settings make_plan searched; `search`: make_plan's
    search, which plans each change of size (a shorter sequence, more devices, larger devices);
    `host_table`: the caller held off an embedding table that could stay in host RAM (a change it lists)."""
    closest = _closest_plan(config, budgets, spec, options, choices=frugal_choices(choices), losses=losses)
    lines = [f"{name}: no split fits the budget ({len(budgets)} device(s): "
             + ", ".join(f"{k}={format_bytes(v)}" for k, v in budgets.items())
             + f") for {spec.method} at seq_len {spec.seq_len} × micro-batch {spec.micro_batch_size}."]
    if closest is not None:
        lines.append(f"closest split: pp={closest.pp} × tp={closest.tp}, {_knobs_of(closest)} "
                     "(what the planner turns, at its most frugal):")
        headroom = options.get("headroom") or 0.0
        for s in closest.stages:
            usable = _usable(s.budget, headroom)
            over = s.memory.total - usable
            lines.append(f"  stage {s.index} on {','.join(s.devices[0])}: layers {s.layers[0]}-{s.layers[1] - 1}, "
                         f"needs {format_bytes(s.memory.total)} of {format_bytes(usable)}"
                         + (f" ({format_bytes(s.budget)} less the {headroom:.0%} headroom)" if headroom else "")
                         + (f" ({format_bytes(over)} over)" if over > 0 else ""))
    frugal = _frugal_spec(spec, choices, losses)
    fixes = (_host_table_fix(budgets, spec, search) if host_table else []) + _fixes_that_fit(
        config, budgets, frugal, options) + _sizes_that_fit(config, budgets, spec, search)
    if fixes:
        lines.append("changes that fit: " + "; ".join(fixes))
    else:
        lines.append("no single change tried (LoRA, activation checkpointing, offload, 8-bit optimizer states, "
                     "shorter sequence, smaller micro-batch, more or larger GPUs) fits")
    return "\n".join(lines)


def _knobs_of(plan: Plan) -> str:
    """The knobs a closest split was planned with, in words."""
    stage = plan.stages[0]
    mlp = f"MLP in {stage.tiled_mlp} tiles" if stage.tiled_mlp else "MLP whole"
    count = f"{plan.micro_batches} micro-batch{'es' if plan.micro_batches > 1 else ''}"
    rows = plan.spec.micro_batch_size
    return (f"{count} of {rows} row{'s' if rows > 1 else ''} ({plan.schedule}), activation checkpointing "
            f"{stage.checkpointing}, {stage.optim}, {mlp}, chunked loss {'on' if plan.spec.chunked_loss else 'off'}")


def _closest_plan(config, budgets, spec, options, *, choices: Sequence[Choice],
                  losses: Sequence[bool]) -> Optional[Plan]:
    """The time-balanced split with the smallest worst overshoot, ignoring the caps, over the knobs make_plan turns:
    each of `choices` on every rank, each loss of `losses`, and the micro-batches (fewer, or one row each, where the
    caller fixed neither their count nor a global batch), so its overshoot is what the knobs leave."""
    unlimited = {k: 1 << 62 for k in budgets}
    best, best_over = None, math.inf
    # where the weights alone overflow no knob helps: the caller's micro-batch only (no shape traced for nothing)
    cuts = _frugal_cuts(spec, options) if could_fit(config, budgets, spec) else [(spec.micro_batch_size, None)]
    for choice, chunked, (rows, count) in itertools.product(choices, losses or [spec.chunked_loss], cuts):
        trial = replace(choice.spec(spec), chunked_loss=chunked, micro_batch_size=rows)
        for t in tp_degrees_for(config, trial, len(budgets)):
            if options["tp"] not in (None, t):  # a split this path can run (one process: tp=1)
                continue
            costs = model_costs(config, trial, tp=t)
            p = min(len(budgets) // t, costs.num_layers)
            m = count or micro_batch_count(options["micro_batches"], options["global_batch"], trial, p, 1)
            schedule = "GPipe" if p > 1 and m < p else options["schedule"] if p > 1 else "1F1B"
            v = virtual_stages(schedule, p)
            for groups in itertools.islice(device_orders(budgets, t=t, count=p), 24):
                slots = stage_slots(groups, unlimited, options["device_speeds"], p=p, d=1, v=v, m=m,
                                    schedule=schedule, link=options["link"])
                counts = split_layers(costs, slots)
                if counts is None:
                    continue
                slots = [replace(s, budget=min(budgets[x] for g in s.devices for x in g)) for s in slots]
                plan = plan_of_split(costs, slots, counts, name="", config=config, t=t, p=p, d=1, v=v, m=m,
                                     schedule=schedule, choices=[choice])
                over = max(s.memory.total / _usable(s.budget, options.get("headroom") or 0.0) for s in plan.stages)
                if over < best_over:
                    best, best_over = plan, over
    return best


def _usable(budget: int, headroom: float) -> int:
    """What a plan may fill of `budget` under make_plan's headroom (`search.stage_slots`' cap)."""
    return int(budget * (1 - headroom)) if headroom else budget


def _frugal_cuts(spec: TrainingSpec, options: dict) -> list[tuple[int, Optional[int]]]:
    """(rows a micro-batch, micro-batches: None for the default) the closest split tries: the caller's, and where the
    caller fixed neither count nor global batch the fewest `knobs.turn_knobs` tries and one row a micro-batch."""
    cuts = [(spec.micro_batch_size, None)]
    if options.get("micro_batches") is None and not options.get("global_batch"):
        cuts.append((spec.micro_batch_size, min(FEWER_MICRO_BATCHES)))
        if spec.micro_batch_size > 1:
            cuts.append((1, None))
    return cuts


def _frugal_spec(spec: TrainingSpec, choices: Sequence[Choice], losses: Sequence[bool]) -> TrainingSpec:
    """The spec the one-knob fixes are planned from: the ladder's last untiled choice (a tiled MLP is a fix of its
    own, `knobs.knob_fixes`) with the last chunked-loss setting make_plan may run."""
    untiled = [c for c in choices if not c.tiled_mlp] or list(choices)
    return replace(untiled[-1].spec(spec), chunked_loss=(list(losses) or [spec.chunked_loss])[-1])


def _sizes_that_fit(config, budgets: dict[str, int], spec: TrainingSpec, search: Search) -> list[str]:
    """The changes of size, each planned by make_plan's own search (`search`): the longest sequence that fits (as
    `--max-seq-len` finds it: the same search, multiples of `max_seq.MULTIPLE`), one row a micro-batch, the fewest
    devices, the smallest uniform budget. Each is one make_plan then accepts."""
    def fits(b: dict[str, int], s: TrainingSpec, **changes) -> bool:
        return could_fit(config, b, s) and search(b, s, **changes) is not None

    fixes = []
    seq = longest_length(lambda n: fits(budgets, replace(spec, seq_len=n), probe=True), config, spec,
                         top=top_length(config))
    if seq is not None:
        which = "shorter" if seq < spec.seq_len else "longer (a tiled MLP's slice shrinks as the slices step)"
        fixes.append(f"a {which} sequence (--seq-len {seq}, the longest that fits, to {MULTIPLE} tokens: "
                     "what plan --max-seq-len answers)")
    least = spec.rows_per_example  # a padded example of several rows (DPO's pair) stays in one micro-batch
    if spec.micro_batch_size > least and fits(budgets, replace(spec, micro_batch_size=least)):
        one = f", one {spec.counts.example}" if least > 1 else ""
        fixes.append(f"micro-batch size {least} (--micro-batch-size {least}{one})")
    count = _fewest_devices(lambda b: fits(b, spec), budgets)
    if count is not None:
        fixes.append(f"{count} devices (add {count - len(budgets)} × {format_bytes(min(budgets.values()))})")
    larger = _smallest_uniform_budget(lambda b: fits(b, spec), budgets)
    if larger is not None:
        fixes.append(f"{len(budgets)} devices of {format_bytes(larger)} each")
    return fixes


def _host_table_fix(budgets: dict[str, int], spec: TrainingSpec, search: Search) -> list[str]:
    """The embedding table the caller held on the card, in host RAM, with every other knob as make_plan turns them
    (alone, from the frugal spec, it may not fit where it does with the tiled MLP and fewer micro-batches)."""
    plan = search(budgets, spec, host_embedding="on")
    return [f"the first stage's embedding table in host RAM (--host-embedding on): {figures(plan)}"] if plan else []


def _fixes_that_fit(config, budgets: dict[str, int], spec: TrainingSpec, options: dict) -> list[str]:
    """The one-knob changes (LoRA, QLoRA, the experts in 4 bits, checkpointing, offload, 8-bit moments, host RAM, the
    knobs the caller fixed), each planned from `spec`, the frugal one (`_frugal_spec`)."""
    def fits(b, s) -> bool:
        # Fewer micro-batches where the caller fixed no count: as make_plan would try them (`knobs.turn_knobs`).
        return could_fit(config, b, s) and any_count_fits(
            lambda extra: best_plan(config, b, s, name="", **{**options, **extra}) is not None, options,
            devices=len(b))

    fixes = []
    if spec.method == "full" and fits(budgets, replace(spec, method="lora")):
        fixes.append("LoRA instead of full fine-tuning (--lora-r 16)")
    qlora = qlora_fix(config, budgets, spec, options)
    if qlora:
        fixes.append(qlora)
    experts = replace(spec, quantize_experts=True)
    if experts.experts_in_4bit and not spec.experts_in_4bit and expert_parameters(config) and fits(budgets, experts):
        fixes.append("the MoE experts in 4 bits too (--quantize-experts on)")
    if spec.method != "inference" and not spec.activation_checkpointing and fits(
            budgets, replace(spec, activation_checkpointing=True)):
        fixes.append("activation checkpointing (--activation-checkpointing on)")
    fixes += _headroom_fixes(spec, lambda s: fits(budgets, s))
    if options.get("host") is not None and spec.checkpointing == "offload":
        fixes += _host_fix(config, budgets, spec, options)
    fixes += knob_fixes(lambda s, extra: best_plan(config, budgets, s, name="", **{**options, **extra})
                        if could_fit(config, budgets, s) else None, spec, tiles=mlp_tiles(config, spec),
                        micro_batches=options["micro_batches"])
    return fixes


def _headroom_fixes(spec: TrainingSpec, fits) -> list[str]:
    """Offloaded checkpointing and 8-bit optimizer states, each alone, else both together, where they fit."""
    if spec.method in ("inference",):
        return []
    offload = replace(spec, activation_checkpointing="offload") if spec.checkpointing != "offload" else None
    eight = replace(spec, optim="adamw_8bit") if not is_8bit(spec.optim) else None
    fixes = []
    if offload is not None and fits(offload):
        fixes.append("offloaded activation checkpointing: block inputs in host RAM (--activation-checkpointing offload)")
    if eight is not None and fits(eight):
        fixes.append("8-bit optimizer states (--optim adamw_8bit)")
    if not fixes and offload is not None and eight is not None and fits(replace(offload, optim="adamw_8bit")):
        fixes.append("offloaded activation checkpointing and 8-bit optimizer states "
                     "(--activation-checkpointing offload --optim adamw_8bit)")
    return fixes


def _host_fix(config, budgets: dict[str, int], spec: TrainingSpec, options: dict) -> list[str]:
    """More host RAM for the offload, where the plan without a host limit fits: how much max_memory["cpu"] it needs
    (its fullest rank's offload times the ranks sharing the host)."""
    plan = best_plan(config, budgets, spec, name="", **{**options, "host": None})
    if plan is None:
        return []
    fullest = max(sum(s.memory.offload for s in plan.stages_of_rank(r)) for r in range(plan.pp))
    enough = math.ceil(fullest * plan.world_size / (1 << 30) * 100) / 100  # rounded up: the figure given must fit
    return [f"more host RAM for the activation offload (max_memory['cpu'] of "
            f"{enough:.2f} GiB or more, e.g. --max-memory ...,cpu:SIZE)"]


def could_fit(config, budgets: dict[str, int], spec: TrainingSpec) -> bool:
    """False when the weights alone (held once) exceed what the devices hold beyond their reserves: no split of
    `spec` fits, which the diagnosis learns without tracing a block (each trace is one per TP degree and shape)."""
    reserve = spec.reserve_bytes or 0
    return weight_bytes(config, spec) <= sum(max(b - (reserve if d != "cpu" else 0), 0) for d, b in budgets.items())


def qlora_fix(config, budgets: dict[str, int], spec: TrainingSpec, options: dict) -> Optional[str]:
    """"Quantize the base to 4-bit (QLoRA)" with the fullest stage's figures, when that plan fits."""
    if spec.method not in ("lora", "full"):
        return None
    plan = best_plan(config, budgets, replace(spec, method="qlora"), name="", **{**options, "tp": None})  # QLoRA: tp=1
    if plan is None:
        return None
    fullest = max(plan.stages, key=lambda s: s.memory.total / s.budget)
    return (f"Quantize the base to 4-bit (QLoRA: --method qlora, hfsplit plan --qlora): pp={plan.pp} × dp={plan.dp}, "
            f"fullest stage {format_bytes(fullest.memory.total)} of {format_bytes(fullest.budget)} "
            f"(weights {format_bytes(fullest.memory.weights)})")


def _fewest_devices(fits, budgets: dict[str, int], limit: int = 512) -> Optional[int]:
    """Fewest devices (the given ones plus more of the smallest budget) that fit, up to `limit`."""
    smallest = min(budgets.values())

    def grown(count: int) -> dict[str, int]:
        return {**budgets, **{f"+{i}": smallest for i in range(count - len(budgets))}}

    low, high = len(budgets), len(budgets) * 2
    while not fits(grown(high)):
        low, high = high, high * 2
        if high > limit:
            return None
    while high - low > 1:
        mid = (low + high) // 2
        if fits(grown(mid)):
            high = mid
        else:
            low = mid
    return high


def _smallest_uniform_budget(fits, budgets: dict[str, int]) -> Optional[int]:
    """Smallest per-device budget (to 1/16 GiB, rounded up to the 0.01 GiB it is printed to) at which every device of
    `budgets` fits, up to 16× the largest."""
    high = max(budgets.values()) * 16
    if not fits({k: high for k in budgets}):
        return None
    low = max(budgets.values())
    step = 1 << 26
    while high - low > step:
        mid = (low + high) // 2
        if fits({k: mid for k in budgets}):
            high = mid
        else:
            low = mid
    cent = (1 << 30) // 100
    return -(-high // cent) * cent


def diagnosis_schedule(schedule: str, micro_batches, devices: int) -> str:
    """The one schedule a no-fit diagnosis plans with: the given one, or under auto 1F1B — GPipe when the
    micro-batches are fewer than the devices, as 1F1B cannot run them over that many stages (and auto would
    fall back to GPipe there too, `_runnable`)."""
    if schedule != AUTO:
        return schedule
    count = forced_count(micro_batches)
    return "GPipe" if count is not None and count < devices else "1F1B"
