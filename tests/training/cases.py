"""Functions the multi-process training tests run on every rank (see tests/parallel/launcher.py)."""


def finetune_losses(runs: list[dict]) -> list[list[float]]:
    """Train each run's options in turn on this rank; the per-step losses of each."""
    from hfsplit.training.options import FinetuneOptions
    from hfsplit.training.trainer import train

    return [train(FinetuneOptions(**options), progress=False).losses for options in runs]
