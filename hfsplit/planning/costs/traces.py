"""Traced costs kept in memory and on disk, so a later process plans without tracing.

Tracing one block under FakeTensorMode costs about half a second whatever its size, and a
plan of a large model over many devices traces once per TP degree. The traced bytes depend
on the config and on the spec's method, dtype, LoRA shape, sequence length and micro-batch
size, but not on activation checkpointing or the reserve: those are normalised out of the
key, so `activation_checkpointing="auto"` traces once, not twice.

A fit over token counts (trace twice, extrapolate) was measured and rejected: the bytes a
block keeps are not linear in tokens (a seq² term that TP does not shard, and SDPA's CPU
kernel changes what it keeps with the sequence length), so exact traces are cached instead. Across TP
degrees the bytes are exact functions of the degree: degrees above the second one are derived from two
traces (`hfsplit.planning.costs.tp`), their profile cached too.
"""
from __future__ import annotations

from dataclasses import asdict, replace
from typing import Optional

from hfsplit.planning.costs.cache import read_cache, write_cache
from hfsplit.planning.costs.tp import block_trace_at, tiling_key
from hfsplit.planning.costs.trace import BlockTrace, EndsTrace, trace_ends


def trace_spec(spec):
    """The spec with the fields that do not change a trace set to fixed values."""
    lora = spec.method == "lora"
    # a reference and rollouts are counted beside the traces (`hfsplit.planning.reference`, `.rollout`); the
    # objective changes the head only
    return replace(spec, activation_checkpointing=False, reserve_bytes=None, optim="adamw_torch",
                   lora_r=spec.lora_r if lora else 0, lora_targets=spec.lora_targets if lora else None,
                   reference=None, reference_pairs=None, rollout_rows=0, rollout_tokens=0, host_embedding=False)


def block_trace(key: str, spec, tp: int):
    """`trace.trace_block` for `spec` at TP degree `tp`, from memory, disk, or a new trace."""
    # degrees above the second one are derived from two traces (block_trace_at)
    # the chunked loss changes only the head: a block trace serves both
    return _cached("block", key, replace(trace_spec(spec), chunked_loss=False, objective="sft"), tp, block_trace_at,
                   BlockTrace)


def ends_trace(key: str, spec):
    """`trace.trace_ends` for `spec`, from memory, disk, or a new trace."""
    # packing changes the blocks' masks only, 4-bit experts only the blocks: an ends trace serves them all
    return _cached("ends", key, replace(trace_spec(spec), packing=False, quantize_experts=False, tiled_mlp=0), None,
                   lambda k, s, _: trace_ends(k, s), EndsTrace)

_MEMO: dict[str, object] = {}
_UNTRACED = ("optim", "lora_alpha", "lora_dropout")
_NEWER = {"objective": "sft", "reference": None, "reference_pairs": None, "rollout_rows": 0,
          "rollout_tokens": 0, "tiled_mlp": 0, "host_embedding": False}  # keyed only where they differ from these


def _cached(kind: str, key: str, spec, tp: Optional[int], trace, cls):
    # `optim` never changes a trace (trace_spec fixes it), nor do LoRA's alpha and dropout (the trace's adapters are
    # its own): left out of the key, caches from before they were fields stay valid
    # and fields added since (DPO's) only where they differ from their defaults, so SFT keys stay as they were
    items = ((k, v) for k, v in asdict(spec).items() if k not in _UNTRACED and (k not in _NEWER or v != _NEWER[k]))
    full = f"{key}|{sorted(items)}|tp={tp}" + tiling_key(spec)
    if full in _MEMO:
        return _MEMO[full]
    record = read_cache(kind, full)
    value = cls(**record) if record is not None else trace(key, spec, tp)
    if record is None:
        write_cache(kind, full, asdict(value))
    _MEMO[full] = value
    return value
