"""hfsplit: plan, load and fine-tune Hugging Face LLMs split across small or mismatched GPUs."""
from .budget import parse_max_memory
from .costs import TrainingSpec
from .errors import BudgetError, CheckpointError, HfsplitError, PlanError, UnsupportedModelError
from .materialize import from_pretrained
from .plan import Plan, Stage, StageMemory
from .planner import make_plan

__all__ = [
    "BudgetError", "CheckpointError", "HfsplitError", "Plan", "PlanError", "Stage", "StageMemory",
    "TrainingSpec", "UnsupportedModelError", "from_pretrained", "make_plan", "parse_max_memory",
]
