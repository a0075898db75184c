"""Calibrating the time model on the launched devices: their real throughput on the block's own shapes, cached.

The planner's step estimate is FLOPs / throughput (`hfsplit.planning.timing`). The recipe times one forward +
backward of one real decoder block of the model (quantized, with adapters and autocast as the run applies them:
so this runs real blocks and sits where planning meets running) at the run's micro-batch shape on the rank's own
device, and divides the block's counted FLOPs by it. The figure is cached on disk
(`hfsplit.planning.costs.cache.cache_dir`) per device kind, dtype and block shape, so a run measures once;
a run's own measured rate replaces it when they disagree (`recheck_speed`). `hfsplit plan` on a machine without
the target GPUs uses the bundled table of GPU kinds (`hfsplit.gpu_kinds`, `hfsplit.planning.kind_rates`) where the
budget names kinds, and finds there a run's measurement of the same kind and block shape in this cache.

The link between ranks is measured at launch too (`probe_link`): every rank sends to the next and
receives from the previous at once, at a small and a large size, and the slowest rank's times give
latency and bandwidth for the pipeline's sends and the TP all-reduces; and the host link the activation
offload uses (`host_copy_seconds`), which until then is the device table's (`links.host_link_bandwidth`).
"""
from __future__ import annotations

import math
import os
import platform
import statistics
import time
from dataclasses import replace
from typing import Optional

import torch

from hfsplit.apply.autocast import autocast_forwards
from hfsplit.apply.quantize import check_quantization, quantization_config_of, quantize_module
from hfsplit.apply.quantized_experts_lora import register_quantized_experts_lora
from hfsplit.budget import budget_kinds, parse_max_memory
from hfsplit.gpu_kinds import kind_of_device_name
from hfsplit.checkpoint.resolve import load_config
from hfsplit.models.boundary import block_inputs, hidden_shape
from hfsplit.models.expert_lora import default_lora_targets, split_lora_targets
from hfsplit.models.families import FAMILIES
from hfsplit.models.layout import decoder_layout
from hfsplit.models.masks import causal_masks, layer_attention_type
from hfsplit.parallel.mesh import launcher_world
from hfsplit.planning.costs.cache import read_cache, write_cache
from hfsplit.planning.costs.layout import dtype_of, rank_layer_config
from hfsplit.planning.costs.masks import traced_positions
from hfsplit.planning.costs.model import model_costs
from hfsplit.planning.costs.trace import set_trainable
from hfsplit.planning.kind_rates import calibration_key, measured_speeds
from hfsplit.planning.links import Link, fit_link
from hfsplit.planning.timing import DEVICE_FLOPS, pipeline_busy

PROBE_REPEATS = 7
# A cached FLOP/s figure is re-measured after this long, and replaced by a run's own measured rate when the
# run's busy time differs from the estimate by more than RECHECK_FACTOR either way (see `recheck_speed`).
MAX_AGE_S = 7 * 24 * 3600
RECHECK_FACTOR = 1.3
# Message sizes of the link probe: 4 KiB is latency-bound, 4 MiB bandwidth-bound on every interconnect
# (and a few ms on gloo over loopback), so a probe of both costs well under a second.
LINK_PROBE_BYTES = (4 << 10, 4 << 20)
LINK_PROBE_REPEATS = 5
HOST_PROBE_BYTES = 16 << 20  # a block input of a small model; PCIe reaches its rate well below this


def device_kind(device: torch.device) -> str:
    """A name for what runs the work: the GPU's kind in the bundled table ("RTX4090", so `hfsplit plan --max-memory
    2xRTX4090` finds what a run on one measured), else the name CUDA reports; or the CPU model, its thread count
    and how many ranks of the launch share this host's cores (one process runs a block faster than each of two
    ranks sharing them: a figure probed or measured by one must not plan the other)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        kind = kind_of_device_name(name)
        return kind.name if kind is not None else name
    sharing = launcher_world().local_world_size
    return f"cpu:{platform.processor() or platform.machine()}:threads={torch.get_num_threads()}:ranks={sharing}"


def speed_key(config, spec, device: torch.device) -> str:
    """The calibration cache's key for `device` (`kind_rates.calibration_key` of its `device_kind`)."""
    return calibration_key(config, spec, device_kind(device))


def block_flops_per_s(config, spec, device: torch.device) -> float:
    """Measured FLOP/s of one decoder block's forward + backward under `spec` on `device` (cached)."""
    record = speed_record(config, spec, device)
    return record["flops"] / record["seconds"]


def split_backward_factor(config, spec, device: torch.device) -> float:
    """How much longer the block's step takes with its backward split into an input-gradient and a
    weight-gradient pass, as zero-bubble schedules run it, than with one backward (cached with the FLOP/s)."""
    record = speed_record(config, spec, device)
    return max(1.0, record.get("split_seconds", record["seconds"]) / record["seconds"])


def speed_record(config, spec, device: torch.device) -> dict:
    """The cached calibration record (`seconds`, `split_seconds`, `flops`, `measured_at`, `source`), measured
    now when there is none or it is older than MAX_AGE_S: a figure taken on a machine that has changed
    (drivers, load, thermal limits) should not plan forever."""
    plain = replace(spec, activation_checkpointing=False)  # the probe runs no recompute
    key = speed_key(config, spec, device)
    record = read_cache("speed", key)
    if record is None or time.time() - record.get("measured_at", 0) > MAX_AGE_S:
        seconds, split = _time_block(config, plain, device)
        record = {"seconds": seconds, "split_seconds": split, "flops": model_costs(config, plain, tp=1).block.flops,
                  "measured_at": time.time(), "source": "probe"}
        write_cache("speed", key, record)
    return record


def _time_block(config, spec, device: torch.device) -> tuple[float, float]:
    """Median seconds of forward + backward of one real block at the spec's micro-batch shape: with one
    backward, and with the backward split into input and weight gradients by torch's own pipelining
    functions (what ZBV and DualPipeV run). The two run in alternate pairs and the split's figure is the
    plain one × the median ratio within pairs, so load that comes and goes during the probe cancels out
    (on 2 loaded CPU cores single timings of the same block vary 2×; the paired ratio stays near 1.1)."""
    run = _probe_block(config, spec, device)
    training = spec.method != "inference"
    if training and not _splits(run):
        return statistics.median(_seconds(run, device, split=False) for _ in range(PROBE_REPEATS + 1)), math.inf
    plain, ratios = [], []
    for i in range(PROBE_REPEATS + 1):  # the first pair warms allocators and kernels
        one = _seconds(run, device, split=False)
        split = _seconds(run, device, split=True) if training else one
        if i:
            plain.append(one)
            ratios.append(split / one)
    seconds = statistics.median(plain)
    return seconds, seconds * statistics.median(ratios)


def _splits(run) -> bool:
    """Whether torch's pipelining splits the block's backward in two (what zero-bubble schedules run): it fails
    with "backward through the graph a second time" on Gemma 3n's block (in-place updates of its AltUp streams).
    A block that does not split plans zero-bubble schedules at an infinite time, so the planner never picks one."""
    try:
        run(True)
    except RuntimeError as exc:  # anything else (out of memory, a kernel missing) is the probe's own failure
        if "backward through the graph a second time" not in str(exc):
            raise
        return False
    return True


def _probe_block(config, spec, device: torch.device):
    """A function running forward and backward once on a random micro-batch through block 0 of a one-layer
    model of `config` (LoRA-wrapped and trainable as `spec` says)."""
    from transformers import AutoModelForCausalLM

    dtype = dtype_of(spec.dtype)
    model = AutoModelForCausalLM.from_config(rank_layer_config(config), dtype=dtype).to(device)
    layout = decoder_layout(model)  # (Llama 4's `get_decoder` is the causal LM itself)
    base, block = model.get_submodule(layout.base), model.get_submodule(layout.layers)[0]
    kwargs = _probe_inputs(model.config, base, block, spec, device)
    if spec.method == "qlora":  # the run's block: 4-bit base (its dequantize in every pass), LoRA trained
        _quantize_probe(block, spec, device)
    if spec.method in ("lora", "qlora"):
        from peft import LoraConfig, inject_adapter_in_model  # lazy: ~3 s import (inductor)

        # the run's targets, fused MoE experts included (peft target parameters)
        modules, params = split_lora_targets(list(spec.lora_targets or default_lora_targets(config)), config)
        lora = LoraConfig(r=spec.lora_r, target_modules=modules, target_parameters=params or None)
        register_quantized_experts_lora(lora)  # 4-bit experts: their adapters applied split, as the run does
        inject_adapter_in_model(lora, block)
    if spec.method == "qlora":  # fp32 adapters and, in 16 bits, autocast forwards, as hfsplit.apply.steps runs them
        from peft.tuners.tuners_utils import cast_adapter_dtype  # lazy: ~3 s import (inductor)

        cast_adapter_dtype(block, "default")
        if spec.autocast_dtype is not None:
            autocast_forwards([block], dtype=spec.autocast_dtype)
    set_trainable(block, replace(spec, method="lora") if spec.method == "qlora" else spec)
    x = torch.randn(hidden_shape(config, spec.micro_batch_size, spec.seq_len), dtype=dtype, device=device)

    def run(split: bool) -> None:
        inp = x.detach().requires_grad_(spec.method != "inference")
        out = block(inp, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        if spec.method == "inference":
            return
        if not split:
            out.sum().backward()
            return
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

        _, groups = stage_backward_input([out], [torch.ones_like(out)], [inp], block.parameters())
        stage_backward_weight(block.parameters(), groups)

    return run


def _probe_inputs(config, base, block, spec, device: torch.device) -> dict:
    """What block 0 of a stage gets besides the hidden state: what the model's own forward hands it (rotary
    tables, per-layer inputs, Falcon-H1's Mamba mask), taken before the block is quantized and adapted; a declared
    family's mask as its stage builds it (none under sdpa for unpacked rows, `PackedRows` for packed ones)."""
    ids = torch.zeros(spec.micro_batch_size, spec.seq_len, dtype=torch.long, device=device)
    positions = traced_positions(spec.micro_batch_size, spec.seq_len, packed=spec.packing).to(device)
    kwargs = block_inputs(base, block, ids, position_ids=positions)
    if config.model_type in FAMILIES and "attention_mask" in kwargs:
        hidden = torch.empty(*ids.shape, config.hidden_size, device=device)
        kwargs["attention_mask"] = causal_masks(config, hidden=hidden, position_ids=positions).get(
            layer_attention_type(config, 0))
    return kwargs


def _quantize_probe(block, spec, device: torch.device) -> None:
    """Quantize the probe block's linears as the run does (without it a QLoRA probe timed a frozen 16-bit
    block: no dequantize, no weight-gradient pass, and a split-backward factor of about 1 where zero-bubble
    schedules measured 1.3x slower than 1F1B)."""
    qconfig = quantization_config_of(spec)
    check_quantization(qconfig, device=device)  # a quant type bitsandbytes refuses: the run's one-line error
    quantize_module(block, qconfig, device=device, experts=spec.quantize_experts)


def _seconds(run, device: torch.device, *, split: bool) -> float:
    _sync(device)
    start = time.perf_counter()
    run(split)
    _sync(device)
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calibrated_speeds(config, spec, budgets: dict, device: torch.device, kinds: Optional[dict] = None) -> dict:
    """`make_plan(device_speeds=...)` of a run on `device`: its measured FLOP/s over the planner's unit for every
    device of `budgets`, or, where the budget names GPU kinds (`kinds`, `budget.budget_kinds`) and `device` is one
    of them, the table's ratio between the kinds scaled by the measurement (`kind_rates.measured_speeds`)."""
    if os.environ.get("HFSPLIT_NO_CALIBRATION"):
        return {}
    here = kind_of_device_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return measured_speeds(kinds or {}, budgets, measured_flops=block_flops_per_s(config, spec, device), here=here,
                           unit=DEVICE_FLOPS)


def run_speeds(model_path: str, spec, max_memory) -> dict:
    """The calibrated `device_speeds` of a launched run: every rank probes its own device at once, so the
    figure includes what ranks sharing a machine cost each other (rank 0's is the one planned with)."""
    return calibrated_speeds(load_config(model_path), spec, parse_max_memory(max_memory), _run_device(),
                             kinds=budget_kinds(max_memory))


def recheck_speed(plan, config, device: torch.device, *, step_times_s: list[float], busy_s: list[float],
                  spec=None) -> Optional[str]:
    """Correct the cached FLOP/s with a run's own measurement; the line to print, or None when it agreed.

    The calibration probe times one block for a moment; a run's steps time every block for minutes. When the
    pipeline ranks' measured busy time (their stages' work, waits excluded) differs from the plan's estimate
    by more than RECHECK_FACTOR either way, the probe was taken under other conditions (a loaded machine, a
    cold cache) and the run's rate replaces it, so the next plan of this device and shape uses it. Call it
    where the plan was made (rank 0), after the run, with `TrainResult`'s step times and busy seconds, and
    the spec the speed was calibrated with (default the plan's; they differ where auto cut a global batch).
    """
    rows = pipeline_busy(plan, step_times_s, busy_s)
    if os.environ.get("HFSPLIT_NO_CALIBRATION") or len(step_times_s) < 2 or not rows:
        return None
    estimated, measured = sum(r[1] for r in rows), sum(r[2] for r in rows)
    ratio = measured / estimated if estimated > 0 else 1.0
    key = speed_key(config, spec or plan.spec, device)
    record = read_cache("speed", key)
    if record is None or 1 / RECHECK_FACTOR <= ratio <= RECHECK_FACTOR:
        return None
    # The estimate is FLOPs / FLOP/s (plus small per-message and per-action terms): scaling the timed
    # seconds by the ratio makes the same plan's busy estimate equal what this run measured.
    corrected = {**record, "seconds": record["seconds"] * ratio, "measured_at": time.time(), "source": "run"}
    corrected["split_seconds"] = record.get("split_seconds", record["seconds"]) * ratio
    write_cache("speed", key, corrected)
    return (f"time model: measured busy time was {ratio:.2f}× the estimate (beyond {RECHECK_FACTOR}×): the cached "
            f"FLOP/s of {device_kind(device)} for this block shape now holds this run's rate; the next plan uses it")


def probe_link() -> Optional[Link]:
    """The launch's rank-to-rank link, measured now; None with one rank (nothing to send to).

    Every rank sends to rank + 1 and receives from rank - 1 at the same time (a ring), so each link a
    pipeline or TP group may use carries traffic at once, as it will in a step, and the slowest rank's
    times (all-reduced with MAX, so every rank returns the same Link) are the figure. Not cached on disk,
    unlike the FLOP/s: the link depends on where this launch's ranks sit (one host, NVLink, across nodes),
    which nothing before the launch knows, and the probe takes milliseconds. A collective: every rank calls it.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    seconds = [_ring_seconds(n, device) for n in LINK_PROBE_BYTES] + [action_seconds(device), host_copy_seconds(device)]
    seconds = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    small, large, action, host = seconds.tolist()
    return replace(fit_link(LINK_PROBE_BYTES, (small, large)), action_s=action,
                   host_bandwidth=HOST_PROBE_BYTES / max(host, 1e-9), host_overlap=device.type == "cuda")


def host_copy_seconds(device: torch.device) -> float:
    """Median seconds of one copy of HOST_PROBE_BYTES from the device to host memory, as the activation offload
    makes it (pinned and asynchronous on CUDA; a plain copy on a CPU rank), every rank at once: what ranks sharing
    a host's PCIe or memory cost each other is in it."""
    source = torch.ones(HOST_PROBE_BYTES // 4, dtype=torch.float32, device=device)
    target = torch.empty(source.shape, dtype=source.dtype, pin_memory=device.type == "cuda")
    times = []
    for i in range(LINK_PROBE_REPEATS + 1):  # the first copy pins and maps the buffer
        _sync(device)
        start = time.perf_counter()
        target.copy_(source, non_blocking=device.type == "cuda")
        _sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ring_seconds(nbytes: int, device: torch.device) -> float:
    """Median seconds of one ring exchange of `nbytes` (send to the next rank, receive from the previous)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    send = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)
    times = []
    for i in range(LINK_PROBE_REPEATS + 1):  # the first exchange connects the pair and warms buffers
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        _sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def action_seconds(device: torch.device) -> float:
    """Median seconds of the smallest schedule action: forward and backward of a one-Linear stage through
    `torch.autograd.backward` with an output gradient, as a pipeline stage runs its backward. Its FLOPs are
    nil, so what is timed is the fixed cost every action pays (the schedule's own bookkeeping is not in it)."""
    stage = torch.nn.Linear(8, 8).to(device)
    x = torch.randn(1, 8, device=device, requires_grad=True)
    times = []
    for i in range(4 * LINK_PROBE_REPEATS + 1):  # cheap: more repeats steady the median
        _sync(device)
        start = time.perf_counter()
        y = stage(x)
        torch.autograd.backward((y,), grad_tensors=(torch.ones_like(y),))
        _sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_link(model_path: Optional[str] = None, spec=None) -> Optional[Link]:
    """The launched run's measured link for `make_plan(link=...)` (None: one rank, or calibration off), with
    the calibrated cost of the split backward of `model_path`'s block under `spec` when they are given."""
    if os.environ.get("HFSPLIT_NO_CALIBRATION"):
        return None
    link = probe_link()
    if link is None or model_path is None or spec is None or spec.method == "inference":
        return link

    return replace(link, split_backward=split_backward_factor(load_config(model_path), spec, _run_device()))


def _run_device() -> torch.device:
    """This rank's device: its GPU (by its local rank), else the CPU."""
    return launcher_world().device
