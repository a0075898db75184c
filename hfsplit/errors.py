"""Error types: each message names the thing at fault and how to fix it."""


class HfsplitError(Exception):
    """Base class for every error hfsplit raises on purpose (the CLI and recipe exit with `exit_code`)."""

    exit_code = 2


class BudgetError(HfsplitError, ValueError):
    """A `max_memory` value that cannot be parsed."""


class PlanError(HfsplitError):
    """No split of the model fits the budget (or the requested split is invalid)."""


class CheckpointError(HfsplitError):
    """A checkpoint that is missing, corrupt, or disagrees with its config."""


class UnsupportedModelError(HfsplitError):
    """A model architecture hfsplit cannot split."""


class ConvertedOnLoadError(UnsupportedModelError):
    """A checkpoint whose tensors transformers splits into several on load: the lazy reader only merges
    (MoE experts), so single-process loading hands such checkpoints to transformers itself."""


class TrainingFault(HfsplitError):
    """A run that started well and then failed: not bad input, so the recipe exits 3 instead of 2."""

    exit_code = 3


class NonFiniteError(TrainingFault):
    """A non-finite loss or gradient under `--on-nonfinite stop`."""


class PeerLostError(TrainingFault):
    """Another rank died or stopped answering within `--peer-timeout`."""


class RegroupStop(TrainingFault):
    """The run stopped at a step boundary (with a checkpoint) because torchrun is regrouping the ranks."""


class OutOfMemory(TrainingFault):
    """A device ran out of memory inside a training step."""


class QuantizationError(HfsplitError):
    """A quantization request bitsandbytes cannot serve here, or that disagrees with the checkpoint."""


class RankIdle(HfsplitError):
    """This rank joined a larger group that the time model says is not faster: it has no part in the run.

    Not a failure (exit 0): its launcher then waits at torchrun's exit barrier while the others train."""

    exit_code = 0


class Interrupted(HfsplitError):
    """Ctrl-C or SIGTERM stopped the run: the message names the last complete checkpoint and how to resume.
    Exits 130, as a shell reports a command Ctrl-C ended."""

    exit_code = 130


class SplitAttributeError(HfsplitError, AttributeError):
    """A transformers model attribute that cannot hold on a split model, where each rank holds only its stages
    (an AttributeError too, so `hasattr` and `getattr(model, name, default)` answer as for a missing attribute)."""
