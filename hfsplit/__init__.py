"""hfsplit: plan, load and fine-tune Hugging Face LLMs split across small or mismatched GPUs."""
from hfsplit.budget import parse_max_memory
from hfsplit.errors import BudgetError, CheckpointError, HfsplitError, PlanError, UnsupportedModelError
from hfsplit.plan import Plan, Stage, StageMemory, TrainingSpec

__all__ = [
    "BudgetError", "CheckpointError", "HfsplitError", "Plan", "PlanError", "Stage", "StageMemory",
    "TrainingSpec", "UnsupportedModelError", "from_pretrained", "make_plan", "parse_max_memory", "tiny_model",
]

# The planner (with the cost model's FakeTensor tracing) and the loader load on first use, so
# `import hfsplit.plan` or the training runtime does not pull in planning code.
_LAZY = {"from_pretrained": "load.materialize", "make_plan": "planning.planner", "tiny_model": "checkpoint.synthetic"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
