"""The planner: choose TP degree, pipeline depth, layer counts and device order.

costs → solver → Plan. Costs come from `hfsplit.planning.costs`; this module only searches.

The layer split is, in general, a dynamic programme over contiguous layer ranges.
Because every decoder block of a model costs the same, a stage's time and memory
depend only on how many blocks it holds, and the programme collapses to giving each
stage a count. Handing out blocks one at a time to the stage whose time grows least
(within its memory cap) reaches the min-max optimum exactly for nondecreasing stage
costs (tests check it against brute force) in O(L log P) instead of O(P L²), which is
what keeps 126 layers × 16 devices well under a second. Where the layers are of several kinds (Qwen3-MoE's
dense `mlp_only_layers`), a stage's costs are those of the layer range it holds, and the same greedy hands out
blocks checking every rank (a block more on one stage shifts the ranges of the later ones).
"""
from __future__ import annotations

import heapq
import itertools
import math
import os
from dataclasses import dataclass, replace
from typing import Iterable, Optional, Sequence, Union

from hfsplit.budget import BudgetSpec, budget_kinds, format_bytes, parse_max_memory
from hfsplit.checkpoint.resolve import load_config
from hfsplit.errors import PlanError
from hfsplit.models.expert_lora import expert_parameters
from hfsplit.models.families import check_causal_lm, check_supported, tp_degree_error, valid_tp_degrees
from hfsplit.models.layer_kinds import runs_of
from hfsplit.plan import Plan, Stage, StageMemory, TrainingSpec, checkpointing_mode, is_8bit, rank_total
from hfsplit.planning.costs.model import ModelCosts, PartCost, model_costs, weight_bytes
from hfsplit.planning.buffers import pipeline_buffer_bytes
from hfsplit.planning.kind_rates import kind_rates
from hfsplit.planning.knobs import any_count_fits, frugal_loss, knob_fixes, turn_knobs
from hfsplit.planning.max_seq import longest_fitting
from hfsplit.planning.links import DEFAULT_LINK, Link
from hfsplit.planning.reference import forward_fraction, per_step, reference_bytes
from hfsplit.planning.rollout import rollout_bytes, rollout_seconds
from hfsplit.planning.memory_choices import (
    AUTO as AUTO_CHOICE, Choice, frugal, host_budget, host_share, ladder, mlp_tiles, plan_spec,
)
from hfsplit.planning.reserve import reserve_for
from hfsplit.planning.timing import DEVICE_FLOPS
from hfsplit.schedules import (
    AUTO, AUTO_CANDIDATES, TABLE, min_micro_batches, pp_rank_of_stage, virtual_stages,
)

CPU_SPEED = 0.02
MAX_PERMUTED_GROUPS = 5  # device orders tried exhaustively up to this many stage groups


@dataclass(frozen=True)
class Slot:
    """One (virtual) stage position before layers are assigned."""

    index: int
    pp_rank: int
    devices: tuple[tuple[str, ...], ...]
    budget: int
    speed: float
    in_flight: int
    has_embed: bool
    has_head: bool
    link: Link = DEFAULT_LINK
    sends: int = 0  # pipeline neighbours on another rank (a V's turn stays on its rank: no message)
    actions: int = 2  # schedule actions per micro-batch: forward, backward (zero bubble: + weight gradient)
    host_budget: Optional[int] = None  # host bytes this rank's activation offload may hold (None: no limit given)
    cap: Optional[int] = None  # what the plan may fill of `budget` (None: all of it; less under make_plan's headroom)
    micro_batches: int = 1  # per step per replica (DPO's reference pass covers them all)
    relay: bool = False  # the rank runs several stages: a forward-only pass relays all rows at once (`reference`)
    output_sent: bool = True  # the next stage is on another rank (a V's turn passes its output on the rank)
    gradient_sent: bool = False  # the previous stage is on another rank: its input's gradient goes back by message
    sends_held: bool = False  # torch's multi-stage runtime keeps every tensor it sends until the step's end


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
    chunked_loss="auto", explain: bool = True) -> Plan:
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
        single_process: plan for one process (the model's own forward; any causal LM), not the split. gpus: the
            numbered budgets are GPUs; False: CPU ranks, charged no reserve (`hfsplit.planning.reserve`).
        tiled_mlp: "auto" (tiled where nothing else fits a rank: `memory_choices.ladder`), "on" or "off".
        chunked_loss: "auto" (the spec's, or on where that fits faster: `knobs.turn_knobs`), True / "on", False / "off".
        explain: False: a no-fit raises at once, without the diagnosis's re-plans (`max_seq` probes so).

    Raises:
        PlanError: nothing fits; the message says per stage what is needed against the budget and which fix fits.
    """
    config, name = _config_and_name(model, single_process=single_process)
    spec, chunked_loss = spec or TrainingSpec(), "off" if single_process else chunked_loss  # one process: its own loss
    budgets, host = host_budget(parse_max_memory(max_memory), single_process=single_process)
    rates = kind_rates(budget_kinds(max_memory), unit=DEVICE_FLOPS, config=config, spec=spec, given=device_speeds,
                       link_given=link is not None)
    if spec.reserve_bytes is None:  # measured for these devices (0 on the CPU; one process: no NCCL), unless given
        spec = replace(spec, reserve_bytes=reserve_for(budgets, gpus=gpus, distributed=(world_size or len(budgets)) > 1
                                                       and not single_process))
    _check_options(schedule, micro_batches, global_batch, spec, activation_checkpointing, world_size, tp=tp, pp=pp, dp=dp)
    options = dict(micro_batches=micro_batches, global_batch=global_batch, schedule=schedule, tp=tp, pp=pp, dp=dp,
                   device_speeds={**rates.speeds, **(device_speeds or {})}, link=link or rates.link,
                   world_size=world_size, host=host, headroom=_checked_headroom(headroom))
    choices = ladder(spec, activation_checkpointing=activation_checkpointing, optim=optim,
                     single_process=single_process, tiled_mlp=tiled_mlp, tiles=mlp_tiles(config, spec))
    _check_degrees(config, len(budgets), tp=tp, pp=pp, dp=dp, micro_batches=_count(micro_batches), schedule=schedule)
    _check_budget_count(world_size, budgets)
    found = _with_knobs(config, budgets, spec, name=name, choices=choices, options=options, chunked_loss=chunked_loss)
    if found is not None:
        return _with_host_note(replace(found, notes=found.notes + rates.notes), host, options["link"])
    options["schedule"] = _diagnosis_schedule(schedule, micro_batches, len(budgets))  # the diagnosis needs no schedule search
    raise PlanError(_explain_no_fit(config, budgets, frugal_loss(frugal(choices).spec(spec), chunked_loss), name=name,
                                    options=options) if explain else f"{name}: no split fits (not explained)")


def _with_knobs(config, budgets: dict[str, int], spec: TrainingSpec, *, name: str, choices: list, options: dict,
                chunked_loss) -> Optional[Plan]:
    """The fastest fitting plan of `spec` with each rank's memory choices (`best_plan`), and the plan-wide knobs
    turned where that fits faster or fits at all (`knobs.turn_knobs`: the chunked loss, the micro-batches)."""
    def search(trial: TrainingSpec, count: Optional[int]) -> Optional[Plan]:
        return best_plan(config, budgets, trial, name=name, choices=choices,
                         **{**options, **({"micro_batches": count} if count else {})})

    free = options["micro_batches"] is None and not options["global_batch"]
    first = search(spec, None)
    if first is None and not could_fit(config, budgets, spec):  # the weights alone exceed the devices: no knob helps
        return None
    return turn_knobs(search, spec, first=first, fastest=choices[0], chunked_loss=chunked_loss, counts_free=free)


def _config_and_name(model, *, single_process: bool):
    """(the transformers config of `model`, the name the plan records), refused early if hfsplit cannot split it."""
    config = load_config(model) if isinstance(model, (str, os.PathLike)) else model
    name = str(model) if isinstance(model, (str, os.PathLike)) else (config._name_or_path or config.model_type)
    check_causal_lm(config) if single_process else check_supported(config)
    return config, name


def _checked_headroom(headroom: float) -> float:
    if not 0 <= headroom < 0.5:
        raise PlanError(f"headroom={headroom}: a fraction of each budget to leave free, from 0 to below 0.5 "
                        "(0.03 keeps 3% of every device free)")
    return float(headroom)


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


def _diagnosis_schedule(schedule: str, micro_batches, devices: int) -> str:
    """The one schedule a no-fit diagnosis plans with: the given one, or under auto 1F1B — GPipe when the
    micro-batches are fewer than the devices, as 1F1B cannot run them over that many stages (and auto would
    fall back to GPipe there too, `_runnable`)."""
    if schedule != AUTO:
        return schedule
    count = _count(micro_batches)
    return "GPipe" if count is not None and count < devices else "1F1B"


def best_plan(config, budgets: dict[str, int], spec: TrainingSpec, *, name: str, micro_batches, global_batch,
              schedule: str, device_speeds: dict, link: Link = DEFAULT_LINK, tp=None, pp=None, dp=None,
              world_size: Optional[int] = None, choices: Optional[Sequence[Choice]] = None,
              host: Optional[int] = None, headroom: float = 0.0) -> Optional[Plan]:
    """The fastest fitting plan (by tokens/s), or None. Under schedule "auto" each candidate schedule
    is searched and the plan's notes give the best step of each (and of each micro-batch cut, under
    micro_batches="auto"). Each rank runs the first of `choices` (default: the spec's own) that fits it; `host`
    is the host RAM the ranks' activation offload shares (None: no limit)."""
    candidates = _schedule_candidates(schedule)
    choices = list(choices or [Choice(spec.checkpointing, spec.optim, spec.tiled_mlp)])
    best: dict[tuple[str, int], tuple[float, Plan]] = {}
    cache: dict = {}
    for t, p, d in _shapes(config, budgets, spec, tp=tp, pp=pp, dp=dp, world_size=world_size):
        for b, m in _cuts(micro_batches, global_batch, spec, p, d):
            cut = replace(spec, micro_batch_size=b)
            if p > config.num_hidden_layers:
                continue
            for sched in _runnable(candidates, schedule, m=m, p=p):
                usable = [c for c in choices if not (p > 1 and _recompute_kept(sched, c))]
                if p > 1 and (m < min_micro_batches(sched, p) or not usable):
                    continue  # torch refuses fewer micro-batches; or checkpointing would save nothing here
                variants = Variants(config, cut, t, usable, cache)
                for candidate in plans_for_shape(variants, budgets, device_speeds, t=t, p=p, d=d, m=m, schedule=sched,
                                                 name=name, config=config, link=link,
                                                 host_budget=host_share(host, t * p * d), headroom=headroom):
                    rate = d * m * b / candidate.step_time_s
                    key = (candidate.schedule, b)
                    if key not in best or rate > best[key][0] * (1 + 1e-9):
                        best[key] = (rate, candidate)
    if not best:
        return None
    rate, plan = max(best.values(), key=lambda x: x[0])
    if plan.pp > 1 or micro_batches == AUTO:
        plan = replace(plan, notes=plan.notes + _auto_notes(best, plan, candidates, schedule=schedule,
                                                            cut=micro_batches == AUTO))
    if link.measured:
        plan = replace(plan, notes=plan.notes + (link.describe(),))
    return plan


def _auto_notes(best: dict, plan: Plan, candidates: list[str], *, schedule: str, cut: bool) -> tuple[str, ...]:
    """Why auto chose what it chose: the best estimated step of each schedule, and of each micro-batch cut."""
    notes = []
    if schedule == AUTO and plan.pp > 1:
        steps = {}
        for (sched, _), (_, found) in best.items():
            steps[sched] = min(steps.get(sched, math.inf), found.step_time_s)
        per = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in steps.items())
        untried = [c for c in candidates if c not in steps]
        why = f" ({', '.join(untried)}: nothing fits or too few micro-batches)" if untried else ""
        notes.append(f"schedule auto chose {plan.schedule}: estimated step {per}{why}")
    if cut:
        cuts = {}
        for (_, b), (_, found) in best.items():
            cuts[(b, found.micro_batches)] = min(cuts.get((b, found.micro_batches), math.inf), found.step_time_s)
        per = ", ".join(f"{b} × {m} {v * 1e3:.1f} ms" for (b, m), v in sorted(cuts.items()))
        notes.append(f"micro-batches auto cut {plan.spec.micro_batch_size * plan.micro_batches} rows per replica as "
                     f"{plan.spec.micro_batch_size} × {plan.micro_batches}: estimated step {per}")
    return tuple(notes)


def _runnable(candidates: list[str], schedule: str, *, m: int, p: int) -> list[str]:
    """The candidates to try for `m` micro-batches over `p` stages. Under auto with fewer micro-batches than
    any candidate needs, GPipe (any count: with one, sequential model parallelism, the least memory a
    pipeline can hold) rather than no plan at all."""
    if p == 1:
        return candidates[:1]
    if schedule == AUTO and all(m < min_micro_batches(c, p) for c in candidates):
        return ["GPipe"]
    return candidates


def _schedule_candidates(schedule: str) -> list[str]:
    """The schedules to search: one, or under "auto" the candidates (1F1B first). Every torch hfsplit runs on
    has them; asking torch would import torch.distributed.pipelining, seconds of a plan on a laptop."""
    return [schedule] if schedule != AUTO else list(AUTO_CANDIDATES)


def _shapes(config, budgets: dict[str, int], spec: TrainingSpec, *, tp, pp, dp,
            world_size) -> Iterable[tuple[int, int, int]]:
    """(tp, pp, dp) degrees to search: the forced ones, else every one the devices allow."""
    n = len(budgets)
    for t in [tp] if tp else tp_degrees_for(config, spec, n):
        for p in [pp] if pp else range(1, n // t + 1):
            for d in [dp] if dp else [(world_size or n) // (t * p)]:
                if d >= 1 and t * p * d <= n and not (world_size and t * p * d != world_size):
                    yield t, p, d


def plans_for_shape(variants: "Variants", budgets: dict[str, int], speeds: dict, *, t: int, p: int, d: int, m: int,
                    schedule: str, name: str, config, link: Link = DEFAULT_LINK,
                    host_budget: Optional[int] = None, headroom: float = 0.0) -> Iterable[Plan]:
    """Fitting plans of one (tp, pp, dp) shape, one per device order tried."""
    schedule = schedule if p > 1 else "1F1B"
    v = virtual_stages(schedule, p)
    for groups in _device_orders(budgets, t=t, count=p * d, speeds=speeds):
        slots = _slots(groups, budgets, speeds, p=p, d=d, v=v, m=m, schedule=schedule, link=link,
                       host_budget=host_budget, headroom=headroom)
        found = split_with_choices(variants, slots)
        if found is None:
            continue
        yield _plan(variants, slots, found[0], levels=found[1], choices=variants.choices, name=name, config=config,
                    t=t, p=p, d=d, v=v, m=m, schedule=schedule)


class Variants:
    """The model's costs at one TP degree and micro-batch under each of `choices`, computed when first asked
    for (most ranks fit at the first), from a cache the whole search shares."""

    def __init__(self, config, spec: TrainingSpec, tp: int, choices: Sequence[Choice], cache: dict):
        self.config, self.spec, self.tp, self.choices, self._cache = config, spec, tp, list(choices), cache

    def __len__(self) -> int:
        return len(self.choices)

    def __getitem__(self, index: int) -> ModelCosts:
        key = (self.spec, self.tp, self.choices[index])
        if key not in self._cache:
            self._cache[key] = model_costs(self.config, self.choices[index].spec(self.spec), tp=self.tp)
        return self._cache[key]


def split_layers(costs: ModelCosts, slots: Sequence[Slot]) -> Optional[list[int]]:
    """Layer counts per slot minimising the slowest pipeline rank within memory caps; None if none fits."""
    found = split_with_choices([costs], slots)
    return None if found is None else found[0]


def split_with_choices(variants: Sequence[ModelCosts], slots: Sequence[Slot]) -> Optional[tuple[list[int], list[int]]]:
    """(layer counts per slot, the variant each slot runs) minimising the slowest pipeline rank within memory caps.

    `variants` are the model's costs under each memory choice a rank may make, fastest first
    (`memory_choices.ladder`); every rank runs the first variant under which its layers fit, and a layer goes to
    the slot whose time grows least with it at the variant it would need. A slot's time at the fastest variant that
    fits never falls as it takes layers (each variant's memory and time grow with them), so the greedy keeps its
    min-max optimum. None when no assignment fits."""
    L = variants[0].num_layers
    if len(slots) > L:
        return None
    by_rank: dict[int, list[Slot]] = {}
    for slot in slots:
        by_rank.setdefault(slot.pp_rank, []).append(slot)
    counts = [1] * len(slots)
    levels = {rank: _level(variants, mine, counts, 0) for rank, mine in by_rank.items()}
    if any(level is None for level in levels.values()):
        return None
    heap: list[tuple[float, int]] = []
    for s in slots:
        _push_next(heap, variants, slots, by_rank, counts, levels, s.index)
    for _ in range(L - len(slots)):
        while heap:
            _, k = heapq.heappop(heap)
            counts[k] += 1
            # layers of several kinds: a layer more here shifts which layers every later stage holds
            ranks = list(by_rank) if variants[0].layer_blocks else [slots[k].pp_rank]
            now = {r: _level(variants, by_rank[r], counts, levels[r]) for r in ranks}
            if all(level is not None for level in now.values()):
                levels.update(now)
                _push_next(heap, variants, slots, by_rank, counts, levels, k)
                break
            counts[k] -= 1  # full: this slot takes no more layers
        else:
            return None
    return counts, [levels[s.pp_rank] for s in slots]


def _push_next(heap, variants, slots, by_rank, counts, levels, k: int) -> None:
    """Queue slot `k` with its time after one more layer, at the first variant (from its rank's) that holds it."""
    slot = slots[k]
    counts[k] += 1
    level = _level(variants, by_rank[slot.pp_rank], counts, levels[slot.pp_rank])
    counts[k] -= 1
    if level is not None:
        heapq.heappush(heap, (_slot_time(variants[level], slot, stage_layers(variants[level], counts, k, 1)), k))


def _level(variants: Sequence[ModelCosts], mine: Sequence[Slot], counts: Sequence[int], start: int) -> Optional[int]:
    """The first variant from `start` under which one rank's slots fit with `counts` (a variant that did not fit
    never fits with more layers, so the search goes on from the rank's last one), or None."""
    return next((v for v in range(start, len(variants)) if _fits(variants[v], mine, counts)), None)


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of the schedule: `(p-1)/(v·m+p-1)`; zero-bubble schedules fill most of it."""
    if p == 1:
        return 0.0
    if TABLE[schedule].zero_bubble:
        # Splitting backward into input and weight gradients fills about two thirds
        # of the warm-up/cool-down idle time (Qi et al., 2024).
        return (p - 1) / 3 / (v * m + (p - 1) / 3)
    return (p - 1) / (v * m + p - 1)


def in_flight(schedule: str, *, p: int, m: int, v: int, pp_rank: int, index: int = 0) -> int:
    """Micro-batches whose activations stage `index` (on rank `pp_rank`) holds at its peak."""
    if p == 1:
        return 1
    if schedule == "GPipe":
        return m
    if schedule == "ZBVZeroBubble":
        # torch's ZB-V: rank r runs 2p-r-1 forwards of its first-leg chunk before that chunk's first backward,
        # and r+1 of its second-leg chunk, which are all alive then (measured: tests/parallel/test_apply.py).
        ahead = 2 * p - pp_rank - 1 if index < p else pp_rank + 1
        return min(ahead, m)
    if schedule == "Interleaved1F1B":
        return interleaved_in_flight(p=p, m=m, v=v, pp_rank=pp_rank, chunk=index // p)
    if schedule == "DualPipeV":
        # Both directions' micro-batches are in flight at once: DualPipe keeps about p + 1 chunks per rank.
        return min(p + 1, m)
    if not TABLE[schedule].plannable:
        # LoopedBFS runs every micro-batch's forward on a stage before any backward; InterleavedZeroBubble's
        # order is not modelled: every micro-batch, the upper bound
        return m
    return min(p - pp_rank, m)


def interleaved_in_flight(*, p: int, m: int, v: int, pp_rank: int, chunk: int) -> int:
    """The most micro-batches local chunk `chunk` of rank `pp_rank` holds at once under torch's Interleaved1F1B,
    replaying its order (`_get_1f1b_rank_ops`): forwards go round the chunks a round of micro-batches at a time,
    backwards round them the other way, one of each per step after the warm-up. The first chunk keeps taking
    forwards while the last one's backwards run, so it holds more than the warm-up alone (measured: the offload's
    host bytes on rank 0 of pp=2 × 4 micro-batches, 4 micro-batches in flight where the warm-up counts 3)."""
    per_round = m // max(1, m // p)
    warmup = min((v - 1) * per_round + 2 * (p - 1 - pp_rank), m * v)
    alive = peak = 0
    for op in range(m * v):
        if (op // per_round) % v == chunk:
            alive += 1
            peak = max(peak, alive)
        if op >= warmup and v - 1 - ((op - warmup) // per_round) % v == chunk:
            alive -= 1
    return max(peak, 1)


def stage_memory(costs: ModelCosts, slot: Slot, layers: Union[int, range]) -> StageMemory:
    """Estimated peak bytes of one rank of `slot` holding `layers` blocks (a count, or the range of layer indices
    where the layers are of several kinds: `costs.layer_blocks`), reserve excluded from sharing."""
    parts = _parts(costs, slot, layers)
    weights = sum(c.param_bytes * k for c, k in parts)
    grads = sum(c.grad_bytes * k for c, k in parts)
    optim = sum(c.optimizer_bytes * k for c, k in parts) + max((c.optimizer_shared_bytes for c, _ in parts), default=0)
    # the stage's position ids and attention masks (costs.stage_inputs) are the stage's, beside every part it runs
    workspace = stage_transient(_offload_workspace(costs, slot, layers), slot, layers) + \
        costs.stage_inputs.workspace_bytes
    kept = _kept_input(costs, slot, layers)  # offload: the first block's input of a later stage stays (see there)
    acts = held_micro_batches(costs, slot) * (sum(c.activation_bytes * k for c, k in parts) + kept +
                                              costs.stage_inputs.activation_bytes) + workspace
    host = slot.in_flight * (sum(c.offload_bytes * k for c, k in parts) - kept)
    # the objective's reference: what it keeps through the step, and its own pass's peak where the training pass's is lower
    ref_kept, ref_peak = reference_bytes(costs, has_embed=slot.has_embed, has_head=slot.has_head,
                                         micro_batches=slot.micro_batches, relay=slot.relay)
    # the objective's generation (a phase before the update): its peak where the training pass's is lower
    ref_peak = max(ref_peak, rollout_bytes(costs, _count(layers), has_head=slot.has_head,
                                           micro_batches=slot.micro_batches))
    workspace += max(0, ref_peak - acts)
    acts = ref_kept + _buffers(costs, slot) + max(acts, ref_peak)
    return StageMemory(weights=int(weights), gradients=int(grads), optimizer=int(optim), activations=int(acts),
                       reserve=_reserve(costs.spec, slot.devices), workspace=int(workspace), offload=int(host))


def _reserve(spec: TrainingSpec, devices) -> int:
    """The spec's reserve on a GPU; none on a stage of the CPU alone (a single process's "cpu" device)."""
    return 0 if all(d == "cpu" for group in devices for d in group) else spec.reserve_bytes


def held_micro_batches(costs: ModelCosts, slot: Slot) -> int:
    """The micro-batches whose kept bytes a stage holds at once: those its schedule has in flight; for inference,
    every one: generation keeps each micro-batch's KV cache on every stage until the whole rollout batch (micro-batches
    × micro-batch size sequences of `seq_len` tokens, prompt and new tokens) is done (`hfsplit.parallel.generation`)."""
    return slot.micro_batches if costs.spec.method == "inference" else slot.in_flight


def _buffers(costs: ModelCosts, slot: Slot) -> int:
    """The training schedule's receive buffers and kept outputs (`hfsplit.planning.buffers`): held through the
    step, the reference pass's too."""
    if slot.has_embed and slot.has_head:  # one stage, no pipeline
        return 0
    return pipeline_buffer_bytes(costs.boundary_bytes, has_embed=slot.has_embed, has_head=slot.has_head,
                                 in_flight=slot.in_flight, micro_batches=slot.micro_batches,
                                 training=costs.spec.method != "inference", output_sent=slot.output_sent,
                                 gradient_sent=slot.gradient_sent, sends_held=slot.sends_held)


def _offload_workspace(costs: ModelCosts, slot: Slot, layers: Union[int, range]) -> ModelCosts:
    """`costs` with the blocks' recompute workspace as this stage's offload has it: a block's workspace counts its
    input brought back and the one before it fetched ahead (2 hidden states), but a stage that offloads one block
    has no second input in flight, and one that keeps its only block's input nothing to bring back."""
    if costs.spec.checkpointing != "offload" or not costs.block.offload_bytes:
        return costs
    count = layers if isinstance(layers, int) else len(layers)
    unused = 2 - min(count - (1 if _kept_input(costs, slot, layers) else 0), 2)
    if not unused:
        return costs
    less = lambda part: replace(part, workspace_bytes=part.workspace_bytes - unused * costs.boundary_bytes)  # noqa: E731
    return replace(costs, block=less(costs.block), layer_blocks=tuple(less(b) for b in costs.layer_blocks))


def _kept_input(costs: ModelCosts, slot: Slot, layers: Union[int, range]) -> int:
    """Bytes per micro-batch the offload leaves on the device: a stage after the first keeps its first block's
    input, which the pipeline holds for that stage's backward anyway, so copying it out would save nothing."""
    offloads = costs.spec.checkpointing == "offload" and costs.block.offload_bytes
    return costs.boundary_bytes if offloads and not slot.has_embed and layers else 0


def stage_layers(costs: ModelCosts, counts: Sequence[int], index: int, more: int = 0) -> Union[int, range]:
    """What stage `index` holds under `counts` (+ `more` layers): a count where every block costs the same,
    else the range of its layer indices (stages hold consecutive layers in stage order)."""
    if not costs.layer_blocks:
        return counts[index] + more
    start = sum(counts[:index])
    return range(start, min(start + counts[index] + more, costs.num_layers))


def stage_transient(costs: ModelCosts, slot: Slot, layers: Union[int, range]) -> int:
    """Peak bytes beyond the kept activations of the micro-batches in flight, while one part of the stage runs.

    A part's workspace never meets the activations of the parts behind it on the stage for the same micro-batch:
    in forward they do not exist yet, in backward they ran first and freed theirs. So a checkpointed block's
    recompute (its whole activations) comes after the head's logits are gone (measured: tests/parallel/test_apply.py,
    full tp=2 with checkpointing, which counting both at once overestimated by 19%)."""
    order = [(costs.embed, 1)] if slot.has_embed else []
    order += runs_of(costs.layer_blocks, layers, costs.block) if layers else []
    order += [(costs.head, 1)] if slot.has_head else []
    if slot.actions > 2:  # zero bubble: what a part's input gradient leaves stays until its deferred weight gradient
        deferred = sum(part.deferred_bytes * count for part, count in order)  # the stage's input pass runs whole
        return max((part.workspace_bytes for part, _ in order), default=0) + deferred
    transient = behind = 0
    for part, count in reversed(order):
        transient = max(transient, part.workspace_bytes - behind)  # the last of `count` blocks has least behind it
        behind += part.activation_bytes * count
    return transient


def _parts(costs: ModelCosts, slot: Slot, layers: Union[int, range]) -> list[tuple[PartCost, int]]:
    parts = runs_of(costs.layer_blocks, layers, costs.block)
    if slot.has_embed:
        parts.append((costs.embed, 1))
    if slot.has_head:
        parts.append((costs.head, 1))
    if costs.tied and slot.has_embed and slot.has_head:
        # One stage holding both ends keeps the tied matrix once.
        shared = costs.embed
        parts.append((PartCost(-shared.param_bytes, -shared.grad_bytes, -shared.optimizer_bytes, 0, 0, 0.0), 1))
    return parts


def _slot_time(costs: ModelCosts, slot: Slot, layers: Union[int, range]) -> float:
    parts = _parts(costs, slot, layers)
    flops = sum(c.flops * k for c, k in parts)
    compute = flops / (DEVICE_FLOPS * slot.speed) * _split_factor(costs, slot)
    seconds = compute + _comm_time(costs, slot, parts) + _offload_time(costs, slot, layers, parts, compute=compute)
    if per_step(costs.spec) and not slot.relay:  # the reference's forward of the micro-batch, in the schedule
        seconds += reference_forward_s(costs, slot, layers)
    return seconds


def reference_forward_s(costs: ModelCosts, slot: Slot, layers: Union[int, range]) -> float:
    """Seconds of one no-grad forward of a micro-batch through `slot`'s stage (the reference's): the forward share
    of its training compute, and its sends one way."""
    parts = _parts(costs, slot, layers)
    compute = sum(c.flops * k for c, k in parts) / (DEVICE_FLOPS * slot.speed) * forward_fraction(costs)
    return compute + (slot.sends * slot.link.send_s(costs.boundary_bytes) if costs.boundary_bytes else 0.0)


def _offload_time(costs: ModelCosts, slot: Slot, layers, parts, *, compute: float) -> float:
    """Seconds per micro-batch the host copies of offloaded block inputs add: each goes out in forward and comes
    back before its recompute, over the host link, beside `compute` seconds of the stage's work."""
    held = sum(c.offload_bytes * k for c, k in parts) - _kept_input(costs, slot, layers)
    copies = 2 * sum(k for c, k in parts if c.offload_bytes) - (2 if _kept_input(costs, slot, layers) else 0)
    return slot.link.host_copy_s(2 * held, copies, compute_s=compute) if held > 0 else 0.0


def _split_factor(costs: ModelCosts, slot: Slot) -> float:
    """Zero-bubble slots (3 actions) run the backward as two autograd passes: their measured extra compute."""
    return slot.link.split_backward if slot.actions == 3 and costs.spec.method != "inference" else 1.0


def _comm_time(costs: ModelCosts, slot: Slot, parts: list[tuple[PartCost, int]]) -> float:
    """Seconds per micro-batch beyond the FLOPs: its TP all-reduces, the hidden states it sends to and receives
    from each pipeline neighbour on another rank (forward, and the gradient back when training), and the fixed
    cost of each schedule action (ZBV and Interleaved run more, smaller actions)."""
    comm = sum(c.comm_bytes * k for c, k in parts)
    size = costs.boundary_bytes
    count = round(comm / size) if size else 1  # all-reduces are of hidden states: latency per message
    tp_time = slot.link.all_reduce_s(comm / max(count, 1), costs.tp, count) if comm else 0.0
    inference = costs.spec.method == "inference"
    sends = slot.sends * (1 if inference else 2) * slot.link.send_s(size) if size else 0.0
    return tp_time + sends + (1 if inference else slot.actions) * slot.link.action_s


def _rank_fits(costs: ModelCosts, slots: Sequence[Slot], counts: Sequence[int], pp_rank: int) -> bool:
    return _fits(costs, [s for s in slots if s.pp_rank == pp_rank], counts)


def _fits(costs: ModelCosts, mine: Sequence[Slot], counts: Sequence[int]) -> bool:
    """Whether the slots of one pipeline rank fit its budget together (one reserve per device), and what their
    activation offload holds fits the rank's share of host memory."""
    memories = [stage_memory(costs, s, stage_layers(costs, counts, s.index)) for s in mine]
    host = mine[0].host_budget
    cap = mine[0].budget if mine[0].cap is None else mine[0].cap
    return rank_total(memories) <= cap and (host is None or sum(m.offload for m in memories) <= host)


def _rank_times(costs: ModelCosts, slots: Sequence[Slot], counts: Sequence[int]) -> dict[int, float]:
    times: dict[int, float] = {}
    for s in slots:
        times[s.pp_rank] = times.get(s.pp_rank, 0.0) + _slot_time(costs, s, stage_layers(costs, counts, s.index))
    return times


def _plan(costs: Union[ModelCosts, Sequence[ModelCosts]], slots: Sequence[Slot], counts: Sequence[int], *, name: str,
          config, t: int, p: int, d: int, v: int, m: int, schedule: str, levels: Optional[Sequence[int]] = None,
          choices: Sequence[Choice] = ()) -> Plan:
    """The Plan of `counts` layers per slot, each slot running `variants[levels[i]]` (the costs of `choices[...]`)."""
    variants = [costs] if isinstance(costs, ModelCosts) else list(costs)
    levels = list(levels or [0] * len(slots))
    choices = list(choices) or [Choice(variants[0].spec.checkpointing, variants[0].spec.optim,
                                       variants[0].spec.tiled_mlp)]
    stages, start, times = [], 0, {}
    for slot, count, level in zip(slots, counts, levels):
        mine = variants[level]
        held = stage_layers(mine, counts, slot.index)
        stages.append(Stage(
            index=slot.index, pp_rank=slot.pp_rank, devices=slot.devices, layers=(start, start + count),
            has_embed=slot.has_embed, has_head=slot.has_head, memory=stage_memory(mine, slot, held),
            budget=slot.budget, time_s=_slot_time(mine, slot, held), checkpointing=choices[level].checkpointing,
            optim=choices[level].optim, tiled_mlp=choices[level].tiled_mlp,
        ))
        times[slot.pp_rank] = times.get(slot.pp_rank, 0.0) + stages[-1].time_s
        start += count
    bubble = bubble_fraction(schedule, p, m, v)
    spec = plan_spec(variants[0].spec, [choices[level] for level in levels])
    reference = _reference_s(variants, slots, counts, levels, m=m, bubble=bubble)
    rollout = _rollout_s(variants, slots, counts, levels, m=m, bubble=bubble)
    step = max(times.values()) * m / (1 - bubble) + (reference if per_step(spec) and v > 1 else 0.0) + rollout
    return Plan(
        model=name, model_type=config.model_type, num_layers=variants[0].num_layers, tp=t, pp=p, dp=d,
        virtual_stages=v, schedule=schedule, micro_batches=m, spec=spec, stages=tuple(stages),
        step_time_s=step, bubble_fraction=bubble, tied_embeddings=variants[0].tied,
        fused_experts=bool(expert_parameters(config)), reference_s=reference, rollout_s=rollout,
    )


def _reference_s(variants, slots: Sequence[Slot], counts: Sequence[int], levels: Sequence[int], *, m: int,
                 bubble: float) -> float:
    """Seconds of the reference pass over one step's rows (0 without one): a forward-only pipeline of the `m`
    micro-batches where each rank runs one stage, else a relay of all rows through the stages in turn."""
    if not variants[0].spec.reference_pass:
        return 0.0
    ranks: dict[int, float] = {}
    for slot, level in zip(slots, levels):
        costs = variants[level]
        seconds = reference_forward_s(costs, slot, stage_layers(costs, counts, slot.index))
        ranks[slot.pp_rank] = ranks.get(slot.pp_rank, 0.0) + seconds
    if slots[0].relay:
        return m * sum(ranks.values())
    return max(ranks.values()) * m / (1 - bubble)


def _rollout_s(variants, slots: Sequence[Slot], counts: Sequence[int], levels: Sequence[int], *, m: int,
               bubble: float) -> float:
    """Seconds of the step's generation (0 where the objective generates none, `hfsplit.planning.rollout`): its
    prefill a forward-only pipeline of the `m` micro-batches, each decode step the rows' hidden states through every
    link once."""
    spec = variants[0].spec
    if not spec.counts.generation:
        return 0.0
    ranks: dict[int, float] = {}
    for slot, level in zip(slots, levels):
        seconds = reference_forward_s(variants[level], slot, stage_layers(variants[level], counts, slot.index))
        ranks[slot.pp_rank] = ranks.get(slot.pp_rank, 0.0) + seconds
    prefill = max(ranks.values()) * m / (1 - bubble)
    per_token = variants[0].boundary_bytes * m / spec.seq_len  # every row's hidden state of one position
    messages = sum(slot.sends for slot in slots) / 2 * slots[0].link.send_s(per_token)
    return rollout_seconds(prefill, spec=spec, step_message_s=messages)


def _count(layers: Union[int, range]) -> int:
    return layers if isinstance(layers, int) else len(layers)


def _slots(groups: Sequence[tuple[str, ...]], budgets: dict[str, int], speeds: dict, *, p: int, d: int, v: int,
           m: int, schedule: str, link: Link = DEFAULT_LINK, host_budget: Optional[int] = None,
           headroom: float = 0.0) -> list[Slot]:
    """Stage positions: replica r of pipeline rank k runs on device group `groups[r * p + k]`."""
    count = p * v
    slots, ranks = [], [pp_rank_of_stage(schedule, pp=p, index=i) for i in range(count)]
    for index, rank in enumerate(ranks):
        devices = tuple(groups[r * p + rank] for r in range(d))
        flat = [dev for group in devices for dev in group]
        slots.append(Slot(
            index=index, pp_rank=rank, devices=devices, budget=min(budgets[x] for x in flat),
            speed=min(_speed(speeds, x, budgets) for x in flat),
            in_flight=in_flight(schedule, p=p, m=m, v=v, pp_rank=rank, index=index),
            has_embed=index == 0, has_head=index == count - 1, link=link,
            sends=sum(0 <= j < count and ranks[j] != rank for j in (index - 1, index + 1)),
            actions=3 if TABLE[schedule].zero_bubble and p > 1 else 2, host_budget=host_budget,
            cap=int(min(budgets[x] for x in flat) * (1 - headroom)) if headroom else None,
            micro_batches=m, relay=v > 1, output_sent=index + 1 < count and ranks[index + 1] != rank,
            gradient_sent=index > 0 and ranks[index - 1] != rank, sends_held=v > 1,
        ))
    return slots


def _device_orders(budgets: dict[str, int], *, t: int, count: int,
                   speeds: Optional[dict] = None) -> Iterable[list[tuple[str, ...]]]:
    """Ways to cut the devices into `count` TP groups of `t`, ordered as pipeline positions.

    Groups are formed from devices sorted by budget so a group's cap (its smallest
    budget) wastes least; their order along the pipeline is then searched: exhaustively
    for a few groups, otherwise the given order and both budget orders. Orders alike in every group's
    budgets and speeds plan alike, so only the first is yielded (uniform devices: one order, not count!).
    """
    devices = list(budgets)[: t * count]
    by_size = sorted(budgets, key=lambda x: -budgets[x])[: t * count]
    seen = set()
    for base in (devices, by_size):
        groups = [tuple(base[i * t:(i + 1) * t]) for i in range(count)]
        orders: Iterable = (
            itertools.permutations(groups) if count <= MAX_PERMUTED_GROUPS else (groups, groups[::-1])
        )
        for order in orders:
            key = tuple(tuple((budgets[x], _speed(speeds or {}, x, budgets)) for x in g) for g in order)
            if key not in seen:
                seen.add(key)
                yield list(order)


def _cuts(micro_batches, global_batch, spec: TrainingSpec, p: int, d: int) -> list[tuple[int, int]]:
    """(micro-batch size, micro-batches) pairs to search: the spec's size and its count, or under "auto"
    every size up to the spec's that divides the replica's rows (so the rows per step stay the given ones)."""
    if micro_batches != AUTO:
        return [(spec.micro_batch_size, _micro_batches(micro_batches, global_batch, spec, p, d))]
    rows = max(1, global_batch // d)
    return [(b, rows // b) for b in range(1, min(spec.micro_batch_size, rows) + 1) if rows % b == 0]


def _count(micro_batches) -> Optional[int]:
    """A forced micro-batch count, or None ("auto" forces none)."""
    return None if micro_batches == AUTO else micro_batches


def _micro_batches(micro_batches, global_batch, spec: TrainingSpec, p: int, d: int) -> int:
    if global_batch:
        per_replica = global_batch // d
        return max(1, per_replica // spec.micro_batch_size)
    return micro_batches or max(1, 4 * p)


def _check_options(schedule: str, micro_batches, global_batch, spec: TrainingSpec, activation_checkpointing,
                   world_size: Optional[int], *, tp, pp, dp) -> None:
    _check_world(world_size, tp=tp, pp=pp, dp=dp)
    if activation_checkpointing != AUTO_CHOICE:
        _check_zero_bubble_checkpointing(schedule, checkpointing_mode(activation_checkpointing))
    if schedule != AUTO and schedule not in TABLE:
        raise PlanError(f"schedule {schedule!r} is unknown; choose auto or one of {', '.join(TABLE)}")
    if micro_batches == AUTO and not global_batch:
        raise PlanError('micro_batches="auto" cuts a given global batch into micro-batches; pass global_batch '
                        "(--global-batch N) or a micro-batch count")
    if micro_batches is not None and micro_batches != AUTO and micro_batches < 1:
        raise PlanError(f"micro_batches={micro_batches}: needs at least 1")
    if global_batch is not None and global_batch < spec.micro_batch_size and micro_batches != AUTO:
        raise PlanError(f"global_batch={global_batch} is smaller than micro_batch_size={spec.micro_batch_size}")
    if spec.seq_len < 1 or spec.micro_batch_size < 1:
        raise PlanError("seq_len and micro_batch_size must be at least 1")


def _recompute_kept(schedule: str, choice: Choice) -> bool:
    """Zero-bubble schedules defer each weight gradient past its input gradient, and the activations the
    input gradient recomputed stay alive until then: checkpointing saves almost nothing there (measured
    3.6× the checkpointed figure, tests/parallel/test_apply.py), so the planner never pairs the two."""
    return choice.checkpointing != "off" and TABLE[schedule].zero_bubble


def _check_zero_bubble_checkpointing(schedule: str, mode: str) -> None:
    if mode != "off" and schedule in TABLE and TABLE[schedule].zero_bubble:
        raise PlanError(f"schedule {schedule} keeps the recomputed activations until each deferred weight "
                        "gradient, so activation checkpointing saves nothing there; use --schedule auto / "
                        "1F1B / Interleaved1F1B with checkpointing, or --activation-checkpointing off")


def _check_budget_count(world_size: Optional[int], budgets: dict[str, int]) -> None:
    if world_size is not None and world_size > len(budgets):
        each = format_bytes(min(budgets.values())).replace(" ", "")
        raise PlanError(f"{world_size} processes were launched but max_memory names {len(budgets)} device(s); give "
                        f'one budget per process (e.g. "{world_size}x{each}") or launch {len(budgets)}')


def _check_world(world_size: Optional[int], *, tp, pp, dp) -> None:
    """A launch of `world_size` processes must hold the forced degrees exactly (or a multiple of them)."""
    if world_size is None:
        return
    forced = {name: value for name, value in (("tp", tp), ("pp", pp), ("dp", dp)) if value is not None}
    for name, value in forced.items():
        if value < 1:
            raise PlanError(f"{name}={value}: a parallel degree must be at least 1; pass --{name} 1 or more")
    needed = math.prod(forced.values())
    if world_size % needed == 0 and (len(forced) < 3 or needed == world_size):
        return
    degrees = " × ".join(f"{name}={value}" for name, value in forced.items())
    launched = f"{world_size} process{'' if world_size == 1 else 'es'} {'was' if world_size == 1 else 'were'} launched"
    wanted = f"{needed}" if len(forced) == 3 or world_size < needed else f"a multiple of {needed}"
    raise PlanError(f"{degrees} needs {wanted} processes but {launched}; launch {needed} "
                    f"(torchrun --nproc_per_node {needed}) or change {', '.join('--' + n for n in forced)}")


def _check_degrees(config, devices: int, *, tp, pp, dp, micro_batches=None, schedule=AUTO) -> None:
    if tp is not None and (why := tp_degree_error(config, tp)):
        raise PlanError(why)
    needed = (tp or 1) * (pp or 1) * (dp or 1)
    if needed > devices:
        raise PlanError(f"tp={tp or 1} × pp={pp or 1} × dp={dp or 1} needs {needed} devices but the budget names "
                        f"{devices}; add devices to max_memory or lower the degrees")
    need = 1 if schedule == AUTO else min_micro_batches(schedule, pp) if pp else 1
    if pp is not None and pp > 1 and micro_batches is not None and micro_batches < need:
        raise PlanError(f"micro_batches={micro_batches} < {need} with pp={pp}: schedule {schedule} needs at least one "
                        f"micro-batch per stage; raise --micro-batches to at least {need} or use --schedule GPipe")
    if pp is not None and pp > config.num_hidden_layers:
        raise PlanError(f"pp={pp} is more pipeline stages than the model's {config.num_hidden_layers} layers")


def _speed(speeds: dict, device: str, budgets: dict[str, int]) -> float:
    given = speeds.get(device, speeds.get(int(device) if device.isdigit() else device))
    if given is not None:
        return float(given)
    # A CPU beside GPUs is far slower; alone it is simply "the device".
    return CPU_SPEED if device == "cpu" and len(budgets) > 1 else 1.0


# ---------------------------------------------------------------- explaining a failure


def _explain_no_fit(config, budgets: dict[str, int], spec: TrainingSpec, *, name: str, options: dict) -> str:
    closest = _closest_plan(config, budgets, spec, options)
    lines = [f"{name}: no split fits the budget ({len(budgets)} device(s): "
             + ", ".join(f"{k}={format_bytes(v)}" for k, v in budgets.items())
             + f") for {spec.method} at seq_len {spec.seq_len} × micro-batch {spec.micro_batch_size}."]
    if closest is not None:
        lines.append(f"closest split: pp={closest.pp} × tp={closest.tp}:")
        for s in closest.stages:
            over = s.memory.total - s.budget
            lines.append(f"  stage {s.index} on {','.join(s.devices[0])}: layers {s.layers[0]}-{s.layers[1] - 1}, "
                         f"needs {format_bytes(s.memory.total)} of {format_bytes(s.budget)}"
                         + (f" ({format_bytes(over)} over)" if over > 0 else ""))
    fixes = _fixes_that_fit(config, budgets, spec, options)
    if fixes:
        lines.append("changes that fit: " + "; ".join(fixes))
    else:
        lines.append("no single change tried (LoRA, activation checkpointing, offload, 8-bit optimizer states, "
                     "shorter sequence, smaller micro-batch, more or larger GPUs) fits")
    return "\n".join(lines)


def _closest_plan(config, budgets, spec, options) -> Optional[Plan]:
    """The time-balanced split with the smallest worst overshoot, ignoring the caps."""
    unlimited = {k: 1 << 62 for k in budgets}
    best, best_over = None, math.inf
    for t in tp_degrees_for(config, spec, len(budgets)):
        if options["tp"] not in (None, t):  # a split this path can run (one process: tp=1)
            continue
        costs = model_costs(config, spec, tp=t)
        p = min(len(budgets) // t, costs.num_layers)
        m = _micro_batches(options["micro_batches"], options["global_batch"], spec, p, 1)
        schedule = options["schedule"] if p > 1 else "1F1B"
        v = virtual_stages(schedule, p)
        for groups in itertools.islice(_device_orders(budgets, t=t, count=p), 24):
            slots = _slots(groups, unlimited, options["device_speeds"], p=p, d=1, v=v, m=m, schedule=schedule,
                           link=options["link"])
            counts = split_layers(costs, slots)
            if counts is None:
                continue
            slots = [replace(s, budget=min(budgets[x] for g in s.devices for x in g)) for s in slots]
            plan = _plan(costs, slots, counts, name="", config=config, t=t, p=p, d=1, v=v, m=m, schedule=schedule)
            over = max(s.memory.total / s.budget for s in plan.stages)
            if over < best_over:
                best, best_over = plan, over
    return best


def _fixes_that_fit(config, budgets: dict[str, int], spec: TrainingSpec, options: dict) -> list[str]:
    def fits(b, s) -> bool:
        # More devices means launching more processes: that fix is searched without the launch's world size.
        # Fewer micro-batches where the caller fixed no count: as make_plan would try them (`knobs.turn_knobs`).
        launch = {"world_size": None} if len(b) > len(budgets) else {}
        return could_fit(config, b, s) and any_count_fits(
            lambda extra: best_plan(config, b, s, name="", **{**options, **launch, **extra}) is not None, options,
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
    # A shorter sequence only shrinks activations: the longest that fits, by binary search on the planner
    seq = longest_fitting(lambda n: fits(budgets, replace(spec, seq_len=n)), low=128, high=spec.seq_len - 1,
                          multiple=128)
    if seq is not None:
        fixes.append(f"a shorter sequence (--seq-len {seq}, the longest that fits, to 128 tokens)")
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


def tp_degrees_for(config, spec: TrainingSpec, devices: int) -> list[int]:
    """TP degrees the planner tries: QLoRA keeps tp=1 (a bitsandbytes 4-bit weight is not shardable by DTensor)."""
    return [1] if spec.method == "qlora" else valid_tp_degrees(config, devices)


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
    """Smallest per-device budget (to 1/16 GiB) at which every device of `budgets` fits, up to 16× the largest."""
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
    return high
