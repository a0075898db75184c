"""The planner: `make_plan` chooses TP degree, pipeline depth, layer counts, device order and every per-stage
memory decision for a model and a budget.

costs → search → Plan. Costs come from `hfsplit.planning.costs`; what a stage position costs from
`hfsplit.planning.stage_costs`; the search over splits is `hfsplit.planning.search`, the plan-wide knobs
`hfsplit.planning.knobs`, the checks of the caller's options `hfsplit.planning.checks`, and the explanation of
a no-fit `hfsplit.planning.diagnosis`. This module only puts them in order.
"""
from __future__ import annotations

import functools
import os
from dataclasses import replace
from typing import Optional, Union

from hfsplit.budget import BudgetSpec, budget_kinds, format_bytes, parse_max_memory
from hfsplit.checkpoint.resolve import left_out_of, load_config
from hfsplit.errors import PlanError
from hfsplit.models.families import check_causal_lm, check_supported
from hfsplit.plan import Plan, TrainingSpec
from hfsplit.plan.left_out import LeftOut
from hfsplit.planning.kind_rates import kind_rates
from hfsplit.planning.knobs import loss_settings, turn_knobs, with_fixed_loss
from hfsplit.planning.links import Link
from hfsplit.planning.max_seq import probe_knobs
from hfsplit.planning.memory_choices import host_budget, host_embedding_offered, host_share, ladder, mlp_tiles
from hfsplit.planning.reserve import reserve_for
from hfsplit.planning.timing import DEVICE_FLOPS
from hfsplit.schedules import AUTO
from hfsplit.planning.checks import check_degrees, check_lora_at_tp, check_options, checked_headroom
from hfsplit.planning.diagnosis import Search, could_fit, diagnosis_schedule, explain_no_fit
from hfsplit.planning.search import best_plan, forced_count


def make_plan(
    model,
    max_memory: BudgetSpec,
    *,
    spec: Optional[TrainingSpec] = None, micro_batches: Union[int, str, None] = None,
    global_batch: Optional[int] = None, schedule: str = AUTO,
    activation_checkpointing: Union[bool, str] = "auto", optim: str = "auto", headroom: float = 0.0,
    device_speeds: Optional[dict] = None, link: Optional[Link] = None,
    tp: Optional[int] = None, pp: Optional[int] = None, dp: Optional[int] = None,
    world_size: Optional[int] = None, single_process: bool = False, gpus: bool = True, tiled_mlp="auto",
    chunked_loss="auto", host_embedding="auto", explain: bool = True) -> Plan:
    """Plan the split of `model` over the devices of `max_memory`.

    Args:
        model: a hub name, a local folder, a config.json path, or a transformers config.
        max_memory: per-device budget (see `hfsplit.budget.parse_max_memory`); a "cpu" entry beside GPUs is the
            host RAM the ranks' activation offload may share (single_process: a device, as accelerate's).
        spec: what a step does (method, seq_len, micro-batch size, dtype, LoRA rank...).
        micro_batches: per step per replica (default 4 × pipeline depth); "auto" + global_batch: the cut too (`_cuts`).
        global_batch: sequences per optimizer step across replicas; sets micro_batches.
        schedule: "auto" (the fastest of `schedules.AUTO_CANDIDATES` by the time model, its step per candidate
            in the plan's notes) or a name from `hfsplit.schedules.TABLE` ("1F1B", "GPipe", ...).
        activation_checkpointing: "auto" (each pipeline rank off, on or offloaded to host memory: the fastest that
            fits it, `memory_choices`), or a setting every stage runs: False / "off", True / "on", "offload".
        optim: "auto" (each rank's moments fp32, or bitsandbytes' 8-bit where fp32 would not fit), or an optimizer
            every stage runs ("adamw_torch", "adamw_8bit", "paged_adamw_8bit").
        headroom: the fraction of each device's budget the plan leaves free (0.03: every device at most 97% full).
        device_speeds: relative speed per device key (default 1 each; a GPU kind's: `hfsplit.planning.kind_rates`).
        link: pipeline sends', TP all-reduces' and offload's host link (`DEFAULT_LINK` or the kinds'; runs: probed).
        tp, pp, dp, world_size: force a degree (tp=1 for single-process use), or exactly so many devices in all.
        single_process: plan for one process (the model's own forward), not the split. gpus: the numbered budgets
            are GPUs; False: CPU ranks, charged no reserve (`hfsplit.planning.reserve`).
        tiled_mlp: "auto" (tiled where nothing else fits a rank: `memory_choices.ladder`), "on" or "off".
        chunked_loss: "auto" (the spec's, or on where that fits faster: `knobs.turn_knobs`), True / "on", False / "off".
        host_embedding: "auto" (a frozen, untied input embedding table in host RAM where nothing else fits), "on", "off".
        explain: False: a no-fit raises at once, without the diagnosis's re-plans (`max_seq` probes so).

    Raises:
        PlanError: nothing fits; the message says per stage what is needed against the budget and which fix fits.
    """
    config, name = _config_and_name(model, single_process=single_process)
    spec, chunked_loss = spec or TrainingSpec(), "off" if single_process else chunked_loss  # one process: its own loss
    budgets, host = host_budget(parse_max_memory(max_memory), single_process=single_process)
    rates = kind_rates(kinds := budget_kinds(max_memory), unit=DEVICE_FLOPS, config=config, spec=spec,
                       given=device_speeds, link_given=link is not None)
    given_reserve, spec = spec.reserve_bytes, _with_reserve(spec, budgets, gpus=gpus, distributed=(
        world_size or len(budgets)) > 1 and not single_process)
    options = dict(micro_batches=micro_batches, global_batch=global_batch, schedule=schedule, tp=tp, pp=pp, dp=dp,
                   device_speeds={**rates.speeds, **(device_speeds or {})}, device_bandwidths=rates.bandwidths,
                   link=link or rates.link, world_size=world_size, host=host, headroom=checked_headroom(headroom))
    knobs = dict(activation_checkpointing=activation_checkpointing, optim=optim, tiled_mlp=tiled_mlp,
                 chunked_loss=chunked_loss, host_embedding=host_embedding)
    _check_request(config, budgets, spec, options, activation_checkpointing=activation_checkpointing)
    found = _with_knobs(config, budgets, spec, name=name, options=options, chunked_loss=chunked_loss,
                        choices=_ladder(config, spec, knobs, single_process=single_process))
    if found is not None:  # a multimodal checkpoint's towers: what the plan of its language model leaves out
        return _with_host_note(replace(found, notes=found.notes + rates.notes, left_out=LeftOut.of(left_out_of(
            config))), host, options["link"])
    raise _no_fit(config, budgets, spec, name=name, knobs=knobs, options=options, explain=explain, launch=dict(
        kinds=kinds, reserve=given_reserve, gpus=gpus, single_process=single_process, speeds=device_speeds, link=link))


def _check_request(config, budgets: dict[str, int], spec: TrainingSpec, options: dict, *,
                   activation_checkpointing) -> None:
    """The caller's options, then the forced degrees against the devices and the model (`checks`)."""
    o = options
    check_options(o["schedule"], o["micro_batches"], o["global_batch"], spec, activation_checkpointing, o["world_size"],
                  tp=o["tp"], pp=o["pp"], dp=o["dp"])
    check_degrees(config, budgets, tp=o["tp"], pp=o["pp"], dp=o["dp"], micro_batches=forced_count(o["micro_batches"]),
                  schedule=o["schedule"], world_size=o["world_size"])
    check_lora_at_tp(config, spec, tp=o["tp"])


def _no_fit(config, budgets: dict[str, int], spec: TrainingSpec, *, name: str, knobs: dict, options: dict,
            launch: dict, explain: bool) -> PlanError:
    """The no-fit error (`diagnosis.explain_no_fit`): the closest split over the knobs make_plan turns at their most
    frugal, and each change of size planned by make_plan's own search (`_search_of`); no schedule search. A table
    the caller held on the card that could stay in host RAM is a change it lists."""
    if not explain:
        return PlanError(f"{name}: no split fits (not explained)")
    host_table = knobs["host_embedding"] in (False, "off") and host_embedding_offered(
        config, spec, single_process=launch["single_process"])
    search = _search_of(config, name=name, budgets=budgets, options=options, knobs=knobs, **launch)
    chunked_loss = knobs["chunked_loss"]
    schedule = diagnosis_schedule(options["schedule"], options["micro_batches"], len(budgets))
    return PlanError(explain_no_fit(config, budgets, spec, name=name, options={**options, "schedule": schedule},
                                    search=search, choices=_ladder(config, spec, knobs, single_process=launch[
                                        "single_process"]),
                                    losses=loss_settings(with_fixed_loss(spec, chunked_loss), chunked_loss),
                                    host_table=host_table))


def _ladder(config, spec: TrainingSpec, knobs: dict, *, single_process: bool) -> list:
    """Each rank's memory choices for `spec` under make_plan's knobs (a tiled MLP's slices grow with the sequence)."""
    return ladder(spec, activation_checkpointing=knobs["activation_checkpointing"], optim=knobs["optim"],
                  single_process=single_process, tiled_mlp=knobs["tiled_mlp"], tiles=mlp_tiles(config, spec),
                  host_embedding=knobs["host_embedding"],
                  embedding_frozen=host_embedding_offered(config, spec, single_process=single_process))


def _search_of(config, *, name: str, budgets: dict[str, int], kinds: dict, options: dict, knobs: dict, reserve,
               gpus: bool, single_process: bool, speeds: Optional[dict], link: Optional[Link]) -> Search:
    """make_plan's search as a function of the budgets and the spec (`diagnosis.Search`), for the diagnosis's changes
    of size: a trial is planned as make_plan would plan that job (each rank's ladder and every knob; its reserve, and
    the speeds measured for its shape), so what the diagnosis offers, make_plan accepts. An added device is one more
    of the smallest given (its kind's speed); more devices than the launch's are searched without its world size."""
    smallest = min(budgets, key=budgets.get)

    @functools.lru_cache(maxsize=None)
    def cached(trial_budgets: tuple, trial: TrainingSpec, changes: tuple) -> Optional[Plan]:
        trial_budgets, changes = dict(trial_budgets), dict(changes)
        grown = len(trial_budgets) > len(budgets)
        turned = {**knobs, **{k: v for k, v in changes.items() if k in knobs}}
        trial = with_reserve_of(trial, grown=grown)
        rates = kind_rates(kinds, unit=DEVICE_FLOPS, config=config, spec=trial, given=speeds,
                           link_given=link is not None)
        known = {**rates.speeds, **(speeds or {})}
        trial_options = {**options, "device_speeds": {**{d: known.get(smallest, 1.0) for d in trial_budgets}, **known},
                         **({"world_size": None} if grown else {}),
                         **{k: v for k, v in changes.items() if k not in knobs}}
        choices = _ladder(config, trial, turned, single_process=single_process)
        return _with_knobs(config, trial_budgets, trial, name=name, choices=choices, options=trial_options,
                           chunked_loss=turned["chunked_loss"])

    def with_reserve_of(trial: TrainingSpec, *, grown: bool) -> TrainingSpec:
        # more devices make a one-device job a launch: NCCL's buffers join the reserve (the given devices' own)
        distributed = (options["world_size"] or len(budgets)) > 1 or grown
        return _with_reserve(replace(trial, reserve_bytes=reserve), budgets, gpus=gpus,
                             distributed=distributed and not single_process)

    def search(trial_budgets: dict[str, int], trial: TrainingSpec, *, probe: bool = False, **changes) -> Optional[Plan]:
        changes = {**probe_knobs(knobs), **changes} if probe else changes  # as --max-seq-len's probes
        return cached(tuple(trial_budgets.items()), trial, tuple(sorted(changes.items())))

    return search


def _with_knobs(config, budgets: dict[str, int], spec: TrainingSpec, *, name: str, choices: list, options: dict,
                chunked_loss) -> Optional[Plan]:
    """The fastest fitting plan of `spec` with each rank's memory choices (`best_plan`), and the plan-wide knobs
    turned where that fits faster or fits at all (`knobs.turn_knobs`: the chunked loss, the micro-batches)."""
    def search(trial: TrainingSpec, count: Optional[int]) -> Optional[Plan]:
        return best_plan(config, budgets, trial, name=name, choices=choices,
                         **{**options, **({"micro_batches": count} if count else {})})

    free = options["micro_batches"] is None and not options["global_batch"]
    spec = with_fixed_loss(spec, chunked_loss)
    first = search(spec, None)
    if first is None and not could_fit(config, budgets, spec):  # the weights alone exceed the devices: no knob helps
        return None
    return turn_knobs(search, spec, first=first, fastest=choices[0], chunked_loss=chunked_loss, counts_free=free)


def _with_reserve(spec: TrainingSpec, budgets: dict[str, int], *, gpus: bool, distributed: bool) -> TrainingSpec:
    """`spec` with the reserve measured for these devices (0 on the CPU; one process: no NCCL), unless it gives one."""
    if spec.reserve_bytes is not None:
        return spec
    return replace(spec, reserve_bytes=reserve_for(budgets, gpus=gpus, distributed=distributed))


def _config_and_name(model, *, single_process: bool):
    """(the transformers config of `model`, the name the plan records), refused early if hfsplit cannot split it."""
    config = load_config(model) if isinstance(model, (str, os.PathLike)) else model
    name = str(model) if isinstance(model, (str, os.PathLike)) else (config._name_or_path or config.model_type)
    check_causal_lm(config) if single_process else check_supported(config)
    return config, name


def _with_host_note(plan: Plan, host: Optional[int], link: Link) -> Plan:
    """`plan` with a note on the host RAM its offload takes (per rank, against the share of max_memory["cpu"]) and the
    host link rate its copies were charged at."""
    if not plan.offload_bytes:
        return plan
    ranks = plan.world_size
    most = max(sum(s.memory.offload for s in plan.stages_of_rank(r)) for r in range(plan.pp))
    given = (f" of its share {format_bytes(host_share(host, ranks))} of max_memory['cpu'] {format_bytes(host)} "
             f"({ranks} local ranks)") if host is not None else " (no max_memory['cpu'] given: not checked)"
    note = (f"activation offload: {format_bytes(plan.offload_bytes * plan.dp)} of host RAM in all, the fullest rank "
            f"{format_bytes(most)}{given}; its copies cross the host link at {link.host_gbs_described()}")
    return replace(plan, notes=plan.notes + (note,))
