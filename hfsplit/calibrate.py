"""Calibrating the time model: the device's real throughput on the block's own shapes, cached.

The planner's step estimate is FLOPs / throughput. A datasheet peak misleads by orders of
magnitude on CPU ranks (and by 2-3× on GPUs, where attention and elementwise kernels run far
below the matmul peak), so the recipe times one forward + backward of one real decoder block
of the model at the run's micro-batch shape on the rank's own device, and divides the block's
counted FLOPs by it. The figure is cached on disk (`hfsplit.trace_cache.cache_dir`) per device
kind, dtype and block shape, so a run measures once. `hfsplit plan` on a machine without the
target GPUs uses `KNOWN_FLOPS` (or `--device-flops`).

The link between ranks is measured at launch too (`probe_link`): every rank sends to the next and
receives from the previous at once, at a small and a large size, and the slowest rank's times give
latency and bandwidth for the pipeline's sends and the TP all-reduces.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import replace
from typing import Optional

import torch

from .links import Link, fit_link

# Dense bf16 tensor-core peak (FLOP/s, datasheets) per GPU name fragment; a training step reaches about
# ACHIEVED of it. Used by `hfsplit plan` for the GPU it is told about, never measured here.
KNOWN_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12,
               "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12, "T4": 65e12}
ACHIEVED = 0.4
PROBE_REPEATS = 3
# Message sizes of the link probe: 4 KiB is latency-bound, 4 MiB bandwidth-bound on every interconnect
# (and a few ms on gloo over loopback), so a probe of both costs well under a second.
LINK_PROBE_BYTES = (4 << 10, 4 << 20)
LINK_PROBE_REPEATS = 5


def device_kind(device: torch.device) -> str:
    """A name for what runs the work: the GPU model, or the CPU model and its thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu:{platform.processor() or platform.machine()}:threads={torch.get_num_threads()}"


def known_flops(name: str) -> Optional[float]:
    """Achieved FLOP/s of a GPU named like `name` ("H100", "NVIDIA A100-SXM4-80GB"), from KNOWN_FLOPS."""
    for key, peak in sorted(KNOWN_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if key.lower() in name.lower():
            return peak * ACHIEVED
    return None


def block_flops_per_s(config, spec, device: torch.device) -> float:
    """Measured FLOP/s of one decoder block's forward + backward under `spec` on `device` (cached)."""
    from .costs import model_costs
    from .trace_cache import read_cache, write_cache

    plain = replace(spec, activation_checkpointing=False)  # the probe runs no recompute
    flops = model_costs(config, plain, tp=1).block.flops
    key = (f"{device_kind(device)}|{spec.dtype}|{spec.method}|r={spec.lora_r}|b={spec.micro_batch_size}"
           f"|s={spec.seq_len}|{config.hidden_size}|{config.intermediate_size}|{config.num_attention_heads}"
           f"|{getattr(config, 'num_key_value_heads', None)}|{config.model_type}")
    record = read_cache("speed", key)
    if record is None:
        record = {"seconds": _time_block(config, plain, device), "flops": flops}
        write_cache("speed", key, record)
    return record["flops"] / record["seconds"]


def _time_block(config, spec, device: torch.device) -> float:
    """Median seconds of forward + backward of one real block at the spec's micro-batch shape."""
    from .costs import _dtype, _one_layer_config, _set_trainable
    from transformers import AutoModelForCausalLM

    dtype = _dtype(spec.dtype)
    model = AutoModelForCausalLM.from_config(_one_layer_config(config), dtype=dtype).to(device)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    block = base.layers[0]
    if spec.method == "lora":
        from peft import LoraConfig, inject_adapter_in_model

        from .costs import block_linear_names

        inject_adapter_in_model(LoraConfig(r=spec.lora_r, target_modules=block_linear_names(config)), block)
    _set_trainable(block, spec)
    ids = torch.zeros(spec.micro_batch_size, spec.seq_len, dtype=torch.long, device=device)
    pos = torch.arange(spec.seq_len, device=device).unsqueeze(0)
    x = torch.randn(spec.micro_batch_size, spec.seq_len, config.hidden_size, dtype=dtype, device=device)
    embeddings = _block_rotary(config, base.rotary_emb, x, pos)
    times = []
    for i in range(PROBE_REPEATS + 1):  # the first run warms allocators and kernels
        _sync(device)
        start = time.perf_counter()
        inp = x.detach().requires_grad_(spec.method != "inference")
        out = block(inp, attention_mask=None, position_embeddings=embeddings, position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        if spec.method != "inference":
            out.sum().backward()
        _sync(device)
        if i:
            times.append(time.perf_counter() - start)
    del ids
    return statistics.median(times)


def _block_rotary(config, rotary_emb, x: torch.Tensor, pos: torch.Tensor):
    """The rotary table block 0 receives (Gemma 3 computes one per layer type)."""
    from .models import FAMILIES, Family

    kind = (getattr(config, "layer_types", None) or ["full_attention"])[0]
    return FAMILIES.get(config.model_type, Family()).position_embeddings(rotary_emb, x, pos, [kind])[kind]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calibrated_speeds(config, spec, budgets: dict, device: torch.device) -> dict:
    """`make_plan(device_speeds=...)` for devices all like `device`: measured FLOP/s over the planner's unit."""
    from .planner import DEVICE_FLOPS

    if os.environ.get("HFSPLIT_NO_CALIBRATION"):
        return {}
    speed = block_flops_per_s(config, spec, device) / DEVICE_FLOPS
    return {key: speed for key in budgets}


def run_speeds(model_path: str, spec, max_memory) -> dict:
    """The calibrated `device_speeds` of a launched run: every rank probes its own device at once, so the
    figure includes what ranks sharing a machine cost each other (rank 0's is the one planned with)."""
    from .budget import parse_max_memory
    from .checkpoint import load_config

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    return calibrated_speeds(load_config(model_path), spec, parse_max_memory(max_memory), device)


def time_report(plan, step_times_s: list[float], busy_s: list[float]) -> str:
    """The plan's step estimate beside the measured median step, and per pipeline rank the estimated busy
    time per step (its stages' forward + backward × micro-batches) beside the measured one.

    Args:
        plan: the run's Plan.
        step_times_s: measured wall time of the timed steps.
        busy_s: per global rank, seconds its schedule spent in its stages' work over those steps.
    """
    from .parallel.mesh import coordinates_of_rank

    if not step_times_s:
        return "time model: no step was timed"
    measured = statistics.median(step_times_s)
    lines = [f"time model: estimated step {plan.step_time_s * 1e3:.1f} ms, measured median {measured * 1e3:.1f} ms "
             f"(× {measured / plan.step_time_s:.2f})"]
    for rank, busy in enumerate(busy_s):
        c = coordinates_of_rank(plan, rank=rank)
        if c.dp or c.tp:
            continue  # replicas and TP peers run the same stages
        estimate = sum(s.time_s for s in plan.stages_of_rank(c.pp)) * plan.micro_batches
        layers = ", ".join(f"{s.layers[0]}-{s.layers[1] - 1}" for s in plan.stages_of_rank(c.pp))
        lines.append(f"  pipeline rank {c.pp} (layers {layers}): estimated busy {estimate * 1e3:.1f} ms, "
                     f"measured {busy / len(step_times_s) * 1e3:.1f} ms per step")
    return "\n".join(lines)


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
    seconds = [_ring_seconds(n, device) for n in LINK_PROBE_BYTES] + [action_seconds(device)]
    seconds = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    small, large, action = seconds.tolist()
    return replace(fit_link(LINK_PROBE_BYTES, (small, large)), action_s=action)


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


def run_link() -> Optional[Link]:
    """The launched run's measured link for `make_plan(link=...)` (None: one rank, or calibration off)."""
    if os.environ.get("HFSPLIT_NO_CALIBRATION"):
        return None
    return probe_link()
