"""What one stage position costs: the peak bytes and the step time of a rank holding so many blocks there.

A `Slot` is a stage position before layers are assigned (its devices, budget, speed, micro-batches in flight);
`stage_memory` and `rank_times` are what the split search (`hfsplit.planning.search`) asks of it, and the
schedule arithmetic (bubble, micro-batches in flight) the costs depend on.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

from hfsplit.models.layer_kinds import runs_of
from hfsplit.plan import StageMemory, TrainingSpec, rank_total
from hfsplit.planning.costs.model import ModelCosts, PartCost
from hfsplit.planning.buffers import pipeline_buffer_bytes
from hfsplit.planning.links import DEFAULT_LINK, Link
from hfsplit.planning.reference import forward_fraction, per_step, reference_bytes
from hfsplit.planning.rollout import rollout_bytes
from hfsplit.planning.memory_choices import Choice
from hfsplit.planning.timing import DEVICE_FLOPS
from hfsplit.schedules import TABLE


CPU_SPEED = 0.02


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
    memory_bandwidth: float = 0.0  # bytes/s its devices read memory at (0: unknown, decode steps timed by FLOPs)


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
    kept = kept_input(costs, slot, layers)  # offload: the first block's input of a later stage stays (see there)
    acts = held_micro_batches(costs, slot) * (sum(c.activation_bytes * k for c, k in parts) + kept +
                                              costs.stage_inputs.activation_bytes) + workspace
    host = slot.in_flight * (sum(c.offload_bytes * k for c, k in parts) - kept)
    # the objective's reference: what it keeps through the step, and its own pass's peak where the training pass's is lower
    ref_kept, ref_peak = reference_bytes(costs, has_embed=slot.has_embed, has_head=slot.has_head,
                                         micro_batches=slot.micro_batches, relay=slot.relay)
    # the objective's generation (a phase before the update): its peak where the training pass's is lower
    ref_peak = max(ref_peak, rollout_bytes(costs, layer_count(layers), has_head=slot.has_head,
                                           micro_batches=slot.micro_batches))
    workspace += max(0, ref_peak - acts)
    acts = ref_kept + _buffers(costs, slot) + max(acts, ref_peak)
    return StageMemory(weights=int(weights), gradients=int(grads), optimizer=int(optim), activations=int(acts),
                       reserve=_reserve(costs.spec, slot.devices), workspace=int(workspace), offload=int(host),
                       host_weights=sum(c.host_bytes * k for c, k in parts))


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
    unused = 2 - min(count - (1 if kept_input(costs, slot, layers) else 0), 2)
    if not unused:
        return costs
    less = lambda part: replace(part, workspace_bytes=part.workspace_bytes - unused * costs.boundary_bytes)  # noqa: E731
    return replace(costs, block=less(costs.block), layer_blocks=tuple(less(b) for b in costs.layer_blocks))


def kept_input(costs: ModelCosts, slot: Slot, layers: Union[int, range]) -> int:
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


def slot_time(costs: ModelCosts, slot: Slot, layers: Union[int, range]) -> float:
    parts = _parts(costs, slot, layers)
    flops = sum(c.flops * k for c, k in parts)
    compute = flops / (DEVICE_FLOPS * slot.speed) * _split_factor(costs, slot)
    seconds = compute + _comm_time(costs, slot, parts) + _offload_time(costs, slot, layers, parts, compute=compute) \
        + _host_embedding_time(costs, slot)
    if per_step(costs.spec) and not slot.relay:  # the reference's forward of the micro-batch, in the schedule
        seconds += reference_forward_s(costs, slot, layers)
    return seconds


def reference_forward_s(costs: ModelCosts, slot: Slot, layers: Union[int, range]) -> float:
    """Seconds of one no-grad forward of a micro-batch through `slot`'s stage (the reference's): the forward share
    of its training compute, and its sends one way."""
    parts = _parts(costs, slot, layers)
    compute = sum(c.flops * k for c, k in parts) / (DEVICE_FLOPS * slot.speed) * forward_fraction(costs)
    return compute + (slot.sends * slot.link.send_s(costs.boundary_bytes) if costs.boundary_bytes else 0.0)


def generation_forward_s(costs: ModelCosts, slot: Slot, layers: Union[int, range]) -> float:
    """Seconds of one micro-batch's generation through `slot`'s stage, for an objective that generates (0 else):
    the prompts' pass and a decode step a new token (`prefill_s`, `decode_step_s`)."""
    if not costs.spec.counts.generation:
        return 0.0
    return prefill_s(costs, slot, layers) + costs.spec.rollout_tokens * decode_step_s(costs, slot, layers)


def prefill_s(costs: ModelCosts, slot: Slot, layers: Union[int, range]) -> float:
    """Seconds of one micro-batch's prompts through `slot`'s blocks: a no-grad forward's share of their training
    compute on the prompt positions (the head keeps one position a row: nothing worth counting)."""
    spec = costs.spec
    prompt = spec.seq_len - min(spec.rollout_tokens, spec.seq_len)
    flops = sum(c.flops * k for c, k in runs_of(costs.layer_blocks, layers, costs.block)) * prompt / spec.seq_len
    return flops / (DEVICE_FLOPS * slot.speed) * forward_fraction(costs)


def decode_step_s(costs: ModelCosts, slot: Slot, layers: Union[int, range], *, share: float = 1.0) -> float:
    """Seconds of one decode step through `slot`'s stage of a micro-batch of `share` × the spec's rows: the compute
    of one position a row through its blocks and head, or, where the device's memory bandwidth is known
    (`Slot.memory_bandwidth`), the time to read the stage's weights (once, whatever the rows) and the rows' KV cache
    (on average filled to the prompt and half the new tokens), whichever is longer."""
    spec = costs.spec
    blocks = runs_of(costs.layer_blocks, layers, costs.block)
    flops = sum(c.flops * k for c, k in blocks) + (costs.head.flops if slot.has_head else 0)
    compute = share * flops / spec.seq_len / (DEVICE_FLOPS * slot.speed) * forward_fraction(costs)
    if not slot.memory_bandwidth:
        return compute
    weights = sum(c.param_bytes * k for c, k in blocks) + (costs.head.param_bytes if slot.has_head else 0)
    count = sum(k for _, k in blocks)
    cache = share * count * costs.kv_bytes * (spec.seq_len - spec.rollout_tokens / 2) / spec.seq_len
    return max(compute, (weights + cache) / slot.memory_bandwidth)


def balanced_time(costs: ModelCosts, slot: Slot, layers: Union[int, range]) -> float:
    """A slot's training time per micro-batch with its generation of the micro-batch (an objective that generates):
    one of the times the split search evens out between ranks (`search.balanced_times`)."""
    return slot_time(costs, slot, layers) + generation_forward_s(costs, slot, layers)


def _offload_time(costs: ModelCosts, slot: Slot, layers, parts, *, compute: float) -> float:
    """Seconds per micro-batch the host copies of offloaded block inputs add: each goes out in forward and comes
    back before its recompute, over the host link, beside `compute` seconds of the stage's work."""
    held = sum(c.offload_bytes * k for c, k in parts) - kept_input(costs, slot, layers)
    copies = 2 * sum(k for c, k in parts if c.offload_bytes) - (2 if kept_input(costs, slot, layers) else 0)
    return slot.link.host_copy_s(2 * held, copies, compute_s=compute) if held > 0 else 0.0


def _host_embedding_time(costs: ModelCosts, slot: Slot) -> float:
    """Seconds per micro-batch an embedding table in host RAM adds: its looked-up rows (one hidden state) cross the
    host link before the first block can start, so nothing hides the copy."""
    if not (slot.has_embed and costs.embed.host_bytes):
        return 0.0
    return slot.link.host_copy_s(costs.hidden_bytes or costs.boundary_bytes, 1, compute_s=0.0)


def _split_factor(costs: ModelCosts, slot: Slot) -> float:
    """Zero-bubble slots (3 actions) run the backward as two autograd passes: their measured extra compute."""
    return slot.link.split_backward if slot.actions == 3 and costs.spec.method != "inference" else 1.0


def _comm_time(costs: ModelCosts, slot: Slot, parts: list[tuple[PartCost, int]]) -> float:
    """Seconds per micro-batch beyond the FLOPs: its TP all-reduces, the hidden states it sends to and receives
    from each pipeline neighbour on another rank (forward, and the gradient back when training), and the fixed
    cost of each schedule action (ZBV and Interleaved run more, smaller actions)."""
    comm = sum(c.comm_bytes * k for c, k in parts)
    size, message = costs.boundary_bytes, costs.hidden_bytes or costs.boundary_bytes
    count = round(comm / message) if message else 1  # all-reduces are of hidden states: latency per message
    tp_time = slot.link.all_reduce_s(comm / max(count, 1), costs.tp, count) if comm else 0.0
    inference = costs.spec.method == "inference"
    sends = slot.sends * (1 if inference else 2) * slot.link.send_s(size) if size else 0.0
    return tp_time + sends + (1 if inference else slot.actions) * slot.link.action_s


def rank_fits(costs: ModelCosts, slots: Sequence[Slot], counts: Sequence[int], pp_rank: int) -> bool:
    return slots_fit(costs, [s for s in slots if s.pp_rank == pp_rank], counts)


def slots_fit(costs: ModelCosts, mine: Sequence[Slot], counts: Sequence[int]) -> bool:
    """Whether the slots of one pipeline rank fit its budget together (one reserve per device), and what their
    activation offload holds fits the rank's share of host memory."""
    memories = [stage_memory(costs, s, stage_layers(costs, counts, s.index)) for s in mine]
    host = mine[0].host_budget
    cap = mine[0].budget if mine[0].cap is None else mine[0].cap
    return rank_total(memories) <= cap and (host is None or sum(m.offload for m in memories) <= host)


def rank_times(costs: ModelCosts, slots: Sequence[Slot], counts: Sequence[int]) -> dict[int, float]:
    times: dict[int, float] = {}
    for s in slots:
        times[s.pp_rank] = times.get(s.pp_rank, 0.0) + slot_time(costs, s, stage_layers(costs, counts, s.index))
    return times


def layer_count(layers: Union[int, range]) -> int:
    return layers if isinstance(layers, int) else len(layers)


def device_speed(speeds: dict, device: str, budgets: dict[str, int]) -> float:
    given = speeds.get(device, speeds.get(int(device) if device.isdigit() else device))
    if given is not None:
        return float(given)
    # A CPU beside GPUs is far slower; alone it is simply "the device".
    return CPU_SPEED if device == "cpu" and len(budgets) > 1 else 1.0


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


def recompute_kept(schedule: str, choice: Choice) -> bool:
    """Zero-bubble schedules defer each weight gradient past its input gradient, and the activations the
    input gradient recomputed stay alive until then: checkpointing saves almost nothing there (measured
    3.6× the checkpointed figure, tests/parallel/test_apply.py), so the planner never pairs the two."""
    return choice.checkpointing != "off" and TABLE[schedule].zero_bubble
