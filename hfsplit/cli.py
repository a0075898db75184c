"""Command line: `hfsplit plan` — will it fit, and how — before a byte of weights is read."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .errors import HfsplitError
from .plan import TrainingSpec


def plan_parser(sub) -> argparse.ArgumentParser:
    from .training.options import FinetuneOptions

    recipe = FinetuneOptions()  # `hfsplit plan` and the recipe share their defaults
    p = sub.add_parser("plan", help="plan a split of MODEL over a memory budget (reads config.json only)")
    p.add_argument("model", nargs="?", default=None,
                   help="hub name (org/name), local folder, or config.json (default: the --config recipe's model)")
    p.add_argument("--config", default=None,
                   help="a fine-tuning recipe (YAML): plan exactly what it would run; flags given here override it")
    p.add_argument("--max-memory", default=None, help='per-device budget: "4x24GiB", "24GiB,12GiB,12GiB"')
    method = p.add_mutually_exclusive_group()
    method.add_argument("--lora-r", type=int, default=None, help=f"LoRA rank (default method: LoRA, r={recipe.lora_r})")
    method.add_argument("--full", action="store_true", help="full fine-tuning with AdamW")
    method.add_argument("--inference", action="store_true", help="forward only")
    p.add_argument("--qlora", action="store_true", help="LoRA (--lora-r) on a bitsandbytes 4-bit base (NF4, double quant)")
    p.add_argument("--bnb-4bit-quant-type", default="nf4", help="QLoRA: nf4 | fp4")
    p.add_argument("--bnb-4bit-use-double-quant", choices=("on", "off"), default="on", help="QLoRA: double quantization")
    p.add_argument("--load-in-8bit", action="store_true", help="QLoRA with an 8-bit base instead of 4-bit")
    p.add_argument("--quantize-experts", choices=("on", "off"), default="on",
                   help="QLoRA on an MoE: its fused experts 4-bit too, expert by expert (off: kept in --dtype)")
    p.add_argument("--chunked-loss", action="store_true",
                   help="last stage: lm_head + loss a chunk of tokens at a time, no whole-micro-batch logits")
    p.add_argument("--lora-targets", default=None, help="comma-separated module names (default: all projections)")
    p.add_argument("--seq-len", type=int, default=None, help=f"tokens per sequence (default {recipe.seq_len})")
    p.add_argument("--micro-batch-size", type=int, default=None, help=f"default {recipe.micro_batch_size}")
    p.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step (default 4 × stages)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step (sets --micro-batches; under --schedule auto the time model picks the cut)")
    p.add_argument("--schedule", default=None, help=f"auto (fastest by the time model; prints each candidate's step) | 1F1B | GPipe | "
                                                    f"Interleaved1F1B | ZBVZeroBubble | DualPipeV (default {recipe.schedule})")
    p.add_argument("--activation-checkpointing", choices=("on", "off", "auto"), default=None, help="default auto")
    p.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default bfloat16)")
    p.add_argument("--reserve", default=None, help="per-device reserve overriding the measured one (0 on the CPU; "
                                                   "on GPUs context + fragmentation + NCCL, see hfsplit/reserve.py)")
    p.add_argument("--device-speeds", default=None, help="relative speeds, e.g. 1,1,0.5")
    p.add_argument("--tp", type=int, default=None, help="force the tensor-parallel degree")
    p.add_argument("--pp", type=int, default=None, help="force the pipeline depth")
    p.add_argument("--json", action="store_true", help="print the Plan as JSON")
    p.add_argument("--png", default=None, help="draw per-device memory bars into this PNG file")
    return p


def spec_from_args(args) -> TrainingSpec:
    from .budget import parse_size
    from .training.options import FinetuneOptions

    recipe = FinetuneOptions()
    if args.qlora and (args.full or args.inference):
        raise HfsplitError("--qlora trains LoRA adapters on a quantized base; drop --full / --inference")
    method = "full" if args.full else "inference" if args.inference else "qlora" if args.qlora else "lora"
    targets = tuple(t.strip() for t in args.lora_targets.split(",")) if args.lora_targets else None
    reserve = parse_size(args.reserve, what="--reserve") if args.reserve else None
    return TrainingSpec(method=method, seq_len=_given(args.seq_len, recipe.seq_len),
                        micro_batch_size=_given(args.micro_batch_size, recipe.micro_batch_size),
                        dtype=args.dtype or "bfloat16", lora_r=_given(args.lora_r, recipe.lora_r),
                        lora_targets=targets, reserve_bytes=reserve, bnb_4bit_quant_type=args.bnb_4bit_quant_type,
                        bnb_4bit_use_double_quant=args.bnb_4bit_use_double_quant == "on", load_in_8bit=args.load_in_8bit,
                        chunked_loss=args.chunked_loss, quantize_experts=args.quantize_experts == "on")


def _given(value, default):
    return default if value is None else value


def plan_request(args) -> tuple[str, object, dict]:
    """(model, budget, make_plan keyword arguments) of the flags alone, or of the --config recipe
    (exactly as the trainer plans it) with the flags given here overriding it."""
    from .budget import parse_max_memory

    if args.config:
        return recipe_request(args)
    if args.model is None or args.max_memory is None:
        raise HfsplitError("hfsplit plan needs MODEL and --max-memory, or --config RECIPE.yaml")
    ac = {"on": True, "off": False, "auto": "auto", None: "auto"}[args.activation_checkpointing]
    schedule = args.schedule or "auto"
    cut = args.global_batch and args.micro_batches is None and schedule == "auto"  # auto cuts the global batch
    return args.model, parse_max_memory(args.max_memory), dict(
        spec=spec_from_args(args), micro_batches="auto" if cut else args.micro_batches, global_batch=args.global_batch,
        schedule=schedule, activation_checkpointing=ac, tp=args.tp, pp=args.pp)


def recipe_request(args) -> tuple[str, object, dict]:
    from .budget import parse_max_memory
    from .training.options import parse_options, plan_arguments

    flags = {"--lora-r": args.lora_r, "--seq-len": args.seq_len, "--micro-batch-size": args.micro_batch_size,
             "--micro-batches": args.micro_batches, "--schedule": args.schedule, "--dtype": args.dtype,
             "--lora-targets": args.lora_targets, "--tp": args.tp, "--pp": args.pp, "--max-memory": args.max_memory,
             "--model": args.model, "--activation-checkpointing": args.activation_checkpointing,
             "--global-batch": args.global_batch}
    argv = ["--config", args.config] + [x for k, v in flags.items() if v is not None for x in (k, str(v))]
    argv += ["--method", "full"] if args.full else ["--method", "qlora"] if args.qlora else []
    argv += ["--chunked-loss"] if args.chunked_loss else []
    argv += ["--quantize-experts", "off"] if args.quantize_experts == "off" else []
    options = parse_options(argv)
    if args.inference or args.reserve:
        raise HfsplitError("--inference and --reserve do not apply to a recipe (--config); "
                           "set the recipe's own options instead")
    if options.max_memory is None:
        raise HfsplitError(f"{args.config} sets no max_memory (the run takes what its devices have free); "
                           "pass --max-memory to plan it")
    budgets = parse_max_memory(options.max_memory)
    model = options.model or tiny_model_folder()
    return model, budgets, plan_arguments(options, world_size=len(budgets))


def tiny_model_folder() -> str:
    """The recipe's built-in tiny model, written to a temporary folder (its config is all planning reads)."""
    import tempfile

    from .checkpoint.synthetic import write_tiny_checkpoint
    from .training.trainer import TINY_MODEL

    spec = dict(TINY_MODEL)
    folder = f"{tempfile.mkdtemp(prefix='hfsplit-tiny-')}/tiny-llama"
    write_tiny_checkpoint(folder, spec.pop("arch"), sharded=True, **spec)
    return folder


def run_plan(args) -> int:
    from .charts import plan_memory_chart
    from .planner import make_plan

    model, budgets, kwargs = plan_request(args)
    if args.device_speeds:
        values = [float(v) for v in args.device_speeds.split(",")]
        if len(values) != len(budgets):
            raise HfsplitError(f"--device-speeds has {len(values)} values for {len(budgets)} devices; give one each")
        kwargs["device_speeds"] = dict(zip(budgets, values))
    plan = make_plan(model, budgets, **kwargs)
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
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
