"""Command line: `hfsplit plan` — will it fit, and how — before a byte of weights is read."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .costs import DEFAULT_RESERVE_BYTES, TrainingSpec
from .errors import HfsplitError


def plan_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="plan a split of MODEL over a memory budget (reads config.json only)")
    p.add_argument("model", help="hub name (org/name), local folder, or config.json")
    p.add_argument("--max-memory", required=True, help='per-device budget: "4x24GiB", "24GiB,12GiB,12GiB"')
    method = p.add_mutually_exclusive_group()
    method.add_argument("--lora-r", type=int, default=16, help="LoRA rank (default method: LoRA, r=16)")
    method.add_argument("--full", action="store_true", help="full fine-tuning with AdamW")
    method.add_argument("--inference", action="store_true", help="forward only")
    p.add_argument("--qlora", action="store_true", help="LoRA (--lora-r) on a bitsandbytes 4-bit base (NF4, double quant)")
    p.add_argument("--bnb-4bit-quant-type", default="nf4", help="QLoRA: nf4 | fp4")
    p.add_argument("--bnb-4bit-use-double-quant", choices=("on", "off"), default="on", help="QLoRA: double quantization")
    p.add_argument("--load-in-8bit", action="store_true", help="QLoRA with an 8-bit base instead of 4-bit")
    p.add_argument("--lora-targets", default=None, help="comma-separated module names (default: all projections)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step (default 4 × stages)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (sets --micro-batches)")
    p.add_argument("--schedule", default="1F1B", help="1F1B | GPipe | Interleaved1F1B | ZBVZeroBubble")
    p.add_argument("--activation-checkpointing", choices=("on", "off", "auto"), default="auto")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32")
    p.add_argument("--reserve", default=None, help=f"per-device reserve (default {DEFAULT_RESERVE_BYTES >> 30}GiB)")
    p.add_argument("--device-speeds", default=None, help="relative speeds, e.g. 1,1,0.5")
    p.add_argument("--tp", type=int, default=None, help="force the tensor-parallel degree")
    p.add_argument("--pp", type=int, default=None, help="force the pipeline depth")
    p.add_argument("--json", action="store_true", help="print the Plan as JSON")
    p.add_argument("--png", default=None, help="draw per-device memory bars into this PNG file")
    return p


def spec_from_args(args) -> TrainingSpec:
    from .budget import parse_size

    if args.qlora and (args.full or args.inference):
        raise HfsplitError("--qlora trains LoRA adapters on a quantized base; drop --full / --inference")
    method = "full" if args.full else "inference" if args.inference else "qlora" if args.qlora else "lora"
    targets = tuple(t.strip() for t in args.lora_targets.split(",")) if args.lora_targets else None
    reserve = parse_size(args.reserve, what="--reserve") if args.reserve else DEFAULT_RESERVE_BYTES
    return TrainingSpec(method=method, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                        dtype=args.dtype, lora_r=args.lora_r, lora_targets=targets, reserve_bytes=reserve,
                        bnb_4bit_quant_type=args.bnb_4bit_quant_type,
                        bnb_4bit_use_double_quant=args.bnb_4bit_use_double_quant == "on", load_in_8bit=args.load_in_8bit)


def run_plan(args) -> int:
    from .budget import parse_max_memory
    from .charts import plan_memory_chart
    from .planner import make_plan

    budgets = parse_max_memory(args.max_memory)
    speeds = None
    if args.device_speeds:
        values = [float(v) for v in args.device_speeds.split(",")]
        if len(values) != len(budgets):
            raise HfsplitError(f"--device-speeds has {len(values)} values for {len(budgets)} devices; give one each")
        speeds = dict(zip(budgets, values))
    ac = {"on": True, "off": False, "auto": "auto"}[args.activation_checkpointing]
    plan = make_plan(args.model, budgets, spec=spec_from_args(args), micro_batches=args.micro_batches,
                     global_batch=args.global_batch, schedule=args.schedule, activation_checkpointing=ac,
                     device_speeds=speeds, tp=args.tp, pp=args.pp)
    print(plan.to_json() if args.json else plan.table())
    if args.png:
        print(f"memory chart: {plan_memory_chart(plan, args.png)}", file=sys.stderr)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="hfsplit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plan_parser(sub)
    args = parser.parse_args(argv)
    try:
        return run_plan(args)
    except HfsplitError as exc:
        print(f"hfsplit {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
