"""Where measured figures are kept on disk (traced costs, the layout of a config, calibrated FLOP/s), so a later
process reads them instead of measuring again: one JSON file per (kind, key), keyed also by `CACHE_VERSION` and
the torch and transformers versions. Written atomically; a read-only or full disk only costs the cache.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

CACHE_VERSION = 11  # 2: MoE blocks traced with grouped experts (routed rows only); 3: MoE experts sharded by TP;
# 4: frozen experts save no routed rows (costs.moe); 5: sdpa blocks without a mask where the run has none;
# 6: a block's backward peak without the saved tensors autograd has already freed; 7: 4-bit MoE experts'
# dequantized matrices (TrainingSpec.quantize_experts); 8: packed rows under sdpa example by example (models/varlen.py);
# 9: any causal LM (layer kinds by attention type, routers subclassing nn.Linear no LoRA target); 10: a block traced
# with what its decoder passes by position too (Gemma 3n/4's per-layer input, GPT-2's mask), Gemma 3n's AltUp streams;
# 11: Gemma 4's full-attention layers a kind of their own (their wider heads, `per_layer_config`)


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
