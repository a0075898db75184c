"""Rank side of the MoE tensor-parallel test (tests/parallel/test_families_split.py): one launch of ranks per split
shape runs both families' cases in turn: the split against transformers, the router auxiliary loss under TP, then
20 steps of LoRA and of full training with the output saved (`family_cases.one_case`)."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.parallel.family_cases import one_case
from tests.parallel.moe_cases import router_loss_matches


def moe_tp_on_split(*, cases: list[dict], training: dict, probe: list, out_dir: str) -> dict:
    """{case name: `one_case` results + "router": `router_loss_matches` on the case's router checkpoint}."""
    results = {}
    for case in cases:
        print(f"--- moe tp case {case['name']}", flush=True)  # the launcher's error shows the last lines
        split = {k: case[k] for k in ("tp", "pp", "layers", "schedule")}
        try:
            out = one_case(case, training=training, probe=torch.tensor(probe), out_dir=Path(out_dir) / case["name"])
            out["router"] = router_loss_matches(checkpoint=case["router_checkpoint"], micro_batches=2, **split)
        except Exception as exc:
            raise RuntimeError(f"moe tp case {case['name']}: {type(exc).__name__}: {exc}") from exc
        results[case["name"]] = out
    return results


def moe_tp_step_memory(*, cases: dict, **step) -> dict:
    """{name: `apply_cases.step_memory_and_losses` of the case's checkpoint and method} at tp=2, one launch."""
    from tests.parallel.apply_cases import step_memory_and_losses

    return {name: step_memory_and_losses(checkpoint=checkpoint, method=method, tp=2, pp=1, **step)
            for name, (checkpoint, method) in cases.items()}
