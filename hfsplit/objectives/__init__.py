"""Training objectives (issue 31): each one module owning its rows, targets, loss, metrics, evaluation and option
defaults, registered by its `--objective` name; their option fields and what they decide from the options alone
(`OptionRules`) live in `options` (no torch: the command line parses and checks them before an objective's module
loads). The interface is `hfsplit.training.objective.Objective`; what each
declares for the planner to count is `hfsplit.plan.OBJECTIVE_COUNTS[name]`."""
from hfsplit.objectives.registry import OBJECTIVES, objective_of, option_mixins, option_rules_of

__all__ = ["OBJECTIVES", "objective_of", "option_mixins", "option_rules_of"]
