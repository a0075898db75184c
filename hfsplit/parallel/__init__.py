"""Parallel execution: process layout (mesh), stage modules, tensor parallelism, pipeline schedules."""
from hfsplit.parallel.launch import split_from_pretrained
from hfsplit.parallel.split_model import SplitModel

__all__ = ["SplitModel", "split_from_pretrained"]
