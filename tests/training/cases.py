"""Functions the multi-process training tests run on every rank (see tests/parallel/launcher.py)."""


def finetune_losses(runs: list[dict]) -> list[list[float]]:
    """Train each run's options in turn on this rank; the per-step losses of each."""
    from hfsplit.training.options import tiny_demo_options
    from hfsplit.training.run import train

    return [train(tiny_demo_options(**options), progress=False).losses for options in runs]


def crash_mid_save(*, checkpoint: str, out: str) -> dict:
    """Save checkpoint-1, crash (on every rank) inside checkpoint-2's save, then save checkpoint-2 again:
    what the folder held after the crash."""
    from pathlib import Path

    from hfsplit.plan import TrainingSpec
    from hfsplit.load.launch import split_from_pretrained
    from hfsplit.parallel.save import save_split_model

    model = split_from_pretrained(checkpoint, "2x2GiB", spec=TrainingSpec(method="full", seq_len=8, dtype="float32"),
                                  micro_batches=2, pp=2, tp=1)
    save_split_model(model, Path(out) / "checkpoint-1", method="full")

    def disk_full(tmp):
        raise OSError(28, "No space left on device", str(tmp))

    try:
        save_split_model(model, Path(out) / "checkpoint-2", method="full", extra=disk_full)
    except OSError:
        pass
    after_crash = sorted(p.name for p in Path(out).iterdir())
    save_split_model(model, Path(out) / "checkpoint-2", method="full")
    return {"after_crash": after_crash, "after_retry": sorted(p.name for p in Path(out).iterdir())}


def finetune_losses_or_idle(runs: list[dict]):
    """`finetune_losses`, or the one line of a rank the run left out (`RankIdle`)."""
    from hfsplit.errors import RankIdle

    try:
        return finetune_losses(runs)
    except RankIdle as exc:
        return str(exc)
