"""Checkpoints: resolve a name to files, read tensors (or TP slices) by index."""
from hfsplit.checkpoint.reader import CheckpointReader
from hfsplit.checkpoint.resolve import load_config, resolve_file

__all__ = ["CheckpointReader", "load_config", "resolve_file"]
