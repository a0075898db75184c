"""Rank side of the MoE tensor-parallel tests: one launch of ranks per split shape runs both families' cases in turn
(tests/parallel/test_families_split.py: the split against transformers, the router auxiliary loss under TP, 20 steps
of LoRA and of full training with the output saved, a resume under another split), and each rank's memory of a
step against the plan (tests/planning/test_costs.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from tests.parallel.family_cases import one_case
from tests.parallel.moe_cases import router_loss_matches


def moe_tp_on_split(*, cases: list[dict], training: dict, probe: list, out_dir: str,
                    resume: Optional[dict] = None) -> dict:
    """{case name: `one_case` results + "router": `router_loss_matches` on the case's router checkpoint (+ "resume":
    `resume_under_another_split` with `resume`'s other split and options, when given)}."""
    results = {}
    for case in cases:
        print(f"--- moe tp case {case['name']}", flush=True)  # the launcher's error shows the last lines
        split = {k: case[k] for k in ("tp", "pp", "layers", "schedule")}
        try:
            out = one_case(case, training=training, probe=torch.tensor(probe), out_dir=Path(out_dir) / case["name"])
            out["router"] = router_loss_matches(checkpoint=case["router_checkpoint"], micro_batches=2, **split)
            if resume is not None:
                out["resume"] = resume_under_another_split(checkpoint=case["checkpoint"], split=split, **resume,
                                                           folder=str(Path(out_dir) / case["name"] / "resume"))
        except Exception as exc:
            raise RuntimeError(f"moe tp case {case['name']}: {type(exc).__name__}: {exc}") from exc
        results[case["name"]] = out
    return results


def moe_tp_step_memory(*, cases: dict, **step) -> dict:
    """{name: `apply_cases.step_memory_and_losses` of the case's checkpoint and method} at tp=2, one launch."""
    from tests.parallel.apply_cases import step_memory_and_losses

    return {name: step_memory_and_losses(checkpoint=checkpoint, method=method, tp=2, pp=1, **step)
            for name, (checkpoint, method) in cases.items()}


def resume_under_another_split(*, checkpoint: str, split: dict, other: dict, options: dict, folder: str) -> dict:
    """Two full-training steps on `split`, the trainer state written as a run writes it, read by a run on `other`
    (the same ranks): the largest difference of each trainable tensor and AdamW moment from the one saved."""
    from hfsplit.checkpoint import load_config
    from hfsplit.load.launch import split_from_pretrained
    from hfsplit.apply.tp import full_tensor
    from hfsplit.training.options import tiny_demo_options
    from hfsplit.training.resume import checkpoint_names, read_trainer_state, write_trainer_state
    from tests.parallel.cases import hand_plan
    from tests.parallel.family_cases import _run, _step

    opts = tiny_demo_options(**options, model=checkpoint, method="full")
    runs = []
    for layout in (split, other):
        plan = hand_plan(load_config(checkpoint), **layout, micro_batches=opts.micro_batches, seq_len=opts.seq_len)
        runs.append(_run(opts, split_from_pretrained(checkpoint, plan=plan, dtype=torch.float32), checkpoint=checkpoint))
    saved, resumed = runs
    for _ in range(2):
        _step(saved)
    state = ("model", "params", "optimizer", "scheduler", "batches")
    Path(folder).mkdir(parents=True, exist_ok=True)
    write_trainer_state(Path(folder), **{k: getattr(saved, k) for k in state}, step=2)
    untrained = {name: full_tensor(p.detach()).clone() for p, name in checkpoint_names(resumed.model, resumed.params).items()}
    read_trainer_state(Path(folder), **{k: getattr(resumed, k) for k in state})
    want = {}  # every TP rank gathers each tensor, in the same order
    for p, name in checkpoint_names(saved.model, saved.params).items():
        moments = saved.optimizer.state[p]
        want[name] = [full_tensor(t) for t in (p.detach(), moments["exp_avg"], moments["exp_avg_sq"])]
    diffs = {}
    for p, name in checkpoint_names(resumed.model, resumed.params).items():
        moments = resumed.optimizer.state[p]
        got = [full_tensor(t) for t in (p.detach(), moments["exp_avg"], moments["exp_avg_sq"])]
        diffs[name] = max((a - b).abs().max().item() for a, b in zip(got, want[name]))
    # the steps moved the weights from the checkpoint's: a resume that read nothing would show
    return {"diffs": diffs, "moved": max((want[n][0] - t).abs().max().item() for n, t in untrained.items())}
