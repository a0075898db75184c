"""Parallel execution: process layout (mesh), stage modules, tensor parallelism, pipeline schedules."""
from .launch import split_from_pretrained
from .split_model import SplitModel

__all__ = ["SplitModel", "split_from_pretrained"]
