"""Checkpoints: resolve a name to files, read tensors (or TP slices) by index."""
from .resolve import load_config, resolve_file

__all__ = ["load_config", "resolve_file"]
