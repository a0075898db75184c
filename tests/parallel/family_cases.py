"""Rank side of tests/parallel/test_families_split.py: one launch of ranks runs every family's case of one split
shape in turn (a process launch costs more than a tiny family's whole check).

Each case: logits, gradients and greedy generation against transformers (`cases.split_matches_transformers`),
then 20 steps of LoRA and of full training through the trainer's own `train_step` on the trainer's own
micro-batches, the trained model's logits on a probe, and its output saved as a run saves it; the parent test
compares all of it with a single-process transformers (+ peft) run.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch

from tests.parallel.cases import hand_plan, split_matches_transformers

METHODS = ("lora", "full")


def families_on_split(*, cases: list[dict], training: dict, probe: list, out_dir: str) -> dict:
    """{case name: its results} for every case, in order; a failing case re-raises under its name.
    `training`: FinetuneOptions fields by method (without model, method, output_dir)."""
    results = {}
    for case in cases:
        print(f"--- family case {case['name']}", flush=True)  # the launcher's error shows the last lines
        try:
            results[case["name"]] = one_case(case, training=training, probe=torch.tensor(probe),
                                             out_dir=Path(out_dir) / case["name"])
        except Exception as exc:
            raise RuntimeError(f"family case {case['name']}: {type(exc).__name__}: {exc}") from exc
    return results


def one_case(case: dict, *, training: dict, probe: torch.Tensor, out_dir: Path) -> dict:
    split = {k: case[k] for k in ("tp", "pp", "layers", "schedule")}
    start = time.perf_counter()
    # a case may compare in float64 (test_families_split.CASES says which and why); training stays as the trainer runs
    out = split_matches_transformers(checkpoint=case["checkpoint"], dtype=getattr(torch, case.get("dtype", "float32")),
                                     **split)
    out["seconds"] = {"equality": time.perf_counter() - start}
    out["training"] = {}
    for method in METHODS:
        start = time.perf_counter()
        out["training"][method] = train_split(case["checkpoint"], split, method=method, options=training,
                                              probe=probe, out_dir=out_dir / method if case["save"] else None)
        out["seconds"][method] = time.perf_counter() - start
    return out


def train_split(checkpoint: str, split: dict, *, method: str, options: dict, probe: torch.Tensor,
                out_dir: Optional[Path]) -> dict:
    """`options.max_steps` steps of `method` on the hand-made split: per-step losses (every rank), the trained
    model's probe logits, and where its output was saved under `out_dir` (LoRA: the adapter and the merged
    model; nothing without `out_dir`)."""
    from hfsplit.checkpoint import load_config
    from hfsplit.load.launch import split_from_pretrained
    from hfsplit.training.options import tiny_demo_options

    started = time.perf_counter()
    opts = tiny_demo_options(**options[method], model=checkpoint, method=method)
    config = load_config(checkpoint)
    plan = hand_plan(config, **split, micro_batches=opts.micro_batches, method=method, seq_len=opts.seq_len)
    run = _run(opts, split_from_pretrained(checkpoint, plan=plan, dtype=torch.float32,
                                           lora=_lora(opts, checkpoint)), checkpoint=checkpoint)
    built = time.perf_counter()
    losses = [_step(run) for _ in range(opts.max_steps)]
    with torch.no_grad():
        logits = run.model(probe, broadcast=True)
    trained = time.perf_counter()
    saved = _save(run, method=method, out_dir=out_dir) if out_dir is not None else {}
    seconds = {"build": built - started, "steps": trained - built, "save": time.perf_counter() - trained}
    return {"losses": losses, "probe_logits": logits, "saved": saved, "seconds": seconds}


def _save(run, *, method: str, out_dir: Path) -> dict[str, str]:
    """The run's output as the trainer writes it: `model/`, or `adapter/` and `merged/` for LoRA."""
    from hfsplit.parallel.save import save_split_model

    base = run.model_path
    if method == "full":
        return {"model": str(save_split_model(run.model, out_dir / "model", method="full", base_model=base))}
    return {"adapter": str(save_split_model(run.model, out_dir / "adapter", method="lora",
                                            lora_config=run.lora_config, base_model=base)),
            "merged": str(save_split_model(run.model, out_dir / "merged", method="full", merge_lora=True,
                                           base_model=base))}


def _lora(opts, checkpoint: str):
    """The options' LoRA (None for full training): the hand plan's spec does not carry them, so the adapters are built
    from the options with the builder a run's spec uses."""
    from hfsplit.apply.lora import LoraSetup, lora_config
    from hfsplit.checkpoint import load_config

    if opts.method not in ("lora", "qlora"):
        return None
    config = lora_config(r=opts.lora_r, alpha=opts.lora_alpha, dropout=opts.lora_dropout, targets=opts.lora_targets,
                         model_config=load_config(checkpoint))
    return LoraSetup(config, seed=opts.seed)


def _run(opts, model, *, checkpoint: str):
    """The trainer's `Run` over `model` (a split made from a hand plan): its data, optimizer and schedule."""
    from hfsplit.models.loss import causal_lm_loss
    from hfsplit.training.run import data_of_run, load_rows
    from hfsplit.training.trainer import Run

    tokenizer, rows = load_rows(opts, model_path=checkpoint)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opts.learning_rate, weight_decay=opts.weight_decay)
    lora = _lora(opts, checkpoint)
    return Run(options=opts, model=model, model_path=checkpoint, tokenizer=tokenizer, params=params,
               optimizer=optimizer, loss_fn=causal_lm_loss(model.config.vocab_size),
               lora_config=lora.config if lora else None,
               **data_of_run(opts, rows, plan=model.plan, optimizer=optimizer))


def _step(run) -> float:
    from hfsplit.training.trainer import train_step

    outcome = train_step(run, next(run.batches))
    assert outcome.finite, outcome
    return outcome.loss
