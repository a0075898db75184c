"""Rank side of tests/parallel/test_tp_sweep.py: the tp=2 sweep, then one proven undeclared family split at tp=2 as a
run builds it (the gate, the checkpoint reader's slices, `SplitModel.sync_grads`), in the same launch."""
from __future__ import annotations


def sweep_then_split(*, checkpoint: str, num_layers: int) -> dict:
    """{"verdicts": the sweep's verdicts, "split": `cases.split_matches_transformers` of `checkpoint` at tp=2}."""
    from hfsplit.load.tp_proof import tp_sweep
    from tests.parallel.cases import split_matches_transformers

    verdicts = tp_sweep()
    print("--- tp=2 split of the checkpoint", flush=True)
    split = split_matches_transformers(checkpoint=checkpoint, tp=2, pp=1, layers=[(0, num_layers)], schedule="GPipe",
                                       micro_batches=1)
    return {"verdicts": verdicts, "split": split}


def rounding_and_a_fault() -> dict:
    """{"rounding": the sweep's verdicts of the types whose float32 gradients amplify rounding past the tolerance,
    "fault": Apertus's verdict with the amendment that sums its activation's gradient over the ranks taken away}."""
    from torch.distributed.device_mesh import init_device_mesh

    from hfsplit.load.tp_proof import TP, tp_sweep, tp_verdict
    from hfsplit.models.families import TP_PLAN_AMENDS

    rounding = tp_sweep(["qwen3_next", "gemma3n_text"])
    amends = TP_PLAN_AMENDS.pop("apertus")
    try:
        fault = tp_verdict("apertus", init_device_mesh("cpu", (TP,)))
    finally:
        TP_PLAN_AMENDS["apertus"] = amends
    return {"rounding": rounding, "fault": fault}
