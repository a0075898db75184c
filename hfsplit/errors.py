"""Error types: each message names the thing at fault and how to fix it."""


class HfsplitError(Exception):
    """Base class for every error hfsplit raises on purpose."""


class BudgetError(HfsplitError, ValueError):
    """A `max_memory` value that cannot be parsed."""


class PlanError(HfsplitError):
    """No split of the model fits the budget (or the requested split is invalid)."""


class CheckpointError(HfsplitError):
    """A checkpoint that is missing, corrupt, or disagrees with its config."""


class UnsupportedModelError(HfsplitError):
    """A model architecture hfsplit cannot split."""
