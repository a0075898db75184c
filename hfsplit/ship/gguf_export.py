"""GGUF export (placeholder until written)."""
from __future__ import annotations


def export_gguf(model, out, *, tensor_type: str = "f16"):
    raise NotImplementedError
