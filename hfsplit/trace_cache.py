"""Traced costs cached on disk, so a later process plans without tracing.

Tracing one block under FakeTensorMode costs about half a second whatever its size, and a
plan of a large model over many devices traces once per TP degree. The traced bytes depend
on the config and on the spec's method, dtype, LoRA shape, sequence length and micro-batch
size, but not on activation checkpointing or the reserve: those are normalised out of the
key, so `activation_checkpointing="auto"` traces once, not twice.

A fit over token counts (trace twice, extrapolate) was measured and rejected: the bytes a
block keeps are not linear in tokens (a seq² term that TP does not shard, and SDPA's CPU
kernel changes what it keeps with the sequence length), so exact traces are cached instead. Across TP
degrees the bytes are exact functions of the degree: degrees above the second one are derived from two
traces (`hfsplit.trace_tp`), their profile cached here too.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

CACHE_VERSION = 7  # 2: MoE blocks traced with grouped experts (routed rows only); 3: MoE experts sharded by TP;
# 4: frozen experts save no routed rows (trace_moe); 5: sdpa blocks without a mask where the run has none;
# 6: a block's backward peak without the saved tensors autograd has already freed; 7: 4-bit MoE experts'
# dequantized matrices (TrainingSpec.quantize_experts)


def cache_dir() -> Path:
    """Where hfsplit keeps measured figures: `$HFSPLIT_CACHE`, else `$XDG_CACHE_HOME/hfsplit`
    (default `~/.cache/hfsplit`)."""
    given = os.environ.get("HFSPLIT_CACHE")
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hfsplit"


def read_cache(kind: str, key: str) -> Optional[dict]:
    """The JSON record cached under (kind, key), or None."""
    try:
        return json.loads(_cache_path(kind, key).read_text())
    except (OSError, ValueError):
        return None


def write_cache(kind: str, key: str, record: dict) -> None:
    """Store `record` under (kind, key); a read-only or full disk only costs the cache."""
    path = _cache_path(kind, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)  # atomic: ranks planning at once never read half a file
    except OSError:
        pass


def _cache_path(kind: str, key: str) -> Path:
    import torch
    import transformers

    digest = hashlib.sha1(f"{CACHE_VERSION}|{torch.__version__}|{transformers.__version__}|{key}".encode()).hexdigest()
    return cache_dir() / f"{kind}-{digest[:24]}.json"


def trace_spec(spec):
    """The spec with the fields that do not change a trace set to fixed values."""
    lora = spec.method == "lora"
    return replace(spec, activation_checkpointing=False, reserve_bytes=None,
                   lora_r=spec.lora_r if lora else 0, lora_targets=spec.lora_targets if lora else None)


def block_trace(key: str, spec, tp: int):
    """`costs._trace_block` for `spec` at TP degree `tp`, from memory, disk, or a new trace."""
    from .costs import _BlockTrace
    from .trace_tp import block_trace_at  # degrees above the second one are derived from two traces

    # the chunked loss changes only the head: a block trace serves both
    return _cached("block", key, replace(trace_spec(spec), chunked_loss=False), tp, block_trace_at, _BlockTrace)


def ends_trace(key: str, spec):
    """`costs._trace_ends` for `spec`, from memory, disk, or a new trace."""
    from .costs import _EndsTrace, _trace_ends

    return _cached("ends", key, replace(trace_spec(spec), quantize_experts=False), None,
                   lambda k, s, _: _trace_ends(k, s), _EndsTrace)


_MEMO: dict[str, object] = {}


def _cached(kind: str, key: str, spec, tp: Optional[int], trace, cls):
    full = f"{key}|{sorted(asdict(spec).items())}|tp={tp}"
    if full in _MEMO:
        return _MEMO[full]
    record = read_cache(kind, full)
    value = cls(**record) if record is not None else trace(key, spec, tp)
    if record is None:
        write_cache(kind, full, asdict(value))
    _MEMO[full] = value
    return value


def cached_layout(key: str, build):
    """`costs._Layout` of the config `key`, from disk or `build(key)`."""
    from .costs import _Layout, _Linear

    record = read_cache("layout", key)
    if record is not None:
        return _Layout(**{**record, "linears": tuple(_Linear(**lin) for lin in record["linears"])})
    layout = build(key)
    write_cache("layout", key, asdict(layout))
    return layout
