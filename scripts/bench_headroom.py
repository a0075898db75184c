"""The flagship QLoRA plans with offloaded checkpointing and 8-bit moments, per card, on the meta device.

    python scripts/bench_headroom.py [--gpu "RTX 4090"] [--markdown]

For each target of issue 21 it plans (no GPU, no weights: config.json and traced costs only) the job the planner
decides freely and the same job held to checkpointing on the device with fp32 moments (what hfsplit planned before),
and prints per card the plan's total, what each stage trades (checkpointing, moments) and the host RAM its offload
needs, with the estimated step on `--gpu` (its datasheet bf16 FLOP/s × timing.ACHIEVED, PCIe 4.0 host link).
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from hfsplit.budget import format_bytes
from hfsplit.errors import PlanError
from hfsplit.plan import TrainingSpec, rank_total
from hfsplit.planning.planner import make_plan
from hfsplit.planning.timing import DEVICE_FLOPS, known_flops

QLORA = TrainingSpec(method="qlora", lora_r=16, seq_len=2048)
TARGETS = [
    ("meta-llama/Llama-3.1-70B", 2, QLORA),
    ("meta-llama/Llama-3.1-70B", 2, replace(QLORA, micro_batch_size=2, chunked_loss=True)),
    ("meta-llama/Llama-3.1-70B", 2, replace(QLORA, seq_len=4096, chunked_loss=True)),
    ("Qwen/Qwen2.5-32B", 1, replace(QLORA, seq_len=4096, chunked_loss=True)),
    ("meta-llama/Llama-3.1-70B", 4, replace(QLORA, lora_r=64, seq_len=8192)),
]


def describe(spec: TrainingSpec) -> str:
    return (f"QLoRA r={spec.lora_r}, seq {spec.seq_len} × micro-batch {spec.micro_batch_size}"
            + (", chunked loss" if spec.chunked_loss else ""))


def cards(plan) -> str:
    """Per card: total of its stages / budget, and each stage's (layers, checkpointing, moments, host RAM)."""
    out = []
    for r in range(plan.pp):
        mine = plan.stages_of_rank(r)
        total = rank_total(s.memory for s in mine)
        trades = "; ".join(f"layers {s.layers[0]}-{s.layers[1] - 1} {s.checkpointing} "
                           f"{'8-bit' if 'bit' in s.optim else 'fp32'}" for s in mine)
        host = sum(s.memory.offload for s in mine)
        out.append(f"GPU {r}: {format_bytes(total)} ({100 * total / mine[0].budget:.1f}%), host {format_bytes(host)}"
                   f" [{trades}]")
    return " / ".join(out)


def row(model: str, count: int, spec: TrainingSpec, *, speed: float, markdown: bool) -> str:
    budget = f"{count}x24GiB"
    options = dict(spec=spec, device_speeds={str(i): speed for i in range(count)})
    try:
        before = make_plan(model, budget, activation_checkpointing=True, optim="adamw_torch", **options)
        was = f"fits ({max(rank_total(s.memory for s in before.stages_of_rank(r)) for r in range(before.pp)) / 2**30:.2f} GiB)"
    except PlanError as exc:
        was = "no fit: " + next(line.strip() for line in str(exc).splitlines() if "needs" in line)
    plan = make_plan(model, budget, **options)
    kept = make_plan(model, budget, headroom=0.03, **options)
    tokens = plan.micro_batches * plan.dp * spec.micro_batch_size * spec.seq_len
    cells = [f"{model.split('/')[1]} {describe(spec)} on {budget}", f"pp={plan.pp} dp={plan.dp} {plan.schedule}",
             cards(plan), f"{plan.step_time_s:.1f} s ({tokens / plan.step_time_s:.0f} tokens/s)",
             f"{kept.step_time_s:.1f} s, max {max(rank_total(s.memory for s in kept.stages_of_rank(r)) / 2**30 for r in range(kept.pp)):.2f} GiB",
             was]
    return ("| " + " | ".join(cells) + " |") if markdown else "\n  ".join(cells)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", default="RTX 4090", help="GPU kind for the step estimate (hfsplit.planning.timing.KNOWN_FLOPS)")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    speed = known_flops(args.gpu) / DEVICE_FLOPS
    if args.markdown:
        print("| job | split | per card (auto) | estimated step | with --headroom 0.03 | before (ckpt on, fp32) |\n"
              "| --- | --- | --- | --- | --- | --- |")
    for model, count, spec in TARGETS:
        print(row(model, count, spec, speed=speed, markdown=args.markdown), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
