"""Parallel execution: process layout (mesh), stage modules, tensor parallelism, pipeline schedules."""
from .split_model import SplitModel, split_from_pretrained

__all__ = ["SplitModel", "split_from_pretrained"]
