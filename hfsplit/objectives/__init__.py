"""Training objectives (issue 31): each one module owning its rows, targets, loss, metrics, evaluation and option
defaults, registered by its `--objective` name. The interface is `hfsplit.training.objective.Objective`; what each
declares for the planner to count is `hfsplit.plan.OBJECTIVE_COUNTS[name]`."""
from hfsplit.objectives.registry import OBJECTIVES, objective_of, option_mixins

__all__ = ["OBJECTIVES", "objective_of", "option_mixins"]
