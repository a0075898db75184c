"""The search over splits: TP degree, pipeline depth, device order, schedule and micro-batches, and the layer
count of each stage.

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
from dataclasses import replace
from typing import Iterable, Optional, Sequence, Union

from hfsplit.models.expert_lora import expert_lora_tp_error, expert_parameters
from hfsplit.models.families import valid_tp_degrees
from hfsplit.plan import Plan, Stage, TrainingSpec
from hfsplit.planning.costs.model import ModelCosts, model_costs
from hfsplit.planning.links import DEFAULT_LINK, Link
from hfsplit.planning.reference import per_step
from hfsplit.planning.rollout import rollout_micro_batches, rollout_seconds
from hfsplit.planning.memory_choices import Choice, host_share, plan_spec
from hfsplit.schedules import AUTO, AUTO_CANDIDATES, TABLE, min_micro_batches, pp_rank_of_stage, virtual_stages
from hfsplit.planning.stage_costs import (
    Slot, balanced_time, bubble_fraction, decode_step_s, device_speed, generation_forward_s, in_flight, prefill_s,
    recompute_kept, reference_forward_s, slot_time, slots_fit, stage_layers, stage_memory,
)


MAX_PERMUTED_GROUPS = 5  # device orders tried exhaustively up to this many stage groups


def best_plan(config, budgets: dict[str, int], spec: TrainingSpec, *, name: str, micro_batches, global_batch,
              schedule: str, device_speeds: dict, link: Link = DEFAULT_LINK, tp=None, pp=None, dp=None,
              world_size: Optional[int] = None, choices: Optional[Sequence[Choice]] = None,
              host: Optional[int] = None, headroom: float = 0.0,
              device_bandwidths: Optional[dict] = None) -> Optional[Plan]:
    """The fastest fitting plan (by tokens/s), or None. Under schedule "auto" each candidate schedule
    is searched and the plan's notes give the best step of each (and of each micro-batch cut, under
    micro_batches="auto"). Each rank runs the first of `choices` (default: the spec's own) that fits it; `host`
    is the host RAM the ranks' activation offload shares (None: no limit)."""
    candidates = _schedule_candidates(schedule)
    choices = list(choices or [Choice(spec.checkpointing, spec.optim, spec.tiled_mlp, spec.host_embedding)])
    best: dict[tuple[str, int], tuple[float, Plan]] = {}
    cache: dict = {}
    for t, p, d in _shapes(config, budgets, spec, tp=tp, pp=pp, dp=dp, world_size=world_size):
        for b, m in _cuts(micro_batches, global_batch, spec, p, d):
            cut = replace(spec, micro_batch_size=b)
            if p > config.num_hidden_layers:
                continue
            for sched in _runnable(candidates, schedule, m=m, p=p):
                # a TP-sharded embedding is a DTensor of the devices' mesh: its table stays on them
                usable = [c for c in choices if not (p > 1 and recompute_kept(sched, c))
                          and not (t > 1 and c.host_embedding)]
                if not usable or (p > 1 and m < min_micro_batches(sched, p)):
                    continue  # torch refuses fewer micro-batches; or checkpointing would save nothing here
                variants = Variants(config, cut, t, usable, cache)
                for candidate in plans_for_shape(variants, budgets, device_speeds, t=t, p=p, d=d, m=m, schedule=sched,
                                                 name=name, config=config, link=link,
                                                 host_budget=host_share(host, t * p * d), headroom=headroom,
                                                 bandwidths=device_bandwidths):
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
                    host_budget: Optional[int] = None, headroom: float = 0.0,
                    bandwidths: Optional[dict] = None) -> Iterable[Plan]:
    """Fitting plans of one (tp, pp, dp) shape, one per device order tried."""
    schedule = schedule if p > 1 else "1F1B"
    v = virtual_stages(schedule, p)
    for groups in device_orders(budgets, t=t, count=p * d, speeds=speeds):
        slots = stage_slots(groups, budgets, speeds, p=p, d=d, v=v, m=m, schedule=schedule, link=link,
                            host_budget=host_budget, headroom=headroom, bandwidths=bandwidths)
        tried = set()
        for balanced in balanced_times(variants.spec):
            found = split_with_choices(variants, slots, balanced)
            if found is None or tuple(found[0]) in tried:
                continue
            tried.add(tuple(found[0]))
            yield plan_of_split(variants, slots, found[0], levels=found[1], choices=variants.choices, name=name,
                                config=config, t=t, p=p, d=d, v=v, m=m, schedule=schedule)


def balanced_times(spec: TrainingSpec) -> tuple:
    """What the split may even out between ranks, each giving a candidate (the fastest step wins): a slot's
    training time; where the objective generates, also its generation alone and the two together. A step runs the
    rollout, then the update, each a pipeline as slow as its slowest rank, and the head weighs on every position
    in the update but on the new ones only in generation: no one split is best for both, so the search tries the
    three (measured: docs/benchmarks/generate.md)."""
    return (slot_time, generation_forward_s, balanced_time) if spec.counts.generation else (slot_time,)


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


def split_with_choices(variants: Sequence[ModelCosts], slots: Sequence[Slot],
                       balanced=slot_time) -> Optional[tuple[list[int], list[int]]]:
    """(layer counts per slot, the variant each slot runs) minimising the slowest pipeline rank within memory caps,
    its time `balanced(costs, slot, layers)` (the training time per micro-batch unless given).

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
        _push_next(heap, variants, slots, by_rank, counts, levels, s.index, balanced)
    for _ in range(L - len(slots)):
        while heap:
            _, k = heapq.heappop(heap)
            counts[k] += 1
            # layers of several kinds: a layer more here shifts which layers every later stage holds
            ranks = list(by_rank) if variants[0].layer_blocks else [slots[k].pp_rank]
            now = {r: _level(variants, by_rank[r], counts, levels[r]) for r in ranks}
            if all(level is not None for level in now.values()):
                levels.update(now)
                _push_next(heap, variants, slots, by_rank, counts, levels, k, balanced)
                break
            counts[k] -= 1  # full: this slot takes no more layers
        else:
            return None
    return counts, [levels[s.pp_rank] for s in slots]


def _push_next(heap, variants, slots, by_rank, counts, levels, k: int, balanced) -> None:
    """Queue slot `k` with its time after one more layer, at the first variant (from its rank's) that holds it."""
    slot = slots[k]
    counts[k] += 1
    level = _level(variants, by_rank[slot.pp_rank], counts, levels[slot.pp_rank])
    counts[k] -= 1
    if level is not None:
        heapq.heappush(heap, (balanced(variants[level], slot, stage_layers(variants[level], counts, k, 1)), k))


def _level(variants: Sequence[ModelCosts], mine: Sequence[Slot], counts: Sequence[int], start: int) -> Optional[int]:
    """The first variant from `start` under which one rank's slots fit with `counts` (a variant that did not fit
    never fits with more layers, so the search goes on from the rank's last one), or None."""
    return next((v for v in range(start, len(variants)) if slots_fit(variants[v], mine, counts)), None)


def plan_of_split(costs: Union[ModelCosts, Sequence[ModelCosts]], slots: Sequence[Slot], counts: Sequence[int], *, name: str,
          config, t: int, p: int, d: int, v: int, m: int, schedule: str, levels: Optional[Sequence[int]] = None,
          choices: Sequence[Choice] = ()) -> Plan:
    """The Plan of `counts` layers per slot, each slot running `variants[levels[i]]` (the costs of `choices[...]`)."""
    variants = [costs] if isinstance(costs, ModelCosts) else list(costs)
    levels = list(levels or [0] * len(slots))
    choices = list(choices) or [Choice(variants[0].spec.checkpointing, variants[0].spec.optim,
                                       variants[0].spec.tiled_mlp, variants[0].spec.host_embedding)]
    stages, start, times = [], 0, {}
    for slot, count, level in zip(slots, counts, levels):
        mine = variants[level]
        held = stage_layers(mine, counts, slot.index)
        stages.append(Stage(
            index=slot.index, pp_rank=slot.pp_rank, devices=slot.devices, layers=(start, start + count),
            has_embed=slot.has_embed, has_head=slot.has_head, memory=stage_memory(mine, slot, held),
            budget=slot.budget, time_s=slot_time(mine, slot, held), checkpointing=choices[level].checkpointing,
            optim=choices[level].optim, tiled_mlp=choices[level].tiled_mlp,
            host_embedding=choices[level].host_embedding and slot.has_embed and t == 1,
        ))
        times[slot.pp_rank] = times.get(slot.pp_rank, 0.0) + stages[-1].time_s
        start += count
    bubble = bubble_fraction(schedule, p, m, v)
    spec = replace(plan_spec(variants[0].spec, [choices[level] for level in levels]),
                   host_embedding=any(s.host_embedding for s in stages))
    reference = _reference_s(variants, slots, counts, levels, m=m, bubble=bubble)
    rollout = _rollout_s(variants, slots, counts, levels, m=m, p=p)
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
               p: int) -> float:
    """Seconds of the step's generation (0 where the objective generates none, `hfsplit.planning.rollout`): its
    slowest rank's prompts' pass and decode step, pipelined over the `m` micro-batches, each decode step the rows'
    hidden states through every link once."""
    spec = variants[0].spec
    if not spec.counts.generation:
        return 0.0
    share = m / rollout_micro_batches(spec, m, p)  # generation's micro-batch in the update's
    prefill: dict[int, float] = {}
    decode: dict[int, float] = {}
    for slot, level in zip(slots, levels):
        layers = stage_layers(variants[level], counts, slot.index)
        prefill[slot.pp_rank] = prefill.get(slot.pp_rank, 0.0) + prefill_s(variants[level], slot, layers)
        decode[slot.pp_rank] = decode.get(slot.pp_rank, 0.0) + decode_step_s(variants[level], slot, layers,
                                                                            share=share)
    per_token = variants[0].boundary_bytes * m / spec.seq_len  # every row's boundary (hidden state) of one position
    messages = sum(slot.sends for slot in slots) / 2 * slots[0].link.send_s(per_token)
    return rollout_seconds(prefill_s=max(prefill.values()), decode_step_s=max(decode.values()), spec=spec, m=m, p=p,
                           step_message_s=messages)


def stage_slots(groups: Sequence[tuple[str, ...]], budgets: dict[str, int], speeds: dict, *, p: int, d: int, v: int,
           m: int, schedule: str, link: Link = DEFAULT_LINK, host_budget: Optional[int] = None,
           headroom: float = 0.0, bandwidths: Optional[dict] = None) -> list[Slot]:
    """Stage positions: replica r of pipeline rank k runs on device group `groups[r * p + k]`; `bandwidths`: the
    memory bandwidth of the devices known by it (a budget of GPU kinds), which times generation's decode steps."""
    count = p * v
    slots, ranks = [], [pp_rank_of_stage(schedule, pp=p, index=i) for i in range(count)]
    for index, rank in enumerate(ranks):
        devices = tuple(groups[r * p + rank] for r in range(d))
        flat = [dev for group in devices for dev in group]
        slots.append(Slot(
            index=index, pp_rank=rank, devices=devices, budget=min(budgets[x] for x in flat),
            speed=min(device_speed(speeds, x, budgets) for x in flat),
            in_flight=in_flight(schedule, p=p, m=m, v=v, pp_rank=rank, index=index),
            has_embed=index == 0, has_head=index == count - 1, link=link,
            sends=sum(0 <= j < count and ranks[j] != rank for j in (index - 1, index + 1)),
            actions=3 if TABLE[schedule].zero_bubble and p > 1 else 2, host_budget=host_budget,
            cap=int(min(budgets[x] for x in flat) * (1 - headroom)) if headroom else None,
            micro_batches=m, relay=v > 1, output_sent=index + 1 < count and ranks[index + 1] != rank,
            gradient_sent=index > 0 and ranks[index - 1] != rank, sends_held=v > 1,
            memory_bandwidth=min((bandwidths or {}).get(x, 0.0) for x in flat),
        ))
    return slots


def device_orders(budgets: dict[str, int], *, t: int, count: int,
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
            key = tuple(tuple((budgets[x], device_speed(speeds or {}, x, budgets)) for x in g) for g in order)
            if key not in seen:
                seen.add(key)
                yield list(order)


def _cuts(micro_batches, global_batch, spec: TrainingSpec, p: int, d: int) -> list[tuple[int, int]]:
    """(micro-batch size, micro-batches) pairs to search: the spec's size and its count, or under "auto"
    every size up to the spec's that divides the replica's rows (so the rows per step stay the given ones)."""
    if micro_batches != AUTO:
        return [(spec.micro_batch_size, micro_batch_count(micro_batches, global_batch, spec, p, d))]
    rows = max(1, global_batch // d)
    return [(b, rows // b) for b in range(1, min(spec.micro_batch_size, rows) + 1) if rows % b == 0]


def forced_count(micro_batches) -> Optional[int]:
    """A forced micro-batch count, or None ("auto" forces none)."""
    return None if micro_batches == AUTO else micro_batches


def micro_batch_count(micro_batches, global_batch, spec: TrainingSpec, p: int, d: int) -> int:
    if global_batch:
        per_replica = global_batch // d
        return max(1, per_replica // spec.micro_batch_size)
    return micro_batches or max(1, 4 * p)


def tp_degrees_for(config, spec: TrainingSpec, devices: int) -> list[int]:
    """TP degrees the planner tries: QLoRA keeps tp=1 (a bitsandbytes 4-bit weight is not shardable by DTensor), and
    so does LoRA on fused expert parameters (`expert_lora_tp_error`)."""
    if spec.method == "qlora" or spec.method == "lora" and expert_lora_tp_error(config, spec.lora_targets, 2):
        return [1]
    return valid_tp_degrees(config, devices)
